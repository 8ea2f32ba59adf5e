//! `StableDiffusionControlNetInpaintPipeline`: SD 1.x/2.x inpainting steered by ControlNets, as
//! diffusers' `pipeline_controlnet_inpaint.py`: [`StableDiffusionInpaintPipeline`]'s start and
//! mask handling (9-channel inpainting UNets or the masked-latent method) with each step
//! controlled as in [`StableDiffusionControlNetPipeline`]; the ControlNets see the 4 latent
//! channels, the UNet its mask channels besides.

use burn::tensor::backend::Backend;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::{ControlRequest, Controls};
use crate::denoise::{GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::inpaint::InpaintOptions;
use crate::stable_diffusion_controlnet::StableDiffusionControlNetPipeline;
use crate::stable_diffusion_inpaint::StableDiffusionInpaintPipeline;

/// SD 1.x/2.x inpainting with ControlNets.
pub struct StableDiffusionControlNetInpaintPipeline<B: Backend> {
    pub pipe: StableDiffusionControlNetPipeline<B>,
}

impl<B: Backend> From<StableDiffusionControlNetPipeline<B>>
    for StableDiffusionControlNetInpaintPipeline<B>
{
    fn from(pipe: StableDiffusionControlNetPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionControlNetInpaintPipeline<B> {
    /// diffusers' `__call__` defaults (50 steps, guidance 7.5, strength 1).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_INPAINT
    }

    /// Inpaints with the default generator seeded by `req.seed`.
    pub fn generate(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        options: &InpaintOptions,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.seed);
        self.generate_with(req, image, mask, options, control, &mut generator, |_| {})
    }

    /// Repaints the white part of `mask` as
    /// [`StableDiffusionInpaintPipeline::generate_with_options`], each step steered by
    /// `control` (the control images are resized to the image's size). `padding_mask_crop`
    /// is refused for now (diffusers crops the control images with the mask's box).
    #[allow(clippy::too_many_arguments)]
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        options: &InpaintOptions,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        if options.padding_mask_crop.is_some() {
            return Err(PipelineError::InvalidInput(
                "padding_mask_crop with ControlNets is not implemented yet; inpaint the whole \
                 image"
                    .into(),
            ));
        }
        let StableDiffusionControlNetPipeline {
            pipe,
            controlnets,
            programs,
        } = &mut self.pipe;
        let controls = Controls {
            nets: controlnets,
            request: control,
            programs: programs.as_ref(),
        };
        StableDiffusionInpaintPipeline::generate_controlled_on(
            pipe,
            req,
            image,
            mask,
            options,
            Some(controls),
            noise,
            callback,
        )
    }
}
