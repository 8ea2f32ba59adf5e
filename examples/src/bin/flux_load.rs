//! The bf16 load benchmark of a large transformer: loads a Flux transformer folder (diffusers
//! format; `tools/bench/make_flux_bf16.py` makes one with random weights) with its weights held
//! in `--dtype` (default bf16), runs one forward pass, and prints one JSON line: the weights'
//! size on disk, the load time, and the peak RSS (`VmHWM`) after loading and after the forward
//! pass, so the memory a bf16 model takes can be set against its size. With `--gguf FILE` the
//! weights come from that GGUF file instead (`tools/bench/make_flux_gguf.py` converts DIR's),
//! with DIR's config: quantized weights stay in their blocks.
//!
//! `flux_load DIR [--gguf FILE] [--dtype bf16|f16|f32] [--tokens 256] [--text-tokens 32]`
//! (1 thread: `RAYON_NUM_THREADS=1 taskset -c 0`)

use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::{Distribution, FloatDType, Tensor};
use oxidiff::models::transformer_flux::{FluxTransformer2DConfig, FluxTransformer2DModel};
use oxidiff::Cpu;
use oxidiff_examples::{arg, peak_rss_bytes};

fn main() -> Result<()> {
    oxidiff::tune_allocator();
    let dir = std::env::args()
        .nth(1)
        .filter(|a| !a.starts_with("--"))
        .context("usage: flux_load DIR [--dtype bf16|f16|f32] [--tokens N] [--text-tokens N]")?;
    let dtype = match arg("--dtype").as_deref().unwrap_or("bf16") {
        "bf16" => FloatDType::BF16,
        "f16" => FloatDType::F16,
        "f32" => FloatDType::F32,
        other => bail!("--dtype {other}: use bf16, f16 or f32"),
    };
    let tokens: usize = arg("--tokens").map_or(Ok(256), |t| t.parse())?;
    let text_tokens: usize = arg("--text-tokens").map_or(Ok(32), |t| t.parse())?;
    let dir = std::path::Path::new(&dir);
    let gguf = arg("--gguf").map(std::path::PathBuf::from);
    let weight_bytes: u64 = match &gguf {
        Some(file) => std::fs::metadata(file)?.len(),
        None => std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .sum(),
    };
    let device = Default::default();
    let start = Instant::now();
    let model = match &gguf {
        Some(file) => FluxTransformer2DModel::<Cpu>::from_gguf_in(file, dir, dtype, &device),
        None => FluxTransformer2DModel::<Cpu>::from_dir_in(dir, None, dtype, &device),
    }
    .with_context(|| format!("loading {}", dir.display()))?;
    let load_s = start.elapsed().as_secs_f64();
    let rss_after_load = peak_rss_bytes();

    let cfg = FluxTransformer2DConfig::from_file(&dir.join("config.json"))?;
    let random =
        |dims: [usize; 3]| Tensor::<Cpu, 3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
    let side = (tokens as f64).sqrt() as usize;
    let img_ids: Vec<Vec<f32>> = (0..side * side)
        .map(|i| vec![0.0, (i / side) as f32, (i % side) as f32])
        .collect();
    let txt_ids = vec![vec![0.0; 3]; text_tokens];
    let rope = model.rotary_embedding(&txt_ids, &img_ids, &device);
    let start = Instant::now();
    let out = model.forward(
        random([1, side * side, cfg.in_channels]),
        random([1, text_tokens, cfg.joint_attention_dim]),
        Tensor::random(
            [1, cfg.pooled_projection_dim],
            Distribution::Normal(0.0, 1.0),
            &device,
        ),
        Tensor::from_floats([500.0], &device),
        model
            .guidance_embeds()
            .then(|| Tensor::from_floats([3.5], &device)),
        &rope,
    )?;
    let finite = out
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()?
        .iter()
        .all(|v| v.is_finite());
    let forward_s = start.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "dir": dir.display().to_string(), "dtype": format!("{dtype:?}").to_lowercase(),
            "gguf": gguf.as_ref().map(|g| g.display().to_string()),
            "weight_bytes": weight_bytes, "load_s": load_s, "forward_s": forward_s,
            "output_finite": finite,
            "peak_rss_after_load_bytes": rss_after_load,
            "peak_rss_bytes": peak_rss_bytes(),
        })
    );
    Ok(())
}
