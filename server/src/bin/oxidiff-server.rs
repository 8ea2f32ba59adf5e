//! `oxidiff-server`: loads one pipeline, compiles and warms it where asked, and serves it over
//! HTTP until Ctrl-C (which finishes the queued requests; a second Ctrl-C exits at once).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use oxidiff::cli::Precision;
use oxidiff::execution::Execution;
use oxidiff::OxiDevice;
use oxidiff_server::{Limits, ServerConfig, WorkerConfig};

/// Serve a diffusers-format text-to-image model over HTTP: OpenAI's
/// `POST /v1/images/generations`, A1111's `POST /sdapi/v1/txt2img`, a web page at `/`,
/// `/healthz` and Prometheus `/metrics`. Concurrent requests of the same size, steps, sampler
/// and guidance run together, up to --max-batch images per denoiser call; each image equals
/// the one `txt2img` makes with the same parameters and seed. Nothing is written to disk.
#[derive(Debug, Parser)]
#[command(name = "oxidiff-server", version)]
struct Args {
    /// A diffusers folder, a Hub id in the local Hugging Face cache, or a single
    /// .safetensors checkpoint.
    #[arg(long)]
    model: String,
    /// Where to run: cpu, xla:cpu[:N], tpu[:N], cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compiled mode (a PJRT --device): each batch size is compiled and run once at start.
    #[arg(long)]
    compile: bool,
    /// `text-encoders`: on a PJRT device, free the text encoders' device memory after each
    /// batch's prompts are encoded and upload them again for the next (txt2img's --offload).
    #[arg(long, default_value = "off", value_name = "off|text-encoders")]
    offload: oxidiff::pipelines::Offload,
    /// Tensor parallelism with --compile.
    #[arg(long, default_value_t = 1, value_name = "N")]
    tp: usize,
    /// Data parallelism with --compile.
    #[arg(long, default_value_t = 1, value_name = "N")]
    dp: usize,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    dtype: Precision,
    /// Weight file variant of a diffusers folder (fp16).
    #[arg(long)]
    variant: Option<String>,
    /// The sampler of requests that name none (an A1111 name or a diffusers class).
    #[arg(long)]
    scheduler: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// 0 picks a free port (printed at start).
    #[arg(long, default_value_t = 7860)]
    port: u16,
    /// Most images per denoiser call.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    max_batch: u64,
    /// Most requests waiting; more get 429.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_queue: u64,
    /// Most images one request may ask for.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1000))]
    max_images: u64,
    /// Most pixels per image.
    #[arg(long, default_value_t = oxidiff::cli::usage::DEFAULT_MAX_PIXELS)]
    max_pixels: u64,
    /// Most denoising steps per request.
    #[arg(long, default_value_t = 150, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    max_steps: u64,
    /// Most bytes of a request body.
    #[arg(long, default_value_t = 64 * 1024)]
    max_body_bytes: usize,
    /// Seconds a client has to send its request body (then 408).
    #[arg(long, default_value_t = 10.0)]
    read_timeout: f64,
    /// Milliseconds the worker waits for more requests of a shape before running a batch that
    /// is not full.
    #[arg(long, default_value_t = 20)]
    batch_window_ms: u64,
    /// A file holding the API key clients must send as `Authorization: Bearer <key>`.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
}

fn main() -> Result<()> {
    oxidiff::tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "oxidiff_server=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = config(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    eprintln!("oxidiff-server: loading {}", args.model);
    runtime.block_on(async {
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("oxidiff-server: Ctrl-C: finishing the queued requests (again to exit now)");
            tokio::spawn(async {
                let _ = tokio::signal::ctrl_c().await;
                std::process::exit(130);
            });
        };
        oxidiff_server::run(config, shutdown, |addr| {
            // On stdout, one line, so that scripts and tests can read the port.
            println!("listening on http://{addr}");
        })
        .await
    })?;
    eprintln!("oxidiff-server: stopped");
    Ok(())
}

fn config(args: &Args) -> Result<ServerConfig> {
    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    if (args.tp != 1 || args.dp != 1) && !args.compile {
        bail!("add --compile (and a PJRT --device): --tp and --dp partition the compiled step");
    }
    if args.compile && !device.is_pjrt() {
        bail!(
            "add --device xla:cpu, tpu or cuda, or drop --compile: --compile needs a PJRT device"
        );
    }
    if args.offload.text_encoders() && !device.is_pjrt() {
        bail!(
            "drop --offload, or add a PJRT --device: on the CPU the weights are the checkpoint's \
             mapped pages already, with nothing to hand back"
        );
    }
    if !(args.read_timeout.is_finite() && args.read_timeout > 0.0) {
        bail!("--read-timeout must be a positive number of seconds");
    }
    let api_key = match &args.api_key_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--api-key-file {}", path.display()))?;
            let key = text.trim().to_string();
            if key.is_empty() {
                bail!(
                    "--api-key-file {} is empty: put the key in it",
                    path.display()
                );
            }
            Some(key)
        }
        None => None,
    };
    Ok(ServerConfig {
        worker: WorkerConfig {
            model: args.model.clone(),
            warm_up: device.is_pjrt(),
            device,
            execution: Execution::from_flags(args.compile, args.dp, args.tp),
            dtype: args.dtype,
            variant: args.variant.clone(),
            scheduler: args.scheduler.clone(),
            offload: args.offload,
        },
        limits: Limits {
            max_batch: args.max_batch as usize,
            max_queue: args.max_queue as usize,
            max_images_per_request: args.max_images as usize,
            max_pixels: args.max_pixels,
            max_steps: args.max_steps as usize,
            max_body_bytes: args.max_body_bytes,
            read_timeout: Duration::from_secs_f64(args.read_timeout),
            batch_window: Duration::from_millis(args.batch_window_ms),
        },
        addr: SocketAddr::new(args.host, args.port),
        api_key,
    })
}
