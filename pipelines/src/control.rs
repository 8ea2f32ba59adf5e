//! What every ControlNet pipeline takes and does alike, as diffusers' ControlNet pipelines:
//! one [`Control`] per ControlNet (its image, `controlnet_conditioning_scale` and
//! `control_guidance_start` / `control_guidance_end`), guess mode, the per-step "keep" of each
//! ControlNet's guidance window, and the conditioning images prepared as `prepare_image`.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;
use burn::tensor::Tensor;
use std::sync::Arc;

use oxidiff_backend_tpu::spmd::SpmdPlacement;
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::ToDevice;
use oxidiff_models::{
    AddedCondition, ControlNetModel, ControlResiduals, FluxControlNetModel, ModelError,
    SD3ControlNetModel, UNet2DConditionModel,
};

use crate::compiled::{CompileStats, CompiledCall, ComponentStats};
use crate::error::{PipelineError, Result};
use crate::image::preprocess_control;
use crate::inpaint::InpaintCondition;
use crate::parallel::ParallelConfig;
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
    /// A Flux ControlNet-Union's control mode (diffusers' `control_mode`): required for one,
    /// refused for other ControlNets.
    pub control_mode: Option<usize>,
}

impl Control {
    /// `image` at scale 1 over the whole schedule.
    pub fn new(image: image::DynamicImage) -> Self {
        Self {
            image,
            scale: 1.0,
            guidance_start: 0.0,
            guidance_end: 1.0,
            control_mode: None,
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
    /// Control modes are refused: only Flux ControlNet-Unions take one.
    pub fn check(&self, nets: usize) -> Result<()> {
        if let Some((k, mode)) =
            (self.controls.iter().enumerate()).find_map(|(k, c)| c.control_mode.map(|m| (k, m)))
        {
            return Err(PipelineError::InvalidInput(format!(
                "ControlNet {k}: control mode {mode} given, but only Flux ControlNet-Unions take \
                 a control mode; leave it unset"
            )));
        }
        self.check_with_modes(nets)
    }

    /// [`check`](Self::check) with any control modes (their ControlNets check them).
    pub(crate) fn check_with_modes(&self, nets: usize) -> Result<()> {
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

/// Loaded ControlNets of one kind: the UNet's (SD 1.x/2.x, SDXL), SD3's or Flux's.
pub enum ControlNets<B: Backend> {
    Unet(Vec<ControlNetModel<B>>),
    Sd3(Vec<SD3ControlNetModel<B>>),
    Flux(Vec<FluxControlNetModel<B>>),
}

impl<B: Backend> From<Vec<FluxControlNetModel<B>>> for ControlNets<B> {
    fn from(nets: Vec<FluxControlNetModel<B>>) -> Self {
        Self::Flux(nets)
    }
}

impl<B: Backend> From<Vec<ControlNetModel<B>>> for ControlNets<B> {
    fn from(nets: Vec<ControlNetModel<B>>) -> Self {
        Self::Unet(nets)
    }
}

impl<B: Backend> From<Vec<SD3ControlNetModel<B>>> for ControlNets<B> {
    fn from(nets: Vec<SD3ControlNetModel<B>>) -> Self {
        Self::Sd3(nets)
    }
}

impl<B: Backend> ControlNets<B> {
    /// Loads ControlNets, each a diffusers folder loaded by the `_class_name` of its
    /// `config.json` (`ControlNetModel`, `SD3ControlNetModel` or `FluxControlNetModel`) or a
    /// single `ControlNetModel` file (lllyasviel's / A1111's layout or diffusers' names; the
    /// config is the `config.json` beside it if there is one, else read from the tensors:
    /// diffusers' `from_single_file`); kinds cannot be mixed, and another class is an error
    /// naming it.
    pub fn from_paths(
        paths: &[&std::path::Path],
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let mut loaded: Option<Self> = None;
        for &path in paths {
            // A file is a single-file ControlNet, unless it is the weights file of an SD3 or
            // Flux ControlNet folder (those load from their folder).
            let folder = path.parent().filter(|p| p.join("config.json").is_file());
            let dir = match folder {
                _ if !path.is_file() => path,
                Some(folder)
                    if crate::loading::class_name(&folder.join("config.json"))?
                        != "ControlNetModel" =>
                {
                    folder
                }
                _ => {
                    let net = ControlNetModel::from_path(path, variant, dtype, device)?;
                    loaded = Self::merge(loaded, Self::Unet(vec![net]), path)?;
                    continue;
                }
            };
            let config = dir.join("config.json");
            let class = crate::loading::class_name(&config)?;
            let one = match class.as_str() {
                "ControlNetModel" => Self::Unet(vec![ControlNetModel::from_dir_in(
                    dir, variant, dtype, device,
                )?]),
                "SD3ControlNetModel" => Self::Sd3(vec![SD3ControlNetModel::from_dir_in(
                    dir, variant, dtype, device,
                )?]),
                "FluxControlNetModel" => Self::Flux(vec![FluxControlNetModel::from_dir_in(
                    dir, variant, dtype, device,
                )?]),
                other => {
                    return Err(PipelineError::InvalidInput(format!(
                        "{}: `_class_name: {other}` is not a ControlNet oxidiff runs \
                         (ControlNetModel for SD 1.x/2.x and SDXL, SD3ControlNetModel, \
                         FluxControlNetModel)",
                        config.display()
                    )))
                }
            };
            loaded = Self::merge(loaded, one, dir)?;
        }
        Ok(loaded.unwrap_or(Self::Unet(Vec::new())))
    }

    /// `one` added to the ControlNets loaded so far, which must be of its kind.
    fn merge(loaded: Option<Self>, one: Self, path: &std::path::Path) -> Result<Option<Self>> {
        Ok(Some(match (loaded, one) {
            (None, one) => one,
            (Some(Self::Unet(mut a)), Self::Unet(b)) => {
                a.extend(b);
                Self::Unet(a)
            }
            (Some(Self::Sd3(mut a)), Self::Sd3(b)) => {
                a.extend(b);
                Self::Sd3(a)
            }
            (Some(Self::Flux(mut a)), Self::Flux(b)) => {
                a.extend(b);
                Self::Flux(a)
            }
            _ => {
                return Err(PipelineError::InvalidInput(format!(
                    "{} is another kind of ControlNet than the ones before it: one \
                     pipeline takes one kind",
                    path.display()
                )))
            }
        }))
    }

    /// The UNet ControlNets, or an error saying `what` takes only those.
    pub fn into_unet(self, what: &str) -> Result<Vec<ControlNetModel<B>>> {
        match self {
            Self::Unet(nets) => Ok(nets),
            Self::Sd3(_) | Self::Flux(_) => Err(PipelineError::InvalidInput(format!(
                "SD3 and Flux ControlNets steer text to image; {what} takes SD 1.x/2.x and \
                 SDXL ControlNets"
            ))),
        }
    }
}

/// ControlNets and the controls of one call, as the editing pipelines take them, with the
/// compiled step when the pipeline was compiled.
#[derive(Clone, Copy)]
pub struct Controls<'a, B: Backend> {
    pub nets: &'a [ControlNetModel<B>],
    pub request: &'a ControlRequest,
    pub programs: Option<&'a ControlPrograms<B>>,
}

/// What each denoising step of a controlled run adds: the ControlNets with their prepared
/// conditioning images (diffusers' `prepare_image`: `[batch, 3, h, w]` in [0, 1], doubled for
/// guidance unless in guess mode), the conditional half of the text context and, for SDXL, the
/// added condition (all rows, and the conditional half for guess mode).
pub struct ControlStep<'a, B: Backend> {
    controls: Controls<'a, B>,
    images: Vec<Tensor<B, 4>>,
    /// The images as the compiled step takes them (one block of rows per ControlNet), made
    /// once per run when the pipeline was compiled.
    stacked: Option<Tensor<B, 4>>,
    added: Option<AddedCondition<B>>,
    /// The steps the run takes (the guidance windows are fractions of them).
    steps: usize,
}

/// One denoiser evaluation's tensors: the scheduler-scaled 4-channel latents the ControlNets
/// see, what the UNet sees (the same, or with an inpainting UNet's mask channels), timestep,
/// text context (negative rows first under guidance) and the `[1]` guidance scale.
pub(crate) struct StepTensors<B: Backend> {
    pub(crate) sample: Tensor<B, 4>,
    pub(crate) unet_input: Tensor<B, 4>,
    pub(crate) timestep: Tensor<B, 1>,
    pub(crate) context: Tensor<B, 3>,
    pub(crate) guidance: Tensor<B, 1>,
}

/// A ControlNet of one step with its conditioning image rows and `[1]` scale.
pub(crate) type Steer<'n, B> = (&'n ControlNetModel<B>, Tensor<B, 4>, Tensor<B, 1>);

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
        let stacked = controls.programs.map(|_| Tensor::cat(images.clone(), 0));
        Ok(Self {
            controls,
            images,
            stacked,
            added: None,
            steps,
        })
    }

    /// The same with SDXL's added condition (pooled text embeddings and time ids, one row per
    /// context row), which the UNet and ControlNets both take (diffusers' `added_cond_kwargs`;
    /// guess mode gives the ControlNets the conditional rows only).
    pub fn with_added(mut self, added: &AddedCondition<B>) -> Self {
        self.added = Some(added.clone());
        self
    }

    /// One denoiser evaluation with the ControlNets whose guidance window holds step `i`:
    /// their residuals (from the 4-channel latents `sample`, doubled for guidance) added to
    /// the UNet's skip connections, then guidance as
    /// [`guided_noise`](crate::stable_diffusion::guided_noise) does it. An inpainting UNet gets
    /// its mask channels besides, as diffusers' ControlNet inpaint pipelines do. Compiled
    /// pipelines run it as one program ([`ControlPrograms`]), every ControlNet in it with its
    /// scale times 0 or 1 for its window, as diffusers' `controlnet_keep`; eagerly the
    /// ControlNets outside their window are skipped (the same sum without their cost).
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
        let step = StepTensors {
            unet_input: InpaintCondition::unet_input(inpaint, sample.clone()),
            sample,
            timestep,
            context: context.clone(),
            guidance,
        };
        let request = self.controls.request;
        let (guess, added) = (request.guess_mode, self.added.as_ref());
        let batch = step.sample.dims()[0];
        let guided = context.dims()[0] == 2 * batch;
        let unet_rows = if guided { 2 * batch } else { batch };
        // Guess mode with guidance runs the ControlNets on the conditional rows only.
        let net_rows = if guess && guided { batch } else { unet_rows };
        let net_added = added.map(|a| positive_rows(a, net_rows));
        let [_, _, h, w] = step.sample.dims();
        for (k, (net, image)) in self.controls.nets.iter().zip(&self.images).enumerate() {
            net.check_input([net_rows, 4, h, w], image.dims(), net_added.as_ref())
                .map_err(|e| PipelineError::InvalidInput(format!("ControlNet {k}: {e}")))?;
        }
        unet.check_added_condition(unet_rows, added)?;
        let device = step.sample.device();
        let scale = |v: f64| Tensor::<B, 1>::from_floats([v as f32], &device);
        let controls = &request.controls;
        if let (Some(programs), Some(images)) = (self.controls.programs, &self.stacked) {
            let scales: Vec<f64> = controls
                .iter()
                .map(|c| if c.keeps(i, self.steps) { c.scale } else { 0.0 })
                .collect();
            let scales = Tensor::<B, 1>::from_floats(
                scales
                    .iter()
                    .map(|&v| v as f32)
                    .collect::<Vec<_>>()
                    .as_slice(),
                &device,
            );
            return programs.call(guess, step, images.clone(), scales, added);
        }
        let steer: Vec<Steer<'_, B>> = self
            .controls
            .nets
            .iter()
            .zip(controls)
            .zip(&self.images)
            .filter(|((_, c), _)| c.keeps(i, self.steps))
            .map(|((net, c), image)| (net, image.clone(), scale(c.scale)))
            .collect();
        Ok(controlled_prediction(unet, &steer, guess, step, added))
    }
}

/// The last `rows` rows of `added` (its conditional half in guess mode), all of it otherwise.
fn positive_rows<B: Backend>(added: &AddedCondition<B>, rows: usize) -> AddedCondition<B> {
    let all = added.text_embeds.dims()[0];
    AddedCondition {
        text_embeds: added.text_embeds.clone().narrow(0, all - rows, rows),
        time_ids: added.time_ids.clone().narrow(0, all - rows, rows),
    }
}

/// The UNet's prediction with the summed residuals of `steer`, under guidance when `step`'s
/// context has twice the latents' rows; the eager step and the compiled program both run it.
/// Guess mode with guidance runs the ControlNets on the conditional rows only and gives the
/// unconditional ones zeros (diffusers' `guess_mode and do_classifier_free_guidance`). The
/// inputs must have passed the ControlNets' `check_input` and the UNet's
/// `check_added_condition`.
pub(crate) fn controlled_prediction<B: Backend>(
    unet: &UNet2DConditionModel<B>,
    steer: &[Steer<'_, B>],
    guess: bool,
    step: StepTensors<B>,
    added: Option<&AddedCondition<B>>,
) -> Tensor<B, 4> {
    let StepTensors {
        sample,
        unet_input,
        timestep,
        context,
        guidance,
    } = step;
    let batch = sample.dims()[0];
    let guided = context.dims()[0] == 2 * batch;
    let twice = |x: Tensor<B, 4>| {
        if guided {
            Tensor::cat(vec![x.clone(), x], 0)
        } else {
            x
        }
    };
    let conditional = guess && guided;
    // With an IP-Adapter the context ends with its image tokens, which only the UNet attends
    // to: the ControlNets get the text (diffusers passes them `prompt_embeds`).
    let [rows, seq, _] = context.dims();
    let text = match unet.ip_adapter_tokens() {
        0 => context.clone(),
        tokens => context.clone().narrow(1, 0, seq.saturating_sub(tokens)),
    };
    let (net_sample, net_context, net_added) = if conditional {
        let positive = text.narrow(0, rows - batch, batch);
        (
            sample.clone(),
            positive,
            added.map(|a| positive_rows(a, batch)),
        )
    } else {
        (twice(sample.clone()), text, added.cloned())
    };
    let mut sum: Option<ControlResiduals<B>> = None;
    for (net, image, scale) in steer {
        let residuals = net.residuals(
            net_sample.clone(),
            timestep.clone(),
            net_context.clone(),
            image.clone(),
            scale.clone(),
            guess,
            net_added.as_ref(),
        );
        let residuals = if conditional {
            residuals.after_zeros()
        } else {
            residuals
        };
        sum = Some(match sum {
            None => residuals,
            Some(sum) => sum + residuals,
        });
    }
    let prediction =
        unet.forward_controlled_checked(twice(unet_input), timestep, context, added, sum.as_ref());
    if guided {
        combine_halves(prediction, batch, guidance)
    } else {
        prediction
    }
}

/// The compiled controlled step: the ControlNets, the UNet and guidance as one XLA program per
/// input shape (one for guess mode, one without), with the latents, timestep, context,
/// guidance scale, the control images and each ControlNet's scale (its window's 0 or 1
/// folded in) as runtime inputs, so a new prompt, scale, window, step count or scheduler
/// reuses the program.
pub struct ControlPrograms<B: Backend> {
    plain: ControlCall<B>,
    guess: ControlCall<B>,
}

/// The inputs of a compiled controlled step: the step's tensors in order (latents, UNet input,
/// timestep, context, guidance), then the control
/// images (one block of rows per ControlNet) and the ControlNets' scales (`[nets]`).
pub type ControlInputs<B> = (
    (
        Tensor<B, 4>,
        Tensor<B, 4>,
        Tensor<B, 1>,
        Tensor<B, 3>,
        Tensor<B, 1>,
    ),
    (Tensor<B, 4>, Tensor<B, 1>),
);

/// [`ControlInputs`] and SDXL's added condition (pooled text embeddings, time ids).
pub type AddedControlInputs<B> = (ControlInputs<B>, (Tensor<B, 2>, Tensor<B, 2>));

/// SD's step, or SDXL's with the added condition besides.
enum ControlCall<B: Backend> {
    Plain(CompiledCall<B, ControlInputs<B>>),
    Added(CompiledCall<B, AddedControlInputs<B>>),
}

impl<B: Backend> ControlPrograms<B> {
    fn call(
        &self,
        guess: bool,
        step: StepTensors<B>,
        images: Tensor<B, 4>,
        scales: Tensor<B, 1>,
        added: Option<&AddedCondition<B>>,
    ) -> Result<Tensor<B, 4>> {
        let inputs = (
            (
                step.sample,
                step.unet_input,
                step.timestep,
                step.context,
                step.guidance,
            ),
            (images, scales),
        );
        let call = if guess { &self.guess } else { &self.plain };
        match (call, added) {
            (ControlCall::Plain(call), None) => call.call(inputs),
            (ControlCall::Added(call), Some(a)) => {
                call.call((inputs, (a.text_embeds.clone(), a.time_ids.clone())))
            }
            _ => Err(PipelineError::Compile(
                "the compiled ControlNet step was built for another UNet (with or without \
                 SDXL's added condition): compile the pipeline again"
                    .into(),
            )),
        }
    }

    /// The device mesh and weight shards both programs run on, after `enable_parallelism`.
    pub fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        match &self.plain {
            ControlCall::Plain(c) => c.spmd_placement(),
            ControlCall::Added(c) => c.spmd_placement(),
        }
    }

    /// Counts of both programs together.
    pub fn compile_stats(&self) -> CompileStats {
        let stats = |call: &ControlCall<B>| match call {
            ControlCall::Plain(c) => c.compile_stats(),
            ControlCall::Added(c) => c.compile_stats(),
        };
        stats(&self.plain) + stats(&self.guess)
    }
}

impl ControlPrograms<Oxi> {
    /// The programs of `unet` steered by `nets` (SDXL's added condition when the UNet takes
    /// one), partitioned over `placement`'s mesh when given ([`control_parallelism`]); nothing
    /// is traced before the first call.
    pub fn new(
        unet: &UNet2DConditionModel<Oxi>,
        nets: &[ControlNetModel<Oxi>],
        placement: Option<Arc<SpmdPlacement>>,
    ) -> Self {
        let xl = unet.add_embedding.is_some();
        let build = |guess: bool| {
            let (unet, nets) = (unet.clone(), nets.to_vec());
            let name = if guess {
                "controlnets+unet+cfg (guess mode)"
            } else {
                "controlnets+unet+cfg"
            };
            let run = move |inputs: ControlInputs<Oxi>, added: Option<AddedCondition<Oxi>>| {
                let ((sample, unet_input, timestep, context, guidance), (images, scales)) = inputs;
                let rows = images.dims()[0] / nets.len();
                let steer: Vec<Steer<'_, Oxi>> = nets
                    .iter()
                    .enumerate()
                    .map(|(k, net)| {
                        (
                            net,
                            images.clone().narrow(0, k * rows, rows),
                            scales.clone().narrow(0, k, 1),
                        )
                    })
                    .collect();
                let step = StepTensors {
                    sample,
                    unet_input,
                    timestep,
                    context,
                    guidance,
                };
                // The shapes were checked by `ControlStep::noise` before the call.
                controlled_prediction(&unet, &steer, guess, step, added.as_ref())
            };
            if xl {
                let step = move |(inputs, (text_embeds, time_ids)): AddedControlInputs<Oxi>| {
                    let added = AddedCondition {
                        text_embeds,
                        time_ids,
                    };
                    run(inputs, Some(added))
                };
                ControlCall::Added(CompiledCall::new(name, step, placement.clone(), Vec::new()))
            } else {
                let step = move |inputs: ControlInputs<Oxi>| run(inputs, None);
                ControlCall::Plain(CompiledCall::new(name, step, placement.clone(), Vec::new()))
            }
        };
        Self {
            plain: build(false),
            guess: build(true),
        }
    }
}

/// Refuses a ControlNet that does not fit `unet` (residuals of other shapes, another added
/// conditioning), saying what differs, or whose downscale is not the VAE's (the control image
/// would not land on the latents' grid).
pub fn unet_controlnet_fits<B: Backend>(
    net: &ControlNetModel<B>,
    unet: &UNet2DConditionModel<B>,
    vae_scale_factor: usize,
) -> Result<()> {
    net.check_fits(unet).map_err(model_input)?;
    if net.conditioning_downscale != vae_scale_factor {
        return Err(PipelineError::InvalidInput(format!(
            "it maps its image down {} times, the VAE {vae_scale_factor} times: it was made \
             for another base model",
            net.conditioning_downscale
        )));
    }
    Ok(())
}

/// A model's input error as the pipeline's, its message alone.
pub(crate) fn model_input(e: ModelError) -> PipelineError {
    match e {
        ModelError::Input(message) => PipelineError::InvalidInput(message),
        other => other.into(),
    }
}

/// What `enable_parallelism` of the SD3 and Flux ControlNet pipelines says.
pub(crate) fn not_parallel() -> PipelineError {
    PipelineError::Compile(
        "tensor and data parallelism are not implemented for SD3 and Flux ControlNet \
         pipelines yet; drop --tp/--dp (--compile works)"
            .into(),
    )
}

/// `enable_parallelism` of the SD and SDXL ControlNet pipelines: tensor parallelism splits the
/// UNet and every ControlNet by their plans over one mesh (the controlled step is one program;
/// every input whole). Data parallelism is refused: the control images hold one block of
/// rows per ControlNet, which a batch split would cut across.
pub(crate) fn control_parallelism(
    unet: &mut UNet2DConditionModel<Oxi>,
    nets: &mut [ControlNetModel<Oxi>],
    config: ParallelConfig,
) -> Result<Arc<SpmdPlacement>> {
    if config.dp() > 1 {
        return Err(PipelineError::Compile(
            "data parallelism is not implemented for ControlNet pipelines; drop --dp (--tp \
             splits the UNet and the ControlNets)"
                .into(),
        ));
    }
    let device = unet.conv_in.weight.device();
    crate::parallel::enable_parallelism_with(unet, nets, &device, config)
}

/// `nets` for a pipeline whose denoiser is on `device`: at least one, each accepted by `fits`
/// (its error names the ControlNet by index), moved to `device`.
pub(crate) fn attach<B: Backend, N: Module<B>>(
    nets: Vec<N>,
    device: &B::Device,
    fits: impl Fn(&N) -> Result<()>,
) -> Result<Vec<N>> {
    if nets.is_empty() {
        return Err(PipelineError::InvalidInput(
            "a ControlNet pipeline needs at least one ControlNet".into(),
        ));
    }
    for (k, net) in nets.iter().enumerate() {
        fits(net).map_err(|e| match e {
            PipelineError::InvalidInput(message) => {
                PipelineError::InvalidInput(format!("ControlNet {k}: {message}"))
            }
            other => other,
        })?;
    }
    Ok(nets.into_iter().map(|n| n.to(device)).collect())
}

/// Each of `dirs` loaded by `load` (a ControlNet folder, weights as `options` ask).
pub(crate) fn load_each<N>(
    dirs: &[&std::path::Path],
    options: &crate::loading::LoadOptions,
    load: impl Fn(&std::path::Path, Option<&str>, FloatDType) -> oxidiff_models::Result<N>,
) -> Result<Vec<N>> {
    let dtype = options.dtype.unwrap_or(FloatDType::F32);
    dirs.iter()
        .map(|dir| Ok(load(dir, options.variant.as_deref(), dtype)?))
        .collect()
}

/// `base` (a pipeline's components) and each ControlNet's weights (`controlnet`, or
/// `controlnet_0`, `controlnet_1`, ... when there are several).
pub(crate) fn with_controlnet_memory<B: Backend, N: Module<B>>(
    mut base: Vec<crate::memory::ComponentMemory>,
    nets: &[N],
    place: crate::memory::PlaceName<'_, B::Device>,
) -> Vec<crate::memory::ComponentMemory> {
    for (i, net) in nets.iter().enumerate() {
        let name = match nets.len() {
            1 => "controlnet".to_string(),
            _ => format!("controlnet_{i}"),
        };
        base.push(crate::memory::component_memory(&name, net, None, place));
    }
    base
}

/// A base pipeline's per-component counts with a controlled step's counts added to
/// `denoiser`'s (one program holds the ControlNets and the denoiser).
pub(crate) fn merged_component_stats(
    mut stats: Vec<ComponentStats>,
    denoiser: &str,
    programs: Option<CompileStats>,
) -> Vec<ComponentStats> {
    if let Some(programs) = programs {
        for entry in stats.iter_mut().filter(|e| e.component == denoiser) {
            entry.stats = entry.stats + programs;
        }
    }
    stats
}
