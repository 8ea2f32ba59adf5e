//! `StableDiffusionXLControlNetInpaintPipeline`: SDXL inpainting steered by ControlNets, as
//! diffusers' `pipeline_controlnet_inpaint_sd_xl.py`: the SDXL inpainting start
//! ([`StableDiffusionXLInpaintPipeline`]: a 9-channel inpainting UNet gets its mask channels,
//! a plain UNet the masked-latent blend) with each step controlled as in
//! [`StableDiffusionXLControlNetPipeline`] (the ControlNets see the 4 latent channels).

use burn::tensor::backend::Backend;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::{ControlRequest, Controls};
use crate::denoise::{PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::Result;
use crate::stable_diffusion_xl::XlRequest;
use crate::stable_diffusion_xl_controlnet::StableDiffusionXLControlNetPipeline;
use crate::stable_diffusion_xl_img2img::XlEditOptions;
use crate::stable_diffusion_xl_inpaint::StableDiffusionXLInpaintPipeline;

/// SDXL inpainting with ControlNets.
pub struct StableDiffusionXLControlNetInpaintPipeline<B: Backend> {
    pub pipe: StableDiffusionXLControlNetPipeline<B>,
}

impl<B: Backend> From<StableDiffusionXLControlNetPipeline<B>>
    for StableDiffusionXLControlNetInpaintPipeline<B>
{
    fn from(pipe: StableDiffusionXLControlNetPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionXLControlNetInpaintPipeline<B> {
    /// diffusers' `__call__` defaults (50 steps, guidance 5.0, strength 0.9999).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_XL_CONTROLNET_INPAINT
    }

    /// The edit options of diffusers' defaults (strength 0.9999, aesthetic scores 6 and 2.5).
    pub fn default_edit(&self) -> XlEditOptions {
        XlEditOptions::inpainting()
    }

    /// Inpaints with the default generator seeded by `request.common.seed`.
    pub fn generate(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(request.common.seed);
        self.generate_with(request, edit, image, mask, control, &mut generator, |_| {})
    }

    /// Inpainting as [`StableDiffusionXLInpaintPipeline::generate_with`], each step steered by
    /// `control` (one [`Control`](crate::control::Control) per ControlNet; the control images
    /// are resized to the image's size).
    #[allow(clippy::too_many_arguments)]
    pub fn generate_with(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let StableDiffusionXLControlNetPipeline {
            pipe,
            controlnets,
            programs,
        } = &mut self.pipe;
        let controls = Controls {
            nets: controlnets,
            request: control,
            programs: programs.as_ref(),
        };
        StableDiffusionXLInpaintPipeline::generate_controlled_on(
            pipe,
            request,
            edit,
            (image, mask),
            Some(controls),
            noise,
            callback,
        )
    }
}
