//! Ahead-of-time compile of the compiled denoising step (the program `pipe.compile()` runs:
//! an SD UNet with classifier-free guidance, an SDXL UNet, an SD3 or a Flux transformer) for TPU
//! topologies with libtpu, on a machine without a TPU, and a roofline estimate of the TPU step
//! time from XLA's cost analysis.
//!
//! `tpu_roofline MODEL_DIR [--size 512] [--batch 1] [--no-guidance] [--tokens 77]
//! [--dtype f32|bf16] [--kernels DIR] [--tp N] [--topology v5e:2x2x1]...`
//! (MODEL_DIR is a diffusers pipeline folder, its `unet/` or `transformer/`, or a folder with a
//! weights header such as `tests/fixtures/aot/sdxl-unet`; default topologies v5e and v6e.
//! `--kernels` splices the kernel hub's attention kernels in for each topology's generation, as
//! compiled mode does with `OXIDIFF_KERNELS`; `--tp` splits the model over the topology's
//! first N devices as `enable_parallelism` does, and the figures are per device; `--tokens` is
//! the text length, 512 for Flux, 333 for SD3.)
//!
//! The estimate is `max(flops / peak flop/s, bytes accessed / HBM bandwidth)` for one chip, with
//! the published per-chip peaks below (bf16 matrix units; the program is f32, which XLA's TPU
//! backend runs on the same units at its default precision). It ignores latency, launch and
//! the non-matrix units, so it is a lower bound on the step time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::FloatDType;
use oxidiff::backend::kernels::{AttentionKernels, KernelHub, KernelTarget};
use oxidiff::backend::pjrt::{CompileOptions, Plugin};
use oxidiff::pipelines::aot::{trace_denoiser, DenoiserInputs, TraceParallel, TraceSettings};
use oxidiff::pipelines::parallel::ParallelConfig;

/// Published per-chip peaks: (name prefix, bf16 flop/s, HBM bytes/s).
/// TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM2; TPU v6e (Trillium): 918 TFLOP/s bf16, 1640 GB/s.
const PEAKS: [(&str, f64, f64); 2] = [("v5e", 197e12, 819e9), ("v6e", 918e12, 1640e9)];

fn value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1).filter(|a| !a.starts_with("--")) else {
        bail!("usage: tpu_roofline MODEL_DIR [--size 512] [--batch 1] [--no-guidance] [--topology v5e:2x2x1]...");
    };
    let mut model = PathBuf::from(dir);
    for component in ["unet", "transformer"] {
        if model.join(component).is_dir() {
            model = model.join(component);
        }
    }
    let number = |name: &str, default: usize| -> Result<usize> {
        value(&args, name)
            .map(|s| s.parse())
            .transpose()
            .with_context(|| format!("{name} takes a number"))
            .map(|v| v.unwrap_or(default))
    };
    let size = number("--size", 512)?;
    let batch = number("--batch", 1)?;
    let tokens = number("--tokens", 77)?;
    let tp = number("--tp", 1)?;
    let dtype = match value(&args, "--dtype").as_deref() {
        None | Some("f32") => FloatDType::F32,
        Some("bf16") => FloatDType::BF16,
        Some(other) => bail!("--dtype takes f32 or bf16, not {other}"),
    };
    let hub = value(&args, "--kernels").map(|dir| KernelHub::open(&PathBuf::from(dir)));
    let guidance = !args.iter().any(|a| a == "--no-guidance");
    let mut topologies: Vec<String> = args
        .windows(2)
        .filter(|w| w[0] == "--topology")
        .map(|w| w[1].clone())
        .collect();
    if topologies.is_empty() {
        topologies = vec!["v5e:2x2x1".into(), "v6e:2x2x1".into()];
    }
    let inputs = DenoiserInputs {
        batch,
        latent_height: size / 8,
        latent_width: size / 8,
        guidance,
        text_tokens: tokens,
    };
    // The program of one topology: with kernels, traced for its TPU generation.
    let trace = |topology: &str| -> Result<_> {
        let kernels = hub.as_ref().map(|hub| {
            let generation = topology.split(':').next().unwrap_or(topology);
            std::sync::Arc::new(AttentionKernels::new(
                hub.clone(),
                KernelTarget::Tpu(generation.into()),
            ))
        });
        let parallel = (tp > 1).then(|| TraceParallel {
            config: ParallelConfig::new(1, tp),
            devices: tp,
        });
        let settings = TraceSettings {
            dtype,
            kernels,
            parallel,
        };
        let started = Instant::now();
        let step = trace_denoiser(&model, None, inputs, &settings)?;
        println!(
            "{}: {size}x{size}, batch {batch}, guidance in the program {}, {dtype:?}: traced {} ops ({} attentions, {} as kernel calls) into {:.1} MiB of StableHLO with {} weight arguments ({:.1} MiB) in {:.2?}",
            model.display(),
            step.guidance,
            step.ops,
            step.attentions,
            step.kernel_calls,
            step.module.len() as f64 / (1 << 20) as f64,
            step.weights,
            step.weight_bytes as f64 / (1 << 20) as f64,
            started.elapsed()
        );
        Ok(step)
    };
    // Without kernels every topology compiles the same program.
    let shared = match hub {
        None => Some(trace(&topologies[0])?),
        Some(_) => None,
    };
    let plugin = Plugin::discover("tpu").context("libtpu (tools/fetch-plugins.sh --only tpu)")?;
    for name in &topologies {
        let step = match &shared {
            Some(step) => step.clone(),
            None => trace(name)?,
        };
        let topology = plugin.topology(name, &[])?;
        let started = Instant::now();
        let options = if tp > 1 {
            let ids: Vec<i64> = topology
                .devices()?
                .iter()
                .map(|d| i64::from(d.id))
                .collect();
            if ids.len() < tp {
                bail!("{name} has {} devices, fewer than --tp {tp}", ids.len());
            }
            CompileOptions::spmd(&ids[..tp])
        } else {
            CompileOptions::default()
        };
        let exe = topology.compile(&step.module, &options)?;
        let compile = started.elapsed();
        let code = exe.generated_code_size()?;
        let serialized = exe.serialize()?.len();
        let cost = exe.cost_analysis()?;
        let flops = cost.flops().unwrap_or(f64::NAN);
        let bytes = cost.bytes_accessed().unwrap_or(f64::NAN);
        let transcendentals = cost.transcendentals().unwrap_or(f64::NAN);
        println!(
            "{name}: compiled in {compile:.2?}; generated code {:.2} MiB, serialized {:.2} MiB; {:.3} GFLOP, {:.3} G transcendentals, {:.1} MiB accessed (intensity {:.1} flop/byte)",
            code as f64 / (1 << 20) as f64,
            serialized as f64 / (1 << 20) as f64,
            flops / 1e9,
            transcendentals / 1e9,
            bytes / (1 << 20) as f64,
            flops / bytes
        );
        if let Some(seconds) = cost.get("optimal_seconds") {
            println!("  XLA's own optimal_seconds: {:.3} ms", seconds * 1e3);
        }
        match PEAKS.iter().find(|(prefix, _, _)| name.starts_with(prefix)) {
            Some((chip, peak, bandwidth)) => {
                let compute = flops / peak;
                let memory = bytes / bandwidth;
                println!(
                    "  roofline on one {chip} ({:.0} TFLOP/s, {:.0} GB/s): compute {:.3} ms, memory {:.3} ms -> at least {:.3} ms per step ({}-bound)",
                    peak / 1e12,
                    bandwidth / 1e9,
                    compute * 1e3,
                    memory * 1e3,
                    compute.max(memory) * 1e3,
                    if compute >= memory { "compute" } else { "memory" }
                );
            }
            None => println!("  (no published peaks recorded for {name})"),
        }
        let others: Vec<_> = cost
            .properties
            .iter()
            .filter(|(n, _)| !n.starts_with("bytes accessed") || n == "bytes accessed")
            .collect();
        println!("  cost analysis: {others:?}");
    }
    Ok(())
}
