//! `StableDiffusionXLControlNetImg2ImgPipeline`: SDXL image to image steered by ControlNets,
//! as diffusers' `pipeline_controlnet_sd_xl_img2img.py`: the SDXL image-to-image start
//! ([`StableDiffusionXLImg2ImgPipeline`]) with each step controlled as in
//! [`StableDiffusionXLControlNetPipeline`] (the guidance windows are fractions of the steps
//! that run).

use burn::tensor::backend::Backend;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::{ControlRequest, Controls};
use crate::denoise::{PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::Result;
use crate::stable_diffusion_xl::XlRequest;
use crate::stable_diffusion_xl_controlnet::StableDiffusionXLControlNetPipeline;
use crate::stable_diffusion_xl_img2img::{
    StableDiffusionXLImg2ImgPipeline, XlEditOptions, XlInitImage,
};

/// SDXL image to image with ControlNets.
pub struct StableDiffusionXLControlNetImg2ImgPipeline<B: Backend> {
    pub pipe: StableDiffusionXLControlNetPipeline<B>,
}

impl<B: Backend> From<StableDiffusionXLControlNetPipeline<B>>
    for StableDiffusionXLControlNetImg2ImgPipeline<B>
{
    fn from(pipe: StableDiffusionXLControlNetPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionXLControlNetImg2ImgPipeline<B> {
    /// diffusers' `__call__` defaults (50 steps, guidance 5.0, strength 0.8).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_XL_CONTROLNET_IMG2IMG
    }

    /// The edit options of diffusers' defaults (strength 0.8, aesthetic scores 6 and 2.5).
    pub fn default_edit(&self) -> XlEditOptions {
        XlEditOptions {
            strength: self.defaults().strength.unwrap_or(1.0),
            ..XlEditOptions::default()
        }
    }

    /// Edits `image` with the default generator seeded by `request.common.seed`.
    pub fn generate(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: XlInitImage<'_, B>,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(request.common.seed);
        self.generate_with(request, edit, image, control, &mut generator, |_| {})
    }

    /// Image to image as [`StableDiffusionXLImg2ImgPipeline::generate_with`], each step
    /// steered by `control` (one [`Control`](crate::control::Control) per ControlNet; the
    /// control images are resized to the image's size).
    pub fn generate_with(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: XlInitImage<'_, B>,
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
        StableDiffusionXLImg2ImgPipeline::generate_controlled_on(
            pipe,
            request,
            edit,
            image,
            Some(controls),
            noise,
            callback,
        )
    }
}
