//! `StableDiffusionControlNetImg2ImgPipeline`: SD 1.x/2.x image to image steered by
//! ControlNets, as diffusers' `pipeline_controlnet_img2img.py`: the image-to-image start
//! ([`StableDiffusionImg2ImgPipeline`]) with each step controlled as in
//! [`StableDiffusionControlNetPipeline`] (the guidance windows are fractions of the steps that
//! run).

use burn::tensor::backend::Backend;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::ControlRequest;
use crate::denoise::{GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::Result;
use crate::stable_diffusion_controlnet::StableDiffusionControlNetPipeline;
use crate::stable_diffusion_img2img::StableDiffusionImg2ImgPipeline;

/// SD 1.x/2.x image to image with ControlNets.
pub struct StableDiffusionControlNetImg2ImgPipeline<B: Backend> {
    pub pipe: StableDiffusionControlNetPipeline<B>,
}

impl<B: Backend> From<StableDiffusionControlNetPipeline<B>>
    for StableDiffusionControlNetImg2ImgPipeline<B>
{
    fn from(pipe: StableDiffusionControlNetPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionControlNetImg2ImgPipeline<B> {
    /// diffusers' `__call__` defaults (50 steps, guidance 7.5, strength 0.8).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_IMG2IMG
    }

    /// Edits `image` with the default generator seeded by `req.seed`.
    pub fn generate(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        strength: f64,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.seed);
        self.generate_with(req, image, strength, control, &mut generator, |_| {})
    }

    /// Image to image from `image` as [`StableDiffusionImg2ImgPipeline::generate_with`], each
    /// step steered by `control` (one [`Control`](crate::control::Control) per ControlNet;
    /// the control images are resized to the image's size).
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        strength: f64,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let StableDiffusionControlNetPipeline {
            pipe,
            controlnets,
            programs,
        } = &mut self.pipe;
        let controls = crate::control::Controls {
            nets: controlnets,
            request: control,
            programs: programs.as_ref(),
        };
        StableDiffusionImg2ImgPipeline::generate_controlled_on(
            pipe,
            req,
            image,
            strength,
            Some(controls),
            noise,
            callback,
        )
    }
}
