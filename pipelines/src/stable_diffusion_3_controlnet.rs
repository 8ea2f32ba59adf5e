//! `StableDiffusion3ControlNetPipeline`: SD3 text to image steered by one or more SD3
//! ControlNets, as diffusers' `pipeline_stable_diffusion_3_controlnet.py` (several are its
//! `SD3MultiControlNetModel`: their residuals are summed block by block).
//!
//! Unlike the UNet ControlNets these take the control image's VAE latents: the image is resized
//! to the output size, scaled to [-1, 1], repeated for the batch (and for guidance), encoded and
//! sampled (the sample drawn from a noise source of its own, as diffusers draws it from torch's
//! global generator), then shifted (unless the ControlNet forces zero pooled projections, as
//! InstantX's do) and scaled. Compiled, the ControlNets and the transformer are one program.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::{AutoencoderKL, SD3ControlNetModel, SD3Transformer2DModel};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::compiled::{CompileStats, CompiledCall, ComponentStats};
use crate::control::{
    attach, load_each, merged_component_stats, model_input, with_controlnet_memory, ControlRequest,
};
use crate::denoise::{PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::image::preprocess;
use crate::loading::LoadOptions;
use crate::memory::{ComponentMemory, PlaceName};
use crate::stable_diffusion_3::{Sd3Request, StableDiffusion3Pipeline};

/// SD3 with ControlNets (diffusers' `StableDiffusion3ControlNetPipeline`). It derefs to the
/// SD3 pipeline for its components.
pub struct StableDiffusion3ControlNetPipeline<B: Backend> {
    pub pipe: StableDiffusion3Pipeline<B>,
    pub controlnets: Vec<SD3ControlNetModel<B>>,
    /// The compiled controlled step, after [`compile`](Self::compile).
    pub programs: Option<Sd3ControlPrograms<B>>,
}

impl<B: Backend> std::ops::Deref for StableDiffusion3ControlNetPipeline<B> {
    type Target = StableDiffusion3Pipeline<B>;

    fn deref(&self) -> &Self::Target {
        &self.pipe
    }
}

impl<B: Backend> std::ops::DerefMut for StableDiffusion3ControlNetPipeline<B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.pipe
    }
}

impl StableDiffusion3ControlNetPipeline<Oxi> {
    /// Compiled mode: the SD3 pipeline's programs (text encoders, VAE) and, per input shape,
    /// one program for the ControlNets and the transformer together ([`Sd3ControlPrograms`]),
    /// the control latents and scales (windows folded in) runtime inputs. Needs the
    /// transformer on a PJRT device.
    pub fn compile(&mut self) -> Result<()> {
        self.pipe.compile()?;
        self.programs = Some(Sd3ControlPrograms::new(
            &self.pipe.transformer,
            &self.controlnets,
        ));
        Ok(())
    }

    /// Tensor and data parallelism are not implemented for ControlNet pipelines yet: an error
    /// saying so (`compile` works).
    pub fn enable_parallelism(&mut self, _config: impl Into<ParallelConfig>) -> Result<()> {
        Err(crate::control::not_parallel())
    }

    /// Compiled mode's counts (`None` when eager): the controlled step's programs and the
    /// base pipeline's.
    pub fn compile_stats(&self) -> Option<CompileStats> {
        let programs = self.programs.as_ref()?.call.compile_stats();
        Some(programs + self.pipe.compile_stats().unwrap_or_default())
    }

    /// Compiled mode's counts per component, the ControlNets counted with the transformer.
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        let programs = self.programs.as_ref().map(|p| p.call.compile_stats());
        merged_component_stats(self.pipe.component_stats(), "transformer", programs)
    }
}

/// The inputs of the compiled SD3 controlled step: the transformer's (latents, timestep,
/// prompt embeddings, pooled), then the ControlNets' pooled projections, their control latents
/// (one block of rows per ControlNet) and scales (`[nets]`).
pub type Sd3ControlInputs<B> = (
    (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 3>, Tensor<B, 2>),
    (Tensor<B, 2>, Tensor<B, 4>, Tensor<B, 1>),
);

/// The compiled SD3 controlled step: every ControlNet (scaled by 0 outside its window, as
/// diffusers runs them) and the transformer as one XLA program per input shape.
pub struct Sd3ControlPrograms<B: Backend> {
    call: CompiledCall<B, Sd3ControlInputs<B>>,
}

impl Sd3ControlPrograms<Oxi> {
    /// The program of `transformer` steered by `nets`; nothing is traced before the first
    /// call.
    pub fn new(transformer: &SD3Transformer2DModel<Oxi>, nets: &[SD3ControlNetModel<Oxi>]) -> Self {
        let (transformer, nets) = (transformer.clone(), nets.to_vec());
        let step =
            move |((x, t, context, pooled), (net_pooled, conds, scales)): Sd3ControlInputs<Oxi>| {
                let rows = conds.dims()[0] / nets.len();
                let steer: Vec<_> = nets
                    .iter()
                    .enumerate()
                    .map(|(k, net)| {
                        (
                            net,
                            conds.clone().narrow(0, k * rows, rows),
                            scales.clone().narrow(0, k, 1),
                        )
                    })
                    .collect();
                let residuals = summed_residuals(&steer, &x, &t, &context, &net_pooled, nets.len());
                transformer.forward_controlled(x, t, context, pooled, &residuals)
            };
        Self {
            call: CompiledCall::new("sd3-controlnets+transformer", step, None, Vec::new()),
        }
    }
}

/// The residuals of `steer` (ControlNet, control latents, `[1]` scale) summed pairwise as
/// diffusers' multi-ControlNet sums them: `fewest`, the block count of the pipeline's
/// ControlNet with the fewest.
fn summed_residuals<B: Backend>(
    steer: &[(&SD3ControlNetModel<B>, Tensor<B, 4>, Tensor<B, 1>)],
    x: &Tensor<B, 4>,
    timestep: &Tensor<B, 1>,
    context: &Tensor<B, 3>,
    pooled: &Tensor<B, 2>,
    fewest: usize,
) -> Vec<Tensor<B, 3>> {
    let mut sum: Option<Vec<Tensor<B, 3>>> = None;
    for (net, cond, scale) in steer {
        let residuals = net.forward(
            x.clone(),
            timestep.clone(),
            context.clone(),
            pooled.clone(),
            cond.clone(),
            scale.clone(),
        );
        sum = Some(match sum {
            None => residuals,
            Some(sum) => sum.into_iter().zip(residuals).map(|(a, b)| a + b).collect(),
        });
    }
    let mut sum = sum.unwrap_or_default();
    sum.truncate(fewest);
    sum
}

impl<B: Backend> StableDiffusion3ControlNetPipeline<B> {
    /// The denoiser's device mesh and weight shards: none, the pipeline runs eagerly.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        None
    }

    /// What each component's weights hold and where (`txt2img --json`'s `memory`).
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        with_controlnet_memory(self.pipe.memory(place), &self.controlnets, place)
    }

    /// The pipeline `pipe` with `controlnets` (at least one), each checked against its
    /// transformer: a ControlNet made for another model is an error naming what differs.
    pub fn new(
        pipe: StableDiffusion3Pipeline<B>,
        controlnets: Vec<SD3ControlNetModel<B>>,
    ) -> Result<Self> {
        let device = pipe.device.clone();
        let latent = pipe.transformer.in_channels;
        let controlnets = attach(controlnets, &device, |net| {
            net.check_fits(&pipe.transformer).map_err(model_input)?;
            if net.cond_channels != latent {
                return Err(PipelineError::InvalidInput(format!(
                    "it takes {} conditioning channels (an inpainting ControlNet's mask among \
                     them); the SD3 ControlNet pipeline gives it the image's {latent}",
                    net.cond_channels
                )));
            }
            Ok(())
        })?;
        Ok(Self {
            pipe,
            controlnets,
            programs: None,
        })
    }

    /// Loads an SD3 folder and SD3 ControlNet folders.
    pub fn from_dir(
        dir: &Path,
        controlnets: &[&Path],
        options: &LoadOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let pipe = StableDiffusion3Pipeline::from_dir(dir, options, device)?;
        let nets = load_each(controlnets, options, |dir, variant, dtype| {
            SD3ControlNetModel::from_dir_in(dir, variant, dtype, device)
        })?;
        Self::new(pipe, nets)
    }

    /// The SD3 pipeline without its ControlNets.
    pub fn into_inner(self) -> StableDiffusion3Pipeline<B> {
        self.pipe
    }

    /// diffusers' `__call__` defaults (those of SD3: 28 steps, guidance 7.0).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_3
    }

    /// Generates with generators seeded by `req.common.seed`: one for the latents and the
    /// scheduler, another for the control images' VAE samples (diffusers after
    /// `torch.manual_seed(seed)` with `generator=torch.Generator().manual_seed(seed)`).
    pub fn generate(
        &mut self,
        req: &Sd3Request<B>,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.common.seed);
        let mut control_noise = TorchCpuGenerator::new(req.common.seed);
        self.generate_with(req, control, &mut generator, &mut control_noise, |_| {})
    }

    /// Text to image under `control` (one [`Control`](crate::control::Control) per
    /// ControlNet; guess mode is not part of SD3's pipeline): the latents and the scheduler
    /// draw from `noise`, the control images' VAE samples from `control_noise`, in ControlNet
    /// order.
    pub fn generate_with(
        &mut self,
        req: &Sd3Request<B>,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        control_noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let control = Sd3Control {
            nets: &self.controlnets,
            request: control,
            noise: control_noise,
            programs: self.programs.as_ref(),
        };
        self.pipe
            .generate_controlled(req, Some(control), noise, callback)
    }
}

/// The SD3 ControlNets of one call, before their control latents are made.
pub(crate) struct Sd3Control<'a, B: Backend> {
    nets: &'a [SD3ControlNetModel<B>],
    request: &'a ControlRequest,
    noise: &'a mut dyn NoiseSource<B>,
    programs: Option<&'a Sd3ControlPrograms<B>>,
}

/// The SD3 ControlNets of one call, ready for its steps.
pub(crate) struct Sd3ControlStep<'a, B: Backend> {
    nets: &'a [SD3ControlNetModel<B>],
    request: &'a ControlRequest,
    /// Each ControlNet's control latents, rows as the transformer's batch.
    latents: Vec<Tensor<B, 4>>,
    /// The latents as the compiled step takes them (one block of rows per ControlNet), made
    /// once per run when the pipeline was compiled.
    stacked: Option<Tensor<B, 4>>,
    /// The pooled projections the ControlNets see (zeros when the first forces them).
    pooled: Tensor<B, 2>,
    steps: usize,
    programs: Option<&'a Sd3ControlPrograms<B>>,
}

impl<'a, B: Backend> Sd3Control<'a, B> {
    /// Encodes the control images at `width x height` for `batch` images (twice with
    /// guidance) as diffusers' SD3 ControlNet pipeline does; `pooled` is the transformer's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prepare(
        self,
        vae: &AutoencoderKL<B>,
        (width, height): (usize, usize),
        batch: usize,
        guided: bool,
        pooled: &Tensor<B, 2>,
        steps: usize,
        device: &B::Device,
    ) -> Result<Sd3ControlStep<'a, B>> {
        let Self {
            nets,
            request,
            noise,
            programs,
        } = self;
        request.check(nets.len())?;
        if request.guess_mode {
            return Err(PipelineError::InvalidInput(
                "guess mode is not part of the SD3 ControlNet pipeline (as in diffusers); \
                 leave it off"
                    .into(),
            ));
        }
        // The first ControlNet's config decides for all, as diffusers' `controlnet_config`.
        let zeros = nets[0].force_zeros_for_pooled_projection;
        let shift = if zeros { 0.0 } else { vae.shift_factor };
        let vae_device = vae.decoder.conv_in.weight.device();
        let mut latents = Vec::with_capacity(nets.len());
        for c in &request.controls {
            let image = preprocess::<B>(&c.image, Some(width), Some(height), 1, &vae_device)?
                .repeat_dim(0, batch);
            let image = if guided {
                Tensor::cat(vec![image.clone(), image], 0)
            } else {
                image
            };
            let dist = vae.encode(image);
            let sample = noise.randn(dist.mean.dims(), &dist.mean.device())?;
            let encoded = dist
                .sample(sample)
                .sub_scalar(shift)
                .mul_scalar(vae.scaling_factor);
            latents.push(encoded.to_device(device));
        }
        Ok(Sd3ControlStep {
            nets,
            request,
            pooled: if zeros {
                pooled.zeros_like()
            } else {
                pooled.clone()
            },
            steps,
            stacked: programs.map(|_| Tensor::cat(latents.clone(), 0)),
            latents,
            programs,
        })
    }
}

impl<B: Backend> Sd3ControlStep<'_, B> {
    /// The transformer's prediction at step `i` for the (guidance-doubled) `x` with the summed
    /// residuals of the ControlNets whose window holds the step (block by block, as many as
    /// the ControlNet with the fewest); without any, the plain transformer.
    pub(crate) fn predict(
        &self,
        transformer: &SD3Transformer2DModel<B>,
        i: usize,
        x: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        context: &Tensor<B, 3>,
        pooled: &Tensor<B, 2>,
    ) -> Result<Tensor<B, 4>> {
        let rows = x.dims()[0];
        transformer.check_inputs(x.dims(), rows, context.dims(), pooled.dims())?;
        for (net, cond) in self.nets.iter().zip(&self.latents) {
            net.check_cond(x.dims(), cond.dims())
                .map_err(|e| PipelineError::InvalidInput(e.to_string()))?;
        }
        let fewest = self
            .nets
            .iter()
            .map(|n| n.controlnet_blocks.len())
            .min()
            .unwrap_or(0);
        let dim = transformer.context_embedder.weight.dims()[1];
        let [_, _, h, w] = x.dims();
        let tokens = (h / transformer.patch_size) * (w / transformer.patch_size);
        let dims = vec![[rows, tokens, dim]; fewest];
        transformer.check_controlled(x.dims(), rows, context.dims(), pooled.dims(), &dims)?;
        let keeps = |c: &crate::control::Control| c.keeps(i, self.steps);
        if let (Some(programs), Some(conds)) = (self.programs, &self.stacked) {
            // Every ControlNet runs, scaled by 0 outside its window, as diffusers runs them.
            let scales: Vec<f32> = (self.request.controls.iter())
                .map(|c| if keeps(c) { c.scale as f32 } else { 0.0 })
                .collect();
            let scales = Tensor::<B, 1>::from_floats(scales.as_slice(), &x.device());
            return programs.call.call((
                (x, timestep, context.clone(), pooled.clone()),
                (self.pooled.clone(), conds.clone(), scales),
            ));
        }
        // Eagerly, a ControlNet outside its window is skipped: the same sum without its cost.
        let steer: Vec<_> = (self.nets.iter())
            .zip(&self.request.controls)
            .zip(&self.latents)
            .filter(|((_, c), _)| keeps(c))
            .map(|((net, c), cond)| {
                let scale = Tensor::<B, 1>::from_floats([c.scale as f32], &x.device());
                (net, cond.clone(), scale)
            })
            .collect();
        if steer.is_empty() {
            return Ok(transformer.forward(x, timestep, context.clone(), pooled.clone())?);
        }
        let control = summed_residuals(&steer, &x, &timestep, context, &self.pooled, fewest);
        Ok(transformer.forward_controlled(x, timestep, context.clone(), pooled.clone(), &control))
    }
}
