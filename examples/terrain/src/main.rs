//! `terrain`: heightmaps from the pretrained terrain consistency model.
//!
//! ```text
//! tools/fetch-terrain.sh
//! cargo run --release -p oxidiff-terrain -- --seed 7 --difficulty 60 --steps 2 -o terrain
//! ```
//!
//! writes `terrain.png` (16-bit grayscale heights, 65535 = the package's height range) and
//! `terrain-shaded.png` (a hillshade preview); `--count N` writes `terrain-0.png`, ...
//! `--device xla:cpu` runs on XLA's CPU plugin, eagerly or with `--compile` (one XLA program
//! per network call).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use clap::Parser;
use oxidiff::schedulers::TorchCpuGenerator;

#[derive(Parser)]
#[command(about = "Terrain heightmaps from a pretrained consistency model (ONNX, via burn-onnx)")]
struct Args {
    /// Seed of the torch-compatible generator (initial and step noise).
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Difficulty on the package's scale, 1 (flat) to 100 (rough).
    #[arg(long, default_value_t = 60)]
    difficulty: u32,
    /// Consistency sampling steps (the model was distilled for 1; 2 adds one noise-and-denoise).
    #[arg(long, default_value_t = 1)]
    steps: usize,
    /// Explicit discretisation points instead of --steps, decreasing, e.g. `3,0` (two steps,
    /// re-noising to sigma 51.9; see `scheduler_at`).
    #[arg(long, value_delimiter = ',')]
    timesteps: Option<Vec<usize>>,
    /// How many maps to generate (one batch).
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// `cpu` (burn-flex) or a PJRT device such as `xla:cpu`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// On a PJRT device: trace each network call into one compiled XLA program.
    #[arg(long)]
    compile: bool,
    /// Output path prefix: `<out>.png` and `<out>-shaded.png`.
    #[arg(short, long, default_value = "terrain")]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !oxidiff_terrain::AVAILABLE {
        bail!(
            "this build of oxidiff-terrain has no model: the ONNX file was not found when it \
             was built. Run tools/fetch-terrain.sh (or set OXIDIFF_TERRAIN_ONNX) and build again."
        );
    }
    if args.count == 0 {
        bail!("--count must be at least 1");
    }
    oxidiff_terrain::with_large_stack(|| run(&args))
        .map_err(|e| anyhow::anyhow!("starting the model thread (256 MiB stack): {e}"))?
}

#[cfg(not(terrain_model))]
fn run(_: &Args) -> anyhow::Result<()> {
    unreachable!("AVAILABLE is false without the model")
}

#[cfg(terrain_model)]
fn run(args: &Args) -> anyhow::Result<()> {
    use anyhow::Context;
    use oxidiff::backend::CompiledFn;
    use oxidiff::{Cpu, Oxi, OxiDevice};
    use oxidiff_terrain::{load, WEIGHTS};

    let weights = std::path::Path::new(WEIGHTS);
    if args.device == "cpu" {
        if args.compile {
            bail!("--compile needs a PJRT device (e.g. --device xla:cpu)");
        }
        let device = Default::default();
        let net = load::<Cpu>(weights, &device)?;
        let mut call = |x, t, d| Ok(net.forward(x, t, d));
        return generate::<Cpu>(args, &mut call, &device);
    }
    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    let net = load::<Oxi>(weights, &OxiDevice::Cpu)?.to_device(&device);
    if args.compile {
        let step = CompiledFn::new("terrain_unet", |(x, t, d)| net.forward(x, t, d));
        let mut call = |x, t, d| {
            step.call((x, t, d))
                .map_err(|e| oxidiff_terrain::TerrainError::Read(e.to_string()))
        };
        generate::<Oxi>(args, &mut call, &device)
    } else {
        let mut call = |x, t, d| Ok(net.forward(x, t, d));
        generate::<Oxi>(args, &mut call, &device)
    }
}

#[cfg(terrain_model)]
use burn::module::Module;

type Network<'a, B> = dyn FnMut(Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) -> oxidiff_terrain::Result<Tensor<B, 4>>
    + 'a;

#[allow(dead_code)]
fn generate<B: Backend>(
    args: &Args,
    network: &mut Network<'_, B>,
    device: &B::Device,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut noise = TorchCpuGenerator::new(args.seed);
    let sched = match &args.timesteps {
        Some(points) => oxidiff_terrain::scheduler_at(points)?,
        None => oxidiff_terrain::scheduler::<B>(args.steps)?,
    };
    let steps = oxidiff::schedulers::Scheduler::<B>::timesteps(&sched).len();
    let samples = oxidiff_terrain::sample::<B>(
        network,
        sched,
        args.difficulty,
        args.count,
        &mut noise,
        device,
    )?;
    let Some(last) = samples.last().cloned() else {
        bail!("the schedule has no step");
    };
    let values = last
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading the sample back: {e:?}"))?;
    let elapsed = start.elapsed();
    let size = oxidiff_terrain::SIZE;
    for (i, map) in values.chunks(size * size).enumerate() {
        let stem = if args.count == 1 {
            args.out.clone()
        } else {
            PathBuf::from(format!("{}-{i}", args.out.display()))
        };
        let heights = oxidiff_terrain::heights(map);
        let gray = stem.with_extension("png");
        let shaded = PathBuf::from(format!("{}-shaded.png", stem.display()));
        oxidiff_terrain::save_gray16_png(&gray, &heights, size, size)?;
        let rgb = oxidiff_terrain::hillshade_rgb(&heights, size, size, 0.1);
        oxidiff_terrain::save_rgb_png(&shaded, rgb, size, size)?;
        let max = heights.iter().copied().fold(0f32, f32::max);
        println!(
            "{} and {} (heights 0 to {max:.2})",
            gray.display(),
            shaded.display()
        );
    }
    println!(
        "{} map(s), {} step(s), difficulty {}, seed {} on {}{}: {elapsed:.2?}",
        args.count,
        steps,
        args.difficulty,
        args.seed,
        args.device,
        if args.compile { " (compiled)" } else { "" }
    );
    Ok(())
}
