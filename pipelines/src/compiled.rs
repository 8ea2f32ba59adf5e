//! Compiled mode's pieces every pipeline shares: [`CompiledCall`], a call of a component (a
//! tuple of input tensors to one output) as XLA programs, traced on first use and cached by
//! input shapes, optionally partitioned over a device mesh; the denoiser call of each pipeline
//! is one, and so are the VAE's encoder and decoder ([`compile_vae`]), CLIP's layers
//! ([`compile_clip`]) and T5's blocks ([`compile_t5`]).
//!
//! Where this sits: beside `denoise.rs` on the ground floor; it wraps backend-tpu's
//! `CompiledFn` so that pipelines generic over the backend can hold it, built only for `Oxi`.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use oxidiff_backend_tpu::compiled::{CompileInfo, Fused, FusedStats, Tensors};
use oxidiff_backend_tpu::spmd::{Layout, SpmdPlacement};
use oxidiff_backend_tpu::{CompiledFn, Oxi, OxiDevice};
use oxidiff_models::{AutoencoderKL, ClipTextModel, ProgramSlot, T5EncoderModel, TensorProgram};

use crate::error::{PipelineError, Result};

/// Counts of compiled mode, for one component or summed over several.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileStats {
    /// Programs built, one per input signature (image size, batch, guidance on or off).
    pub programs: u64,
    /// Of those, how many XLA compiled; the others were loaded from the on-disk cache.
    pub xla_compiles: u64,
    pub disk_loads: u64,
}

impl std::ops::Add for CompileStats {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            programs: self.programs + other.programs,
            xla_compiles: self.xla_compiles + other.xla_compiles,
            disk_loads: self.disk_loads + other.disk_loads,
        }
    }
}

/// Compiled mode's counts of one component of a pipeline (`--json`'s `components`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComponentStats {
    /// `"text_encoder"`, `"text_encoder_2"`, `"unet"`, `"transformer"`, `"scheduler"`,
    /// `"vae_encoder"`, `"vae_decoder"`.
    pub component: &'static str,
    pub stats: CompileStats,
}

/// What a compiled call offers, object-safe so the backend type stays a parameter.
trait Call<B: Backend, I>: Send + Sync {
    fn call(&self, inputs: I) -> Result<Tensor<B, 4>>;
    fn stats(&self) -> CompileStats;
    fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>>;
    fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>>;
    fn compile_log(&self) -> Vec<CompileInfo>;
}

type StepFn<I> = Box<dyn Fn(I) -> Tensor<Oxi, 4> + Send + Sync>;

fn compile_error(e: impl std::fmt::Display) -> PipelineError {
    PipelineError::Compile(e.to_string())
}

impl<I: Tensors> Call<Oxi, I> for CompiledFn<I, Tensor<Oxi, 4>, StepFn<I>> {
    fn call(&self, inputs: I) -> Result<Tensor<Oxi, 4>> {
        CompiledFn::call(self, inputs).map_err(compile_error)
    }

    fn stats(&self) -> CompileStats {
        CompileStats {
            programs: self.compiles(),
            xla_compiles: self.xla_compiles(),
            disk_loads: self.disk_loads(),
        }
    }

    fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        CompiledFn::spmd_placement(self)
    }

    fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>> {
        CompiledFn::optimized_opcode_counts(self).map_err(compile_error)
    }

    fn compile_log(&self) -> Vec<CompileInfo> {
        CompiledFn::compile_log(self)
    }
}

/// A component's call with inputs `I` (a tensor or a tuple of them) run as compiled programs.
pub struct CompiledCall<B: Backend, I> {
    inner: Box<dyn Call<B, I>>,
}

impl<B: Backend, I> CompiledCall<B, I> {
    /// Runs the call: traced and compiled for a new input signature, cached otherwise.
    pub fn call(&self, inputs: I) -> Result<Tensor<B, 4>> {
        self.inner.call(inputs)
    }

    /// What was compiled so far.
    pub fn compile_stats(&self) -> CompileStats {
        self.inner.stats()
    }

    /// The device mesh and weight shards, when the call runs partitioned.
    pub fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        self.inner.spmd_placement()
    }

    /// Opcode counts of each compiled program's optimized HLO (the collectives of a
    /// partitioned one among them); empty when not compiled by XLA here.
    pub fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>> {
        self.inner.optimized_opcode_counts()
    }

    /// Each program built so far, in order: why, its size, and whether it was compiled or
    /// loaded from the disk cache (kernel transposes are not programs: they are only counted,
    /// in [`compile_stats`](Self::compile_stats)).
    pub fn compile_log(&self) -> Vec<CompileInfo> {
        self.inner.compile_log()
    }
}

impl<I: Tensors + 'static> CompiledCall<Oxi, I> {
    /// `step` compiled as program `name`; with a `placement`, partitioned over its mesh with
    /// input `k` laid out as `layouts[k]`.
    pub fn new(
        name: &str,
        step: impl Fn(I) -> Tensor<Oxi, 4> + Send + Sync + 'static,
        placement: Option<Arc<SpmdPlacement>>,
        layouts: Vec<Layout>,
    ) -> Self {
        Self::build(name, step, placement, layouts, None)
    }

    /// [`new`](Self::new), warm-started: the programs `warm`'s component built in earlier
    /// processes are loaded from the disk cache now, not at its first calls.
    pub fn warm_started(
        name: &str,
        step: impl Fn(I) -> Tensor<Oxi, 4> + Send + Sync + 'static,
        placement: Option<Arc<SpmdPlacement>>,
        layouts: Vec<Layout>,
        warm: WarmStart,
    ) -> Self {
        Self::build(name, step, placement, layouts, Some(warm))
    }

    fn build(
        name: &str,
        step: impl Fn(I) -> Tensor<Oxi, 4> + Send + Sync + 'static,
        placement: Option<Arc<SpmdPlacement>>,
        layouts: Vec<Layout>,
        warm: Option<WarmStart>,
    ) -> Self {
        // Programs for XLA's CPU plugin may call oxidiff's CPU kernels.
        crate::host_kernels::install();
        let step: StepFn<I> = Box::new(step);
        let f = CompiledFn::new(name, step);
        let f = match placement {
            Some(placement) => f.with_spmd(placement, layouts),
            None => f,
        };
        let f = match warm {
            Some(warm) => f.warm_start(warm.tag, &warm.device),
            None => f,
        };
        Self { inner: Box::new(f) }
    }
}

/// What a compiled call's warm start ([`CompiledFn::warm_start`]) is keyed by: its component
/// and the architecture of the model it traces (every weight's shape, and the weights' stored
/// dtype), whose programs are the same whatever the weights hold; and the device it runs on.
pub struct WarmStart {
    tag: String,
    device: OxiDevice,
}

impl WarmStart {
    /// `component` of `model`, run on `device`.
    pub fn of<M: Module<Oxi>>(component: &str, model: &M, device: OxiDevice) -> Self {
        let mut architecture = Architecture::default();
        model.visit(&mut architecture);
        let dtype = architecture
            .dtype
            .map_or("-".to_string(), oxidiff_models::memory::dtype_name);
        // The disk cache hashes the tag; it may be long.
        Self {
            tag: format!("{component} {dtype} {}", architecture.shapes),
            device,
        }
    }
}

/// A model's weights' shapes in order (`4x3x3x3,4,...`) and the dtype of the first one loaded,
/// read without loading a lazy weight.
#[derive(Default)]
struct Architecture {
    shapes: String,
    dtype: Option<DType>,
}

impl ModuleVisitor<Oxi> for Architecture {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Oxi, D>>) {
        let dims = param.lazy_shape().dims::<D>().map(|d| d.to_string());
        if !self.shapes.is_empty() {
            self.shapes.push(',');
        }
        self.shapes.push_str(&dims.join("x"));
        if self.dtype.is_none() && param.is_initialized() {
            self.dtype = Some(param.val().dtype());
        }
    }
}

/// Compiled mode's scheduler step: each step's tensor math (whatever the scheduler, with its
/// history and noise) runs as one program, fused from the ops the step records (backend-tpu's
/// [`Fused`]). The step itself still runs on the host every time, so its branches and state
/// stay the scheduler's; its scalars (sigmas, coefficients) are program arguments, so a new
/// step, step count or scheduler config reuses the programs, one per structure a scheduler
/// has (a multistep scheduler's first, middle and last steps differ).
pub struct SchedulerProgram<B: Backend> {
    inner: Box<dyn FusedRun<B>>,
}

/// What a fused step offers, object-safe so the backend type stays a parameter.
trait FusedRun<B: Backend>: Send + Sync {
    fn run(&self, device: &B::Device, f: &mut dyn FnMut()) -> Result<()>;
    fn stats(&self) -> FusedStats;
}

impl FusedRun<Oxi> for Fused {
    fn run(&self, device: &OxiDevice, f: &mut dyn FnMut()) -> Result<()> {
        Fused::run(self, device, f).map_err(compile_error)
    }

    fn stats(&self) -> FusedStats {
        Fused::stats(self)
    }
}

impl SchedulerProgram<Oxi> {
    /// A fused scheduler step; nothing is compiled before its first step.
    pub fn new() -> Self {
        Self {
            inner: Box::new(Fused::new("scheduler_step")),
        }
    }
}

impl Default for SchedulerProgram<Oxi> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> SchedulerProgram<B> {
    /// Runs `step` (a scheduler step on tensors of `device`) with its ops as one program.
    pub fn run<R>(&self, device: &B::Device, step: impl FnOnce() -> R) -> Result<R> {
        let mut step = Some(step);
        let mut out = None;
        self.inner.run(device, &mut || {
            if let Some(step) = step.take() {
                out = Some(step());
            }
        })?;
        out.ok_or_else(|| compile_error("the fused scheduler step did not run (a bug)"))
    }

    /// Programs built so far (one per structure), XLA compiles and disk loads.
    pub fn compile_stats(&self) -> CompileStats {
        let stats = self.inner.stats();
        CompileStats {
            programs: stats.programs,
            xla_compiles: stats.xla_compiles,
            disk_loads: stats.disk_loads,
        }
    }

    /// Steps whose ops could not be made one program and ran one by one.
    pub fn eager_fallbacks(&self) -> u64 {
        self.inner.stats().eager_fallbacks
    }
}

/// A part of a model (the VAE's encoder or decoder, CLIP's layers) as a compiled call with an
/// input of rank `I`, installed in the model's [`ProgramSlot`](oxidiff_models::ProgramSlot).
struct PartProgram<I> {
    /// The model and part, for the warning.
    part: &'static str,
    call: CompiledCall<Oxi, I>,
    /// Whether the fallback to the model's ops was reported already.
    warned: AtomicBool,
}

impl<I: Tensors + 'static> PartProgram<I> {
    /// `part` compiled as program `part`, warm-started as `warm` says.
    fn install(
        slot: &mut ProgramSlot,
        part: &'static str,
        warm: WarmStart,
        ops: impl Fn(I) -> Tensor<Oxi, 4> + Send + Sync + 'static,
    ) {
        let program = Arc::new(Self {
            part,
            call: CompiledCall::warm_started(part, ops, None, Vec::new(), warm),
            warned: AtomicBool::new(false),
        });
        slot.install::<Oxi, I, 4>(program);
    }

    /// The counts of the program of input `I` in `slot`, if one is installed on [`Oxi`].
    fn stats(slot: &ProgramSlot, component: &'static str) -> Option<ComponentStats> {
        let program = slot.get::<Oxi, I, 4>()?.as_any().downcast_ref::<Self>()?;
        Some(ComponentStats {
            component,
            stats: program.call.compile_stats(),
        })
    }
}

impl<I: Tensors + 'static> TensorProgram<Oxi, I, 4> for PartProgram<I> {
    fn run(&self, input: I) -> Option<Tensor<Oxi, 4>> {
        match self.call.call(input) {
            Ok(output) => Some(output),
            Err(e) => {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!("{e}; the {} runs op by op instead", self.part);
                }
                None
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Compiled mode for `vae`: its encoder and its decoder each become one program per input
/// shape (one per tile shape when tiling is on), so scaling, slicing and tiling stay the
/// model's and need no program of their own. A VAE off PJRT devices keeps its ops.
pub fn compile_vae(vae: &mut AutoencoderKL<Oxi>) {
    vae.clear_programs();
    if !vae.decoder.conv_in.weight.device().is_pjrt() {
        return;
    }
    // The programs trace a copy whose slots are empty, so they record the ops.
    let ops = Arc::new(vae.clone());
    let encoder = Arc::clone(&ops);
    let device = vae.decoder.conv_in.weight.device();
    let warm = |part| WarmStart::of(part, &*ops, device.clone());
    PartProgram::<Tensor<Oxi, 4>>::install(
        &mut vae.encoder_program,
        "vae_encoder",
        warm("vae_encoder"),
        move |image| encoder.run_encoder(image),
    );
    PartProgram::<Tensor<Oxi, 4>>::install(
        &mut vae.decoder_program,
        "vae_decoder",
        warm("vae_decoder"),
        move |latents| ops.run_decoder(latents),
    );
}

/// Compiled mode for a CLIP text encoder: its layers and final norm become one program per
/// token count (the embedding lookup and the pooled token stay ops). Off PJRT devices it keeps
/// its ops.
pub fn compile_clip(text_encoder: &mut ClipTextModel<Oxi>, component: &'static str) {
    text_encoder.layers_program.clear();
    if !text_encoder.token_embedding.weight.device().is_pjrt() {
        return;
    }
    let ops = text_encoder.clone();
    let warm = WarmStart::of(
        component,
        &ops,
        text_encoder.token_embedding.weight.device(),
    );
    PartProgram::<Tensor<Oxi, 3>>::install(
        &mut text_encoder.layers_program,
        component,
        warm,
        move |x| ops.run_layers(x),
    );
}

/// Compiled mode for a T5 text encoder (`component`: `text_encoder_2`, ...): its blocks and
/// final norm become one program per token length and batch (the embedding lookup and the
/// attention bias, made on the host from the token ids and mask, stay ops). Nothing off PJRT
/// devices.
pub fn compile_t5(text_encoder: &mut T5EncoderModel<Oxi>, component: &'static str) {
    text_encoder.blocks_program.clear();
    if !text_encoder.device().is_pjrt() {
        return;
    }
    let ops = text_encoder.clone();
    let warm = WarmStart::of(component, &ops, text_encoder.device());
    PartProgram::<(Tensor<Oxi, 3>, Tensor<Oxi, 4>)>::install(
        &mut text_encoder.blocks_program,
        component,
        warm,
        move |(x, bias)| ops.run_blocks(x, bias),
    );
}

/// The counts of a T5 text encoder's program, named `component` (none when eager).
pub fn t5_compile_stats<B: Backend>(
    text_encoder: &T5EncoderModel<B>,
    component: &'static str,
) -> Option<ComponentStats> {
    PartProgram::<(Tensor<Oxi, 3>, Tensor<Oxi, 4>)>::stats(&text_encoder.blocks_program, component)
}

/// The counts of `vae`'s installed programs (none when eager), named as [`compile_vae`]'s.
pub fn vae_compile_stats<B: Backend>(vae: &AutoencoderKL<B>) -> Vec<ComponentStats> {
    [
        PartProgram::<Tensor<Oxi, 4>>::stats(&vae.encoder_program, "vae_encoder"),
        PartProgram::<Tensor<Oxi, 4>>::stats(&vae.decoder_program, "vae_decoder"),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The counts of a CLIP text encoder's program, named `component` (none when eager).
pub fn clip_compile_stats<B: Backend>(
    text_encoder: &ClipTextModel<B>,
    component: &'static str,
) -> Option<ComponentStats> {
    PartProgram::<Tensor<Oxi, 3>>::stats(&text_encoder.layers_program, component)
}

/// A pipeline's counts per component: its text encoders' (CLIP's, by component name), its
/// denoiser's (`None` when eager) named `denoiser`, its scheduler step's (`"scheduler"`),
/// then its VAE's. `t5` is a T5 encoder's, counted after the CLIP ones.
pub(crate) fn component_stats<B: Backend>(
    text_encoders: &[(&'static str, &ClipTextModel<B>)],
    t5: Option<(&'static str, &T5EncoderModel<B>)>,
    denoiser: &'static str,
    stats: Option<CompileStats>,
    scheduler: Option<&SchedulerProgram<B>>,
    vae: &AutoencoderKL<B>,
) -> Vec<ComponentStats> {
    let mut all: Vec<ComponentStats> = text_encoders
        .iter()
        .filter_map(|(name, encoder)| clip_compile_stats(encoder, name))
        .collect();
    all.extend(t5.and_then(|(name, encoder)| t5_compile_stats(encoder, name)));
    all.extend(stats.map(|stats| ComponentStats {
        component: denoiser,
        stats,
    }));
    all.extend(scheduler.map(|program| ComponentStats {
        component: "scheduler",
        stats: program.compile_stats(),
    }));
    all.extend(vae_compile_stats(vae));
    all
}
