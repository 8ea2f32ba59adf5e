//! What every ControlNet pipeline takes and does alike, as diffusers' ControlNet pipelines:
//! one [`Control`] per ControlNet (its image, `controlnet_conditioning_scale` and
//! `control_guidance_start` / `control_guidance_end`), guess mode, the per-step "keep" of each
//! ControlNet's guidance window, and the conditioning images prepared as `prepare_image`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::ControlNetModel;

use crate::error::{PipelineError, Result};
use crate::image::preprocess_control;

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

/// The prepared conditioning images, one per ControlNet: `[batch, 3, h, w]` in [0, 1] for
/// guess mode with guidance (the ControlNet sees the conditional half), else the batch doubled
/// for guidance as the UNet's (diffusers' `prepare_image`).
pub struct PreparedControls<B: Backend> {
    pub images: Vec<Tensor<B, 4>>,
}

impl<B: Backend> PreparedControls<B> {
    pub fn new(
        request: &ControlRequest,
        (width, height): (usize, usize),
        batch: usize,
        guided: bool,
        device: &B::Device,
    ) -> Result<Self> {
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
        Ok(Self { images })
    }
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
