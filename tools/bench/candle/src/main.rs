//! The candle column of the benchmark suite (`tools/bench/run.py --impls ...,candle`): candle's
//! own Stable Diffusion 1.5 UNet and VAE (candle-transformers 0.11, `StableDiffusionConfig::v1_5`)
//! loaded from a diffusers folder, timed as `examples/src/bin/bench.rs` times oxidiff's, and
//! printed as one JSON line of the same shape.
//!
//! `candle-bench DIR [--size 256] [--repeat 2] [--dtype f32|bf16]`
//!
//! Measured, in this order, in one process:
//! - `load_s`: building the UNet and the VAE from `unet/` and `vae/diffusion_pytorch_model.safetensors`
//!   (candle copies every weight out of the memory map, cast to `--dtype`);
//! - `unet_step`: the UNet call of one denoising step with classifier-free guidance: sample
//!   `[2, 4, size/8, size/8]`, timestep 501, context `[2, 77, 768]` (seeded normal values; the
//!   guidance combination itself is negligible and left out);
//! - `vae_decode`: decoding `[1, 4, size/8, size/8]` latents divided by 0.18215;
//! - `peak_rss_bytes`: the process's `VmHWM` at the end.
//!
//! Each timing is `{first_s, min_s, median_s, max_s, repeats, times_s, cpu_times_s}`: `first_s`
//! is the warm-up call, the others are over `--repeat` calls after it. Threads: candle's CPU
//! matmuls go through the gemm crate on rayon, sized by `RAYON_NUM_THREADS`.
//!
//! `--dtype bf16` fails in the UNet's first convolution with candle 0.11.1 ("unsupported dtype
//! BF16 for op matmul"): its CPU conv2d calls the gemm matmul, which takes f16/f32/f64 only
//! (the standalone matmul widens bf16 to f32, the convolution does not). The option stays for
//! a later candle.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::stable_diffusion::StableDiffusionConfig;

const USAGE: &str = "usage: candle-bench DIR [--size N] [--repeat N] [--dtype f32|bf16]";

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The process's CPU time (all threads), as the oxidiff bench reports it.
fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write into.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// `n` standard normal values from a seeded splitmix64 stream (Box-Muller): the same inputs
/// in every run, without a dependency on a random number crate.
fn seeded_normal(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    let mut uniform = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (uniform(), uniform());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

fn randn(seed: u64, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let n = shape.iter().product();
    Ok(Tensor::from_vec(seeded_normal(seed, n), shape, device)?.to_dtype(dtype)?)
}

/// One warm-up call (its time kept apart as `first_s`), then `repeat` timed calls.
fn timed(repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<serde_json::Value> {
    let start = Instant::now();
    f()?;
    let first = start.elapsed().as_secs_f64();
    let (mut times, mut cpu_times) = (Vec::new(), Vec::new());
    for _ in 0..repeat.max(1) {
        let (start, cpu) = (Instant::now(), process_cpu_seconds());
        f()?;
        times.push(start.elapsed().as_secs_f64());
        cpu_times.push(process_cpu_seconds() - cpu);
    }
    times.sort_by(f64::total_cmp);
    cpu_times.sort_by(f64::total_cmp);
    let n = times.len();
    Ok(serde_json::json!({
        "first_s": first,
        "min_s": times[0],
        "median_s": times[n / 2],
        "max_s": times[n - 1],
        "repeats": n,
        "times_s": times,
        "cpu_times_s": cpu_times,
    }))
}

/// Reads a tensor back to the host, as the other sides do with their outputs.
fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut dir, mut size, mut repeat, mut dtype_name) =
        (None, 256usize, 2usize, "f32".to_string());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .with_context(|| format!("{a} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--size" => size = value()?.parse().context("--size takes a number")?,
            "--repeat" => repeat = value()?.parse().context("--repeat takes a number")?,
            "--dtype" => dtype_name = value()?.clone(),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            _ if dir.is_none() && !a.starts_with("--") => dir = Some(a.clone()),
            _ => bail!("unknown argument {a}\n{USAGE}"),
        }
    }
    let dir = dir.context(USAGE)?;
    let dtype = match dtype_name.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => bail!("--dtype {other}: candle-bench takes f32 or bf16"),
    };
    if size % 8 != 0 {
        bail!("--size {size} is not a multiple of 8");
    }

    let device = Device::Cpu;
    let config = StableDiffusionConfig::v1_5(None, Some(size), Some(size));
    let start = Instant::now();
    let unet_file = Path::new(&dir).join("unet/diffusion_pytorch_model.safetensors");
    let vae_file = Path::new(&dir).join("vae/diffusion_pytorch_model.safetensors");
    let unet = config
        .build_unet(&unet_file, &device, 4, false, dtype)
        .with_context(|| format!("loading the UNet from {}", unet_file.display()))?;
    let vae = config
        .build_vae(&vae_file, &device, dtype)
        .with_context(|| format!("loading the VAE from {}", vae_file.display()))?;
    let load = start.elapsed().as_secs_f64();

    let mut report = serde_json::json!({
        "impl": "candle",
        "dtype": dtype_name,
        "kernels": match dtype {
            DType::BF16 => "gemm crate (candle 0.11.1 default features: no x86-v4/AVX-512 kernels); bf16 matmuls widened to f32, bf16 conv2d unsupported",
            _ => "gemm crate f32 (candle 0.11.1 default features: no x86-v4/AVX-512 kernels)",
        },
        "threads": candle_core::utils::get_num_threads(),
        "size": size,
        "load_s": load,
        "peak_rss_after_load_bytes": peak_rss_bytes(),
    });

    let lat = size / 8;
    let sample = randn(0, &[2, 4, lat, lat], dtype, &device)?;
    let context = randn(1, &[2, 77, 768], dtype, &device)?;
    report["unet_step"] = timed(repeat, || {
        host(&unet.forward(&sample, 501.0, &context)?)?;
        Ok(())
    })?;
    let latents = randn(2, &[1, 4, lat, lat], dtype, &device)?;
    report["vae_decode"] = timed(repeat, || {
        host(&vae.decode(&(&latents / 0.18215)?)?)?;
        Ok(())
    })?;
    report["peak_rss_bytes"] = peak_rss_bytes().into();
    println!("{report}");
    Ok(())
}
