//! `FluxControlNetPipeline`: Flux text to image steered by one or more Flux ControlNets, as
//! diffusers' `pipeline_flux_controlnet.py` (several are its `FluxMultiControlNetModel`: their
//! samples are summed block by block).
//!
//! Each control image is resized to the output size, scaled to [-1, 1] and repeated for the
//! batch. For InstantX's ControlNets (and their Union) it is VAE-encoded and sampled (from the
//! request's generator, before the latents, as diffusers does), shifted and scaled, and packed
//! like the latents; XLabs' ControlNets take the pixel image through their conditioning
//! embedding (no VAE, no draw) and the transformer repeats their samples over its double
//! blocks. A ControlNet-Union takes a control mode per image ([`Control::control_mode`]); one
//! Union alone serves several images, each with its mode, as diffusers'
//! `FluxMultiControlNetModel` with one net does. The ControlNets see the packed conditioning
//! and the transformer's inputs, and their samples go to the transformer's image tokens;
//! compiled, the ControlNets and the transformer are one program.
//!
//! [`Control::control_mode`]: crate::control::Control::control_mode

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::embeddings::RotaryEmbedding;
use oxidiff_models::transformer_flux::FluxControlSamples;
use oxidiff_models::{AutoencoderKL, FluxControlNetModel, FluxTransformer2DModel};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::compiled::{CompileStats, CompiledCall, ComponentStats};
use crate::control::{
    attach, load_each, merged_component_stats, model_input, with_controlnet_memory, ControlRequest,
};
use crate::denoise::{PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::flux::{pack_latents, unpack_latents, FluxPipeline, FluxPromptEmbeds, FluxRequest};
use crate::image::preprocess;
use crate::loading::LoadOptions;
use crate::memory::{ComponentMemory, PlaceName};

/// Flux with ControlNets (diffusers' `FluxControlNetPipeline`). It derefs to the Flux pipeline
/// for its components.
pub struct FluxControlNetPipeline<B: Backend> {
    pub pipe: FluxPipeline<B>,
    pub controlnets: Vec<FluxControlNetModel<B>>,
    /// The compiled controlled step, after [`compile`](Self::compile).
    pub programs: Option<FluxControlPrograms<B>>,
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

impl FluxControlNetPipeline<Oxi> {
    /// Compiled mode: the Flux pipeline's programs (text encoders, VAE) and, per input shape,
    /// one program for the ControlNets and the transformer together ([`FluxControlPrograms`]),
    /// the control latents and scales (windows folded in) runtime inputs. Needs the
    /// transformer on a PJRT device.
    pub fn compile(&mut self) -> Result<()> {
        self.pipe.compile()?;
        self.programs = Some(FluxControlPrograms::new(
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

/// The inputs of the compiled Flux controlled step: the transformer's (unpacked latents,
/// timestep, guidance, T5 states, pooled CLIP), then the rotary tables (cos, sin), the packed
/// conditioning (one block of `batch` rows per control image), the scales (`[images]`) and the
/// control modes (`[images * batch]`, 0 for ControlNets without modes).
pub type FluxControlInputs<B> = (
    (
        Tensor<B, 4>,
        Tensor<B, 1>,
        Tensor<B, 1>,
        Tensor<B, 3>,
        Tensor<B, 2>,
    ),
    (
        (Tensor<B, 2>, Tensor<B, 2>),
        Tensor<B, 3>,
        Tensor<B, 1>,
        Tensor<B, 1, Int>,
    ),
);

/// The compiled Flux controlled step: every ControlNet (scaled by 0 outside its window, as
/// diffusers runs them) and the transformer as one XLA program per input shape.
pub struct FluxControlPrograms<B: Backend> {
    call: CompiledCall<B, FluxControlInputs<B>>,
}

impl FluxControlPrograms<Oxi> {
    /// The program of `transformer` steered by `nets`; nothing is traced before the first
    /// call.
    pub fn new(
        transformer: &FluxTransformer2DModel<Oxi>,
        nets: &[FluxControlNetModel<Oxi>],
    ) -> Self {
        let (transformer, nets) = (transformer.clone(), nets.to_vec());
        let step = move |inputs: FluxControlInputs<Oxi>| {
            let ((latents, t, g, prompt_embeds, pooled), ((cos, sin), conds, scales, modes)) =
                inputs;
            let images = scales.dims()[0];
            let rows = conds.dims()[0] / images;
            let steer: Vec<_> = (0..images)
                .map(|k| {
                    let net = net_for(&nets, k);
                    Steer {
                        net,
                        cond: conds.clone().narrow(0, k * rows, rows),
                        mode: (net.num_mode()).map(|_| modes.clone().narrow(0, k * rows, rows)),
                        scale: scales.clone().narrow(0, k, 1),
                    }
                })
                .collect();
            let text = FluxPromptEmbeds {
                prompt_embeds,
                pooled_prompt_embeds: pooled,
            };
            let rope = RotaryEmbedding { cos, sin };
            let fewest = fewest_blocks(&nets);
            // The modes were checked against the ControlNets when the request was prepared.
            controlled_velocity(&transformer, &steer, latents, t, g, &text, &rope, fewest)
                .expect("the control modes were checked before the compiled step")
        };
        Self {
            call: CompiledCall::new("flux-controlnets+transformer", step, None, Vec::new()),
        }
    }
}

/// The ControlNet of control image `k`: the only one (a Union serves every image) or the
/// `k`-th.
fn net_for<B: Backend>(nets: &[FluxControlNetModel<B>], k: usize) -> &FluxControlNetModel<B> {
    &nets[if nets.len() == 1 { 0 } else { k }]
}

/// One ControlNet run of a step: the net, its packed conditioning, its mode indices (`[batch]`,
/// Union only) and its `[1]` scale.
struct Steer<'a, B: Backend> {
    net: &'a FluxControlNetModel<B>,
    cond: Tensor<B, 3>,
    mode: Option<Tensor<B, 1, Int>>,
    scale: Tensor<B, 1>,
}

/// The fewest double and single blocks among `nets`: how many samples diffusers' pairwise
/// sum keeps.
fn fewest_blocks<B: Backend>(nets: &[FluxControlNetModel<B>]) -> (usize, usize) {
    let fewest =
        |count: fn(&FluxControlNetModel<B>) -> usize| nets.iter().map(count).min().unwrap_or(0);
    (
        fewest(|n| n.controlnet_blocks.len()),
        fewest(|n| n.controlnet_single_blocks.len()),
    )
}

/// The transformer's velocity for `latents` (`[b, c, h, w]`, unpacked) with the summed samples
/// of `steer`, kept to `fewest` (double, single) as diffusers' pairwise sum keeps them; the
/// eager step and the compiled program both run it. `timestep` and `guidance` are the loop's
/// `[1]` tensors.
#[allow(clippy::too_many_arguments)]
fn controlled_velocity<B: Backend>(
    transformer: &FluxTransformer2DModel<B>,
    steer: &[Steer<'_, B>],
    latents: Tensor<B, 4>,
    timestep: Tensor<B, 1>,
    guidance: Tensor<B, 1>,
    text: &FluxPromptEmbeds<B>,
    rope: &RotaryEmbedding<B>,
    (blocks, singles): (usize, usize),
) -> oxidiff_models::Result<Tensor<B, 4>> {
    let [b, _, h, w] = latents.dims();
    let packed = pack_latents(latents);
    let timestep = timestep.div_scalar(1000.0).expand([b]);
    let guidance = guidance.expand([b]);
    let mut sum: Option<FluxControlSamples<B>> = None;
    for Steer {
        net,
        cond,
        mode,
        scale,
    } in steer
    {
        let samples = net.forward(
            packed.clone(),
            cond.clone(),
            mode.clone(),
            text.prompt_embeds.clone(),
            text.pooled_prompt_embeds.clone(),
            timestep.clone(),
            Some(guidance.clone()),
            rope,
            scale.clone(),
        )?;
        sum = Some(match sum {
            None => samples,
            Some(sum) => sum.sum(samples),
        });
    }
    let sum = sum.map(|mut sum| {
        sum.blocks.truncate(blocks);
        sum.single_blocks.truncate(singles);
        sum
    });
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

impl<B: Backend> FluxControlNetPipeline<B> {
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
    /// transformer.
    pub fn new(pipe: FluxPipeline<B>, controlnets: Vec<FluxControlNetModel<B>>) -> Result<Self> {
        let device = pipe.device.clone();
        let controlnets = attach(controlnets, &device, |net| {
            net.check_fits(&pipe.transformer).map_err(model_input)
        })?;
        if let [first, rest @ ..] = controlnets.as_slice() {
            if rest
                .iter()
                .any(|n| n.takes_pixels() != first.takes_pixels())
            {
                return Err(PipelineError::InvalidInput(
                    "XLabs Flux ControlNets (conditioning embedding on the pixel image) and \
                     InstantX ones (VAE latents) cannot be combined, as in diffusers (the \
                     first one decides how every control image is prepared); use ControlNets \
                     of one kind"
                        .into(),
                ));
            }
        }
        Ok(Self {
            pipe,
            controlnets,
            programs: None,
        })
    }

    /// Loads a Flux folder and Flux ControlNet folders.
    pub fn from_dir(
        dir: &Path,
        controlnets: &[&Path],
        options: &LoadOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let pipe = FluxPipeline::from_dir(dir, options, device)?;
        let nets = load_each(controlnets, options, |dir, variant, dtype| {
            FluxControlNetModel::from_dir_in(dir, variant, dtype, device)
        })?;
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
            programs: self.programs.as_ref(),
        };
        self.pipe
            .generate_controlled(req, Some(control), noise, callback)
    }
}

/// The Flux ControlNets of one call, before their control latents are made.
pub(crate) struct FluxControl<'a, B: Backend> {
    nets: &'a [FluxControlNetModel<B>],
    request: &'a ControlRequest,
    programs: Option<&'a FluxControlPrograms<B>>,
}

/// The Flux ControlNets of one call with their packed conditioning.
pub(crate) struct FluxControlStep<'a, B: Backend> {
    nets: &'a [FluxControlNetModel<B>],
    request: &'a ControlRequest,
    latents: Vec<Tensor<B, 3>>,
    /// Each image's control mode repeated for the batch (Unions only).
    modes: Vec<Option<Tensor<B, 1, Int>>>,
    /// The conditioning and modes as the compiled step takes them (one block of rows per
    /// image; mode 0 for ControlNets without modes), made once per run when the pipeline was
    /// compiled.
    stacked: Option<(Tensor<B, 3>, Tensor<B, 1, Int>)>,
    programs: Option<&'a FluxControlPrograms<B>>,
}

impl<'a, B: Backend> FluxControl<'a, B> {
    /// Encodes (or, for XLabs' ControlNets, embeds) and packs the control images at `width x
    /// height` for `batch` images, after checking each image's control mode.
    pub(crate) fn prepare(
        self,
        vae: &AutoencoderKL<B>,
        (width, height): (usize, usize),
        batch: usize,
        noise: &mut dyn NoiseSource<B>,
        device: &B::Device,
    ) -> Result<FluxControlStep<'a, B>> {
        let Self {
            nets,
            request,
            programs,
        } = self;
        // diffusers' `FluxMultiControlNetModel` with one ControlNet runs it once per image.
        let union_alone = matches!(nets, [net] if net.num_mode().is_some());
        let images = if union_alone {
            request.controls.len().max(1)
        } else {
            nets.len()
        };
        request.check_with_modes(images)?;
        for (k, c) in request.controls.iter().enumerate() {
            net_for(nets, k)
                .check_mode(c.control_mode)
                .map_err(|e| match e {
                    oxidiff_models::ModelError::Input(message) => PipelineError::InvalidInput(
                        format!("control image {k}: {message} (`Control::control_mode`)"),
                    ),
                    other => model_input(other),
                })?;
        }
        if request.guess_mode {
            return Err(PipelineError::InvalidInput(
                "guess mode is not part of the Flux ControlNet pipeline (as in diffusers); \
                 leave it off"
                    .into(),
            ));
        }
        let vae_device = vae.decoder.conv_in.weight.device();
        let mut latents = Vec::with_capacity(request.controls.len());
        let mut modes = Vec::with_capacity(request.controls.len());
        for (k, c) in request.controls.iter().enumerate() {
            let net = net_for(nets, k);
            if net.takes_pixels() {
                // XLabs: the pixel image through the ControlNet's embedding; no VAE, no draw.
                let image = preprocess::<B>(&c.image, Some(width), Some(height), 1, device)?
                    .repeat_dim(0, batch);
                latents.push(net.embed_pixels(image).map_err(model_input)?);
            } else {
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
            let mode = c.control_mode.unwrap_or(0) as i64;
            modes.push(Tensor::<B, 1, Int>::from_data(
                burn::tensor::TensorData::new(vec![mode; batch], [batch]),
                device,
            ));
        }
        let stacked = programs.map(|_| {
            (
                Tensor::cat(latents.clone(), 0),
                Tensor::cat(modes.clone(), 0),
            )
        });
        let modes = (modes.into_iter().enumerate())
            .map(|(k, m)| net_for(nets, k).num_mode().map(|_| m))
            .collect();
        Ok(FluxControlStep {
            nets,
            request,
            latents,
            modes,
            stacked,
            programs,
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
        let [b, c, h, w] = latents.dims();
        let packed_dims = [b, (h / 2) * (w / 2), c * 4];
        for cond in &self.latents {
            if cond.dims() != packed_dims {
                return Err(PipelineError::InvalidInput(format!(
                    "the packed conditioning is {:?}; the packed latents {packed_dims:?}",
                    cond.dims()
                )));
            }
        }
        let fewest = fewest_blocks(self.nets);
        transformer.check_control(fewest.0, fewest.1)?;
        let keeps = |c: &crate::control::Control| c.keeps(i, n);
        if let (Some(programs), Some((conds, modes))) = (self.programs, &self.stacked) {
            // Every ControlNet runs, scaled by 0 outside its window, as diffusers runs them.
            let scales: Vec<f32> = (self.request.controls.iter())
                .map(|c| if keeps(c) { c.scale as f32 } else { 0.0 })
                .collect();
            let scales = Tensor::<B, 1>::from_floats(scales.as_slice(), &latents.device());
            return programs.call.call((
                (
                    latents,
                    timestep,
                    guidance,
                    text.prompt_embeds.clone(),
                    text.pooled_prompt_embeds.clone(),
                ),
                (
                    (rope.cos.clone(), rope.sin.clone()),
                    conds.clone(),
                    scales,
                    modes.clone(),
                ),
            ));
        }
        // Eagerly, a ControlNet outside its window is skipped: the same sum without its cost.
        let steer: Vec<_> = (self.request.controls.iter().enumerate())
            .zip(&self.latents)
            .zip(&self.modes)
            .filter(|(((_, c), _), _)| keeps(c))
            .map(|(((k, c), cond), mode)| Steer {
                net: net_for(self.nets, k),
                cond: cond.clone(),
                mode: mode.clone(),
                scale: Tensor::<B, 1>::from_floats([c.scale as f32], &latents.device()),
            })
            .collect();
        controlled_velocity(
            transformer,
            &steer,
            latents,
            timestep,
            guidance,
            text,
            rope,
            fewest,
        )
        .map_err(model_input)
    }
}
