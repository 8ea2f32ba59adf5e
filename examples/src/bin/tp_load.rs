//! Loading a UNet for tensor parallelism on XLA's CPU plugin, measured: the UNet of DIR (a
//! diffusers pipeline folder) loaded on `xla:cpu:0` with its weights staged on the host
//! (`stage_weights`, as `txt2img --tp` loads) or, with `--no-stage`, uploaded whole to the
//! first device, then split over `--tp` devices (`enable_parallelism`). Prints one JSON line:
//! the UNet's size on disk, the bytes each device holds, what device 0 received, and the peaks
//! of the process's anonymous and file-backed memory (sampled every 2 ms) during load and
//! placement. On this plugin device buffers are anonymous host memory, so `peak_anon_bytes`
//! minus the final device bytes is what the host held beyond the devices at the peak; the
//! file-backed part is the mapped checkpoint.
//!
//! `tp_load DIR [--tp 2] [--no-stage]`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use oxidiff::backend::eager::XLA_CPU_DEVICES_ENV;
use oxidiff::backend::pjrt_client;
use oxidiff::models::UNet2DConditionModel;
use oxidiff::pipelines::parallel::{enable_parallelism, stage_weights, TensorParallelConfig};
use oxidiff::{Oxi, OxiDevice};
use oxidiff_examples::arg;

/// `RssAnon` and `RssFile` of this process, in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("RssAnon:"), field("RssFile:"))
}

fn main() -> Result<()> {
    let dir = std::env::args()
        .nth(1)
        .filter(|a| !a.starts_with("--"))
        .context("usage: tp_load DIR [--tp 2] [--no-stage]")?;
    let tp: usize = arg("--tp").map_or(Ok(2), |t| t.parse())?;
    let staged = !std::env::args().any(|a| a == "--no-stage");
    // The plugin reads its device count when the first client is made.
    std::env::set_var(XLA_CPU_DEVICES_ENV, tp.to_string());
    let unet_dir = std::path::Path::new(&dir).join("unet");
    let stored: u64 = std::fs::read_dir(&unet_dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let device: OxiDevice = "xla:cpu:0".parse()?;
    let client = pjrt_client(&device).context("xla:cpu has no PJRT client")?;
    let (base_anon, base_file) = rss();

    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = (0u64, 0u64, 0u64);
            while !done.load(Ordering::Relaxed) {
                let (anon, file) = rss();
                peak = (peak.0.max(anon), peak.1.max(file), peak.2.max(anon + file));
                std::thread::sleep(Duration::from_millis(2));
            }
            peak
        })
    };
    let start = Instant::now();
    let load = || UNet2DConditionModel::<Oxi>::from_dir(&unet_dir, None, &device);
    let mut unet = if staged {
        stage_weights(&device, load)
    } else {
        load()
    }
    .with_context(|| format!("loading {}", unet_dir.display()))?;
    let loaded = start.elapsed();
    let placement = enable_parallelism(&mut unet, &device, TensorParallelConfig::new(tp).into())?;
    let placed = start.elapsed();
    done.store(true, Ordering::Relaxed);
    let (peak_anon, peak_file, peak_total) = sampler.join().expect("sampler");
    let per_device = placement.weight_bytes();
    let device0 = client.stats();
    // Device 0 also holds every weight that is not split (its eager buffers): all it received
    // when staged; without staging it first received the split weights too.
    let split: usize = per_device.iter().map(|b| b.sharded).sum();
    let unsplit = match staged {
        true => device0.uploaded_bytes,
        false => device0.uploaded_bytes.saturating_sub(split as u64),
    };
    println!(
        "{}",
        serde_json::json!({
            "staged": staged,
            "tp": tp,
            "unet_stored_bytes": stored,
            "split_bytes": split,
            "shard_bytes_per_device": per_device.iter().map(|b| b.sharded).collect::<Vec<_>>(),
            "device0_uploaded_bytes": device0.uploaded_bytes,
            "device_bytes_total": split as u64 + unsplit,
            "peak_anon_bytes": peak_anon.saturating_sub(base_anon),
            "peak_file_bytes": peak_file.saturating_sub(base_file),
            "peak_rss_bytes": peak_total.saturating_sub(base_anon + base_file),
            "load_seconds": loaded.as_secs_f64(),
            "place_seconds": (placed - loaded).as_secs_f64(),
        })
    );
    Ok(())
}
