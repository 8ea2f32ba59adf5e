//! `FluxControlNetPipeline`: Flux text to image steered by one or more Flux ControlNets, as
//! diffusers' `pipeline_flux_controlnet.py` (several are its `FluxMultiControlNetModel`: their
//! samples are summed block by block).
//!
//! Each control image is resized to the output size, scaled to [-1, 1], repeated for the
//! batch, VAE-encoded and sampled (from the request's generator, before the latents, as
//! diffusers does), shifted and scaled, and packed like the latents; the ControlNets see the
//! packed latents and the transformer's inputs, and their samples go to the transformer's image
//! tokens. Eager only for now; InstantX's layout (XLabs' and the Union ControlNets are refused
//! when loading).

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::embeddings::RotaryEmbedding;
use oxidiff_models::transformer_flux::FluxControlSamples;
use oxidiff_models::{AutoencoderKL, FluxControlNetModel, FluxTransformer2DModel, ToDevice};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::compiled::{CompileStats, ComponentStats};
use crate::control::ControlRequest;
use crate::denoise::{PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::flux::{pack_latents, unpack_latents, FluxPipeline, FluxPromptEmbeds, FluxRequest};
use crate::image::preprocess;
use crate::loading::LoadOptions;
use crate::memory::{component_memory, ComponentMemory, PlaceName};

/// Flux with ControlNets (diffusers' `FluxControlNetPipeline`). It derefs to the Flux pipeline
/// for its components.
pub struct FluxControlNetPipeline<B: Backend> {
    pub pipe: FluxPipeline<B>,
    pub controlnets: Vec<FluxControlNetModel<B>>,
}

impl<B: Backend> std::ops::Deref for FluxControlNetPipeline<B> {
    type Target = FluxPipeline<B>;

    fn deref(&self) -> &Self::Target {
        &self.pipe
    }
}

impl<B: Backend> std::ops::DerefMut for FluxControlNetPipeline<B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.pipe
    }
}

fn eager_only() -> PipelineError {
    PipelineError::Compile(
        "the Flux ControlNet pipeline runs eagerly for now (each op at once, on any device); \
         drop --compile/--tp/--dp"
            .into(),
    )
}

impl FluxControlNetPipeline<Oxi> {
    /// Compiled mode is not implemented for Flux ControlNets yet: an error saying so.
    pub fn compile(&mut self) -> Result<()> {
        Err(eager_only())
    }

    /// See [`compile`](Self::compile).
    pub fn enable_parallelism(&mut self, _config: impl Into<ParallelConfig>) -> Result<()> {
        Err(eager_only())
    }

    /// Always `None`: the pipeline runs eagerly.
    pub fn compile_stats(&self) -> Option<CompileStats> {
        None
    }

    /// Always empty: the pipeline runs eagerly.
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        Vec::new()
    }
}

impl<B: Backend> FluxControlNetPipeline<B> {
    /// The denoiser's device mesh and weight shards: none, the pipeline runs eagerly.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        None
    }

    /// What each component's weights hold and where (`txt2img --json`'s `memory`).
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        let mut all = self.pipe.memory(place);
        for (i, net) in self.controlnets.iter().enumerate() {
            let name = match self.controlnets.len() {
                1 => "controlnet".to_string(),
                _ => format!("controlnet_{i}"),
            };
            all.push(component_memory(&name, net, None, place));
        }
        all
    }

    /// The pipeline `pipe` with `controlnets` (at least one), each checked against its
    /// transformer.
    pub fn new(pipe: FluxPipeline<B>, controlnets: Vec<FluxControlNetModel<B>>) -> Result<Self> {
        if controlnets.is_empty() {
            return Err(PipelineError::InvalidInput(
                "a ControlNet pipeline needs at least one ControlNet".into(),
            ));
        }
        for (k, net) in controlnets.iter().enumerate() {
            net.check_fits(&pipe.transformer)
                .map_err(|e| PipelineError::InvalidInput(format!("ControlNet {k}: {e}")))?;
        }
        let controlnets = controlnets
            .into_iter()
            .map(|n| n.to(&pipe.device))
            .collect();
        Ok(Self { pipe, controlnets })
    }

    /// Loads a Flux folder and Flux ControlNet folders.
    pub fn from_dir(
        dir: &Path,
        controlnets: &[&Path],
        options: &LoadOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let pipe = FluxPipeline::from_dir(dir, options, device)?;
        let nets = controlnets
            .iter()
            .map(|path| {
                FluxControlNetModel::from_dir_in(
                    path,
                    options.variant.as_deref(),
                    options.dtype.unwrap_or(FloatDType::F32),
                    device,
                )
                .map_err(PipelineError::from)
            })
            .collect::<Result<Vec<_>>>()?;
        Self::new(pipe, nets)
    }

    /// The Flux pipeline without its ControlNets.
    pub fn into_inner(self) -> FluxPipeline<B> {
        self.pipe
    }

    /// diffusers' `__call__` defaults (those of Flux: 28 steps, guidance 3.5).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::FLUX
    }

    /// Generates with the default generator seeded by `req.common.seed`.
    pub fn generate(
        &mut self,
        req: &FluxRequest<B>,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.common.seed);
        self.generate_with(req, control, &mut generator, |_| {})
    }

    /// Text to image under `control` (one [`Control`](crate::control::Control) per
    /// ControlNet; no guess mode, as in diffusers): the control images' VAE samples, then the
    /// latents, then the scheduler draw from `noise`.
    pub fn generate_with(
        &mut self,
        req: &FluxRequest<B>,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let control = FluxControl {
            nets: &self.controlnets,
            request: control,
        };
        self.pipe
            .generate_controlled(req, Some(control), noise, callback)
    }
}

/// The Flux ControlNets of one call, before their control latents are made.
pub(crate) struct FluxControl<'a, B: Backend> {
    nets: &'a [FluxControlNetModel<B>],
    request: &'a ControlRequest,
}

/// The Flux ControlNets of one call with their packed control latents.
pub(crate) struct FluxControlStep<'a, B: Backend> {
    nets: &'a [FluxControlNetModel<B>],
    request: &'a ControlRequest,
    latents: Vec<Tensor<B, 3>>,
}

impl<'a, B: Backend> FluxControl<'a, B> {
    /// Encodes and packs the control images at `width x height` for `batch` images.
    pub(crate) fn prepare(
        self,
        vae: &AutoencoderKL<B>,
        (width, height): (usize, usize),
        batch: usize,
        noise: &mut dyn NoiseSource<B>,
        device: &B::Device,
    ) -> Result<FluxControlStep<'a, B>> {
        let Self { nets, request } = self;
        request.check(nets.len())?;
        if request.guess_mode {
            return Err(PipelineError::InvalidInput(
                "guess mode is not part of the Flux ControlNet pipeline (as in diffusers); \
                 leave it off"
                    .into(),
            ));
        }
        let vae_device = vae.decoder.conv_in.weight.device();
        let mut latents = Vec::with_capacity(nets.len());
        for c in &request.controls {
            let image = preprocess::<B>(&c.image, Some(width), Some(height), 1, &vae_device)?
                .repeat_dim(0, batch);
            let dist = vae.encode(image);
            let sample = noise.randn(dist.mean.dims(), &dist.mean.device())?;
            let encoded = dist
                .sample(sample)
                .sub_scalar(vae.shift_factor)
                .mul_scalar(vae.scaling_factor);
            latents.push(pack_latents(encoded).to_device(device));
        }
        Ok(FluxControlStep {
            nets,
            request,
            latents,
        })
    }
}

impl<B: Backend> FluxControlStep<'_, B> {
    /// The transformer's velocity at step `i` of `n` with the summed samples of the
    /// ControlNets whose window holds the step; without any, the plain transformer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn velocity(
        &self,
        transformer: &FluxTransformer2DModel<B>,
        (i, n): (usize, usize),
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        guidance: Tensor<B, 1>,
        text: &FluxPromptEmbeds<B>,
        rope: &RotaryEmbedding<B>,
    ) -> Result<Tensor<B, 4>> {
        let [b, _, h, w] = latents.dims();
        let packed = pack_latents(latents);
        let timestep = timestep.div_scalar(1000.0).expand([b]);
        let guidance = guidance.expand([b]);
        let mut sum: Option<FluxControlSamples<B>> = None;
        let each = self
            .nets
            .iter()
            .zip(&self.request.controls)
            .zip(&self.latents);
        for ((net, control), cond) in each.filter(|((_, c), _)| c.keeps(i, n)) {
            if cond.dims() != packed.dims() {
                return Err(PipelineError::InvalidInput(format!(
                    "the control latents are {:?}; the latents {:?}",
                    cond.dims(),
                    packed.dims()
                )));
            }
            let scale = Tensor::<B, 1>::from_floats([control.scale as f32], &packed.device());
            let samples = net.forward(
                packed.clone(),
                cond.clone(),
                text.prompt_embeds.clone(),
                text.pooled_prompt_embeds.clone(),
                timestep.clone(),
                Some(guidance.clone()),
                rope,
                scale,
            );
            sum = Some(match sum {
                None => samples,
                Some(sum) => sum.sum(samples),
            });
        }
        // diffusers runs every ControlNet (those outside their window at scale 0) and sums
        // their samples pairwise, so the sum has as many as the ControlNet with the fewest.
        let sum = sum.map(|mut sum| {
            let fewest = |count: fn(&FluxControlNetModel<B>) -> usize| {
                self.nets.iter().map(count).min().unwrap_or(0)
            };
            sum.blocks.truncate(fewest(|n| n.controlnet_blocks.len()));
            sum.single_blocks
                .truncate(fewest(|n| n.controlnet_single_blocks.len()));
            sum
        });
        if let Some(control) = &sum {
            transformer.check_control(packed.dims(), control)?;
        }
        let transformer_guidance = transformer.guidance_embeds().then_some(guidance);
        let out = transformer.forward_controlled(
            packed,
            text.prompt_embeds.clone(),
            text.pooled_prompt_embeds.clone(),
            timestep,
            transformer_guidance,
            rope,
            sum.as_ref(),
        );
        Ok(unpack_latents(out, h, w))
    }
}
