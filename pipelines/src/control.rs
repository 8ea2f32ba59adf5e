//! What every ControlNet pipeline takes and does alike, as diffusers' ControlNet pipelines:
//! one [`Control`] per ControlNet (its image, `controlnet_conditioning_scale` and
//! `control_guidance_start` / `control_guidance_end`), guess mode, the per-step "keep" of each
//! ControlNet's guidance window, and the conditioning images prepared as `prepare_image`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::{
    AddedCondition, ControlNetModel, ControlResiduals, ModelError, UNet2DConditionModel,
};

use crate::error::{PipelineError, Result};
use crate::image::preprocess_control;
use crate::inpaint::InpaintCondition;
use crate::stable_diffusion::combine_halves;

/// One ControlNet's input: its conditioning image and how strongly and when it applies.
#[derive(Debug, Clone, PartialEq)]
pub struct Control {
    /// The conditioning image (edges, depth, pose ...), resized to the output size.
    pub image: image::DynamicImage,
    /// diffusers' `controlnet_conditioning_scale` (default 1).
    pub scale: f64,
    /// The fraction of the steps, in [0, 1], where the ControlNet starts and stops applying
    /// (`control_guidance_start` / `control_guidance_end`; default the whole schedule).
    pub guidance_start: f64,
    pub guidance_end: f64,
}

impl Control {
    /// `image` at scale 1 over the whole schedule.
    pub fn new(image: image::DynamicImage) -> Self {
        Self {
            image,
            scale: 1.0,
            guidance_start: 0.0,
            guidance_end: 1.0,
        }
    }

    /// Whether the ControlNet applies at step `i` of `n`: diffusers'
    /// `1 - (i / n < start or (i + 1) / n > end)`.
    pub fn keeps(&self, i: usize, n: usize) -> bool {
        let (i, n) = (i as f64, n as f64);
        !(i / n < self.guidance_start || (i + 1.0) / n > self.guidance_end)
    }
}

/// The ControlNet inputs of a request, one [`Control`] per ControlNet of the pipeline, and
/// diffusers' `guess_mode` (the ControlNet sees no negative prompt and its residuals ramp up
/// from 0.1 to 1 through the blocks).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ControlRequest {
    pub controls: Vec<Control>,
    pub guess_mode: bool,
}

impl ControlRequest {
    /// Checks the request against `nets` ControlNets: one control each, scales finite, each
    /// window inside [0, 1] with its start before its end (diffusers' `check_inputs`).
    pub fn check(&self, nets: usize) -> Result<()> {
        if self.controls.len() != nets {
            return Err(PipelineError::InvalidInput(format!(
                "{} control images for {nets} ControlNets: give one control image per \
                 ControlNet, in the same order",
                self.controls.len()
            )));
        }
        for (k, c) in self.controls.iter().enumerate() {
            if !c.scale.is_finite() {
                return Err(PipelineError::InvalidInput(format!(
                    "ControlNet {k}: conditioning scale {} is not a finite number",
                    c.scale
                )));
            }
            let inside = |v: f64| (0.0..=1.0).contains(&v);
            if !inside(c.guidance_start) || !inside(c.guidance_end) {
                return Err(PipelineError::InvalidInput(format!(
                    "ControlNet {k}: the guidance window [{}, {}] must lie in [0, 1]",
                    c.guidance_start, c.guidance_end
                )));
            }
            if c.guidance_start >= c.guidance_end {
                return Err(PipelineError::InvalidInput(format!(
                    "ControlNet {k}: control guidance start {} must be below its end {}",
                    c.guidance_start, c.guidance_end
                )));
            }
        }
        Ok(())
    }

    /// The output size: the request's, else the first control image's, each rounded down to
    /// `multiple` (diffusers takes it from the prepared image).
    pub fn size(
        &self,
        width: Option<usize>,
        height: Option<usize>,
        multiple: usize,
    ) -> (usize, usize) {
        let first = self
            .controls
            .first()
            .map(|c| (c.image.width(), c.image.height()));
        let (w, h) = first.map_or((0, 0), |(w, h)| (w as usize, h as usize));
        let round = |v: usize| v - v % multiple.max(1);
        (round(width.unwrap_or(w)), round(height.unwrap_or(h)))
    }
}

/// ControlNets and the controls of one call, as the editing pipelines take them.
#[derive(Clone, Copy)]
pub struct Controls<'a, B: Backend> {
    pub nets: &'a [ControlNetModel<B>],
    pub request: &'a ControlRequest,
}

/// What each denoising step of a controlled run adds: the ControlNets with their prepared
/// conditioning images (diffusers' `prepare_image`: `[batch, 3, h, w]` in [0, 1], doubled for
/// guidance unless in guess mode), the conditional half of the text context and, for SDXL, the
/// added condition (all rows, and the conditional half for guess mode).
pub struct ControlStep<'a, B: Backend> {
    controls: Controls<'a, B>,
    images: Vec<Tensor<B, 4>>,
    positive: Tensor<B, 3>,
    added: Option<Added<B>>,
    /// The steps the run takes (the guidance windows are fractions of them).
    steps: usize,
}

/// SDXL's added condition for the UNet batch and its conditional rows.
struct Added<B: Backend> {
    all: AddedCondition<B>,
    positive: AddedCondition<B>,
}

impl<'a, B: Backend> ControlStep<'a, B> {
    /// Prepares `controls` for a run of `steps` steps at `width x height` over a batch of
    /// `batch` latents with the text `context` (`2 * batch` rows with guidance).
    pub fn new(
        controls: Controls<'a, B>,
        (width, height): (usize, usize),
        batch: usize,
        context: &Tensor<B, 3>,
        steps: usize,
        device: &B::Device,
    ) -> Result<Self> {
        let request = controls.request;
        request.check(controls.nets.len())?;
        let guided = context.dims()[0] == 2 * batch;
        let images = request
            .controls
            .iter()
            .map(|c| {
                let image =
                    preprocess_control::<B>(&c.image, Some(width), Some(height), 1, device)?
                        .repeat_dim(0, batch);
                Ok(if guided && !request.guess_mode {
                    Tensor::cat(vec![image.clone(), image], 0)
                } else {
                    image
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rows = context.dims()[0];
        Ok(Self {
            controls,
            images,
            positive: context.clone().narrow(0, rows - batch, batch),
            added: None,
            steps,
        })
    }

    /// The same with SDXL's added condition (pooled text embeddings and time ids, one row per
    /// context row), which the UNet and ControlNets both take (diffusers' `added_cond_kwargs`;
    /// guess mode gives the ControlNets the conditional rows only).
    pub fn with_added(mut self, added: &AddedCondition<B>) -> Self {
        let rows = added.text_embeds.dims()[0];
        let batch = self.positive.dims()[0];
        let positive = AddedCondition {
            text_embeds: added.text_embeds.clone().narrow(0, rows - batch, batch),
            time_ids: added.time_ids.clone().narrow(0, rows - batch, batch),
        };
        self.added = Some(Added {
            all: added.clone(),
            positive,
        });
        self
    }

    /// One denoiser evaluation with the ControlNets: their residuals at step `i` (from the
    /// 4-channel latents `sample`, doubled for guidance) added to the UNet's skip connections,
    /// then guidance as [`guided_noise`](crate::stable_diffusion::guided_noise) does it. An
    /// inpainting UNet gets its mask channels besides, as diffusers' ControlNet inpaint
    /// pipelines do. Eager.
    #[allow(clippy::too_many_arguments)]
    pub fn noise(
        &self,
        unet: &UNet2DConditionModel<B>,
        i: usize,
        sample: Tensor<B, 4>,
        inpaint: Option<&InpaintCondition<B>>,
        timestep: Tensor<B, 1>,
        context: &Tensor<B, 3>,
        guidance: Tensor<B, 1>,
    ) -> Result<Tensor<B, 4>> {
        let batch = sample.dims()[0];
        let guided = context.dims()[0] == 2 * batch;
        let twice = |x: Tensor<B, 4>| {
            if guided {
                Tensor::cat(vec![x.clone(), x], 0)
            } else {
                x
            }
        };
        let doubled = twice(sample.clone());
        let residuals = self.residuals(i, &sample, &doubled, &timestep, context)?;
        let unet_input = twice(InpaintCondition::unet_input(inpaint, sample));
        let prediction = unet.forward_controlled(
            unet_input,
            timestep,
            context.clone(),
            self.added.as_ref().map(|a| &a.all),
            residuals.as_ref(),
        )?;
        Ok(if guided {
            combine_halves(prediction, batch, guidance)
        } else {
            prediction
        })
    }

    /// The summed residuals of the ControlNets whose guidance window holds step `i`, each
    /// scaled by its conditioning scale; `None` when no window holds it. diffusers runs a
    /// ControlNet outside its window too and multiplies its residuals by 0 (`controlnet_keep`);
    /// adding nothing is the same sum without the ControlNet's cost. `sample` is the scaled latents, `doubled` the UNet's batch (the
    /// same twice with guidance), `context` the UNet's text.
    pub fn residuals(
        &self,
        i: usize,
        sample: &Tensor<B, 4>,
        doubled: &Tensor<B, 4>,
        timestep: &Tensor<B, 1>,
        context: &Tensor<B, 3>,
    ) -> Result<Option<ControlResiduals<B>>> {
        let guided = doubled.dims()[0] == 2 * sample.dims()[0];
        let guess = self.controls.request.guess_mode;
        let mut sum: Option<ControlResiduals<B>> = None;
        let each = self
            .controls
            .nets
            .iter()
            .zip(&self.controls.request.controls)
            .zip(&self.images);
        for ((net, control), image) in each.filter(|((_, c), _)| c.keeps(i, self.steps)) {
            let scale = control.scale;
            let residuals = if guess && guided {
                // Only the conditional half is controlled; the unconditional half gets zeros.
                net.forward(
                    sample.clone(),
                    timestep.clone(),
                    self.positive.clone(),
                    image.clone(),
                    scale,
                    true,
                    self.added.as_ref().map(|a| &a.positive),
                )?
                .after_zeros()
            } else {
                net.forward(
                    doubled.clone(),
                    timestep.clone(),
                    context.clone(),
                    image.clone(),
                    scale,
                    guess,
                    self.added.as_ref().map(|a| &a.all),
                )?
            };
            sum = Some(match sum {
                None => residuals,
                Some(sum) => sum + residuals,
            });
        }
        Ok(sum)
    }
}

/// Refuses ControlNets that do not fit `unet` (residuals of other shapes, another added
/// conditioning), naming the ControlNet and what differs, and those whose downscale is not the
/// VAE's ([`check_downscale`]).
pub fn check_controlnets<B: Backend>(
    nets: &[ControlNetModel<B>],
    unet: &UNet2DConditionModel<B>,
    vae_scale_factor: usize,
) -> Result<()> {
    for (k, net) in nets.iter().enumerate() {
        net.check_fits(unet).map_err(|e| match e {
            ModelError::Input(message) => {
                PipelineError::InvalidInput(format!("ControlNet {k}: {message}"))
            }
            other => other.into(),
        })?;
    }
    check_downscale(nets, vae_scale_factor)
}

/// Refuses ControlNets whose conditioning downscale is not the VAE's (the control image would
/// not land on the latents' grid).
pub fn check_downscale<B: Backend>(
    nets: &[ControlNetModel<B>],
    vae_scale_factor: usize,
) -> Result<()> {
    for (k, net) in nets.iter().enumerate() {
        if net.conditioning_downscale != vae_scale_factor {
            return Err(PipelineError::InvalidInput(format!(
                "ControlNet {k} maps its image down {} times, the VAE {vae_scale_factor} times: \
                 it was made for another base model",
                net.conditioning_downscale
            )));
        }
    }
    Ok(())
}

/// What `compile` and `enable_parallelism` of the ControlNet pipelines say: they run eagerly.
pub(crate) fn eager_only() -> PipelineError {
    PipelineError::Compile(
        "ControlNet pipelines run eagerly for now (each op at once, on any device); drop \
         --compile/--tp/--dp"
            .into(),
    )
}
