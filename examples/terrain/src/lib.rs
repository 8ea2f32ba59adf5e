//! A real pretrained diffusion model, offline: the terrain consistency model of the PyPI
//! package `adaptive-terrain-diffusion` 0.4.2 (MIT), imported from its ONNX file by
//! burn-onnx at build time (see `build.rs`) and sampled with oxidiff's
//! `CMStochasticIterativeScheduler`.
//!
//! The network maps a 128x128 single-channel sample (heights in the package's model space,
//! `[-1, 1]`) at noise level sigma, conditioned on a difficulty label, to its part of the
//! consistency function; the scheduler adds the `c_in`/`c_skip`/`c_out` scalings, exactly as
//! the exported graph did. [`heights`] maps samples back to heights as the package does.
//!
//! Without the ONNX file at build time the crate builds without [`model`] ([`AVAILABLE`] is
//! false); `tools/fetch-terrain.sh` fetches it.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oxidiff::schedulers::{
    CmStochasticIterativeScheduler, NoiseSource, Scheduler, SchedulerConfig, SchedulerError,
};

mod image;
pub use image::{hillshade_rgb, save_gray16_png, save_rgb_png};

/// The burn-onnx module generated from the cut graph: `Model<B>::forward(sample, timestep,
/// difficulty)` with `sample` `[batch, 1, 128, 128]` (already scaled by `c_in`), `timestep`
/// `[batch]` (`250 ln sigma`) and `difficulty` `[batch]` (the label in `[0, 1]`).
#[cfg(terrain_model)]
#[allow(clippy::all, unused)]
pub mod model {
    include!(concat!(env!("OUT_DIR"), "/model/terrain_unet.rs"));
}

/// Whether this build has the model (the ONNX file was there when it was built).
pub const AVAILABLE: bool = cfg!(terrain_model);

/// The weights burn-onnx wrote next to the generated code.
#[cfg(terrain_model)]
pub const WEIGHTS: &str = concat!(env!("OUT_DIR"), "/model/terrain_unet.bpk");

/// The model's native size (it is fully convolutional but was trained at 128x128).
pub const SIZE: usize = 128;
/// The package's height range, in its units: model space `[-1, 1]` maps to `[0, HEIGHT_RANGE]`.
pub const HEIGHT_RANGE: f32 = 22.168_64;
/// The package's `asinh` compression scale of heights.
const ASINH_SCALE: f32 = 0.1;

/// The package's sampler settings, as a diffusers scheduler config: EDM's sigma range and
/// `sigma_data`, Karras' `rho`, and diffusers' default 40 discretisation points.
pub const SCHEDULER_CONFIG: &str = r#"{
  "_class_name": "CMStochasticIterativeScheduler",
  "num_train_timesteps": 40,
  "sigma_min": 0.002,
  "sigma_max": 80.0,
  "sigma_data": 0.5,
  "s_noise": 1.0,
  "rho": 7.0,
  "clip_denoised": true
}"#;

/// Runs `f` on a thread with a 256 MiB stack. The generated module's `new` and `forward`
/// are single functions over ~2000 ONNX nodes; unoptimised (debug and test builds) their
/// frames overflow the default 2 MiB (8 MiB main thread) stack. Fails only when the system
/// cannot make the thread (out of memory or threads).
pub fn with_large_stack<T: Send>(f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn_scoped(scope, f)?;
        Ok(thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    })
}

/// Errors of the terrain example's library.
#[derive(Debug, thiserror::Error)]
pub enum TerrainError {
    #[error("difficulty {0} is outside 1..=100 (the package's scale)")]
    Difficulty(u32),
    #[error("steps = {0}: the consistency model samples in 1 to 40 steps")]
    Steps(usize),
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error("{path}: {message}")]
    Weights { path: String, message: String },
    #[error("{path}: {message}")]
    Image { path: String, message: String },
    #[error("reading a tensor back: {0}")]
    Read(String),
}

pub type Result<T, E = TerrainError> = std::result::Result<T, E>;

/// The model's difficulty input for the package's 1..=100 scale: `(d - 1) / 99`.
pub fn difficulty_label(difficulty: u32) -> Result<f32> {
    if !(1..=100).contains(&difficulty) {
        return Err(TerrainError::Difficulty(difficulty));
    }
    Ok((difficulty - 1) as f32 / 99.0)
}

/// The scheduler with the package's settings, set to `steps` steps.
pub fn scheduler<B: Backend>(steps: usize) -> Result<CmStochasticIterativeScheduler> {
    if steps == 0 || steps > 40 {
        return Err(TerrainError::Steps(steps));
    }
    let cfg = SchedulerConfig::from_json_str(SCHEDULER_CONFIG, "terrain scheduler config")?;
    let mut s = CmStochasticIterativeScheduler::new(&cfg)?;
    Scheduler::<B>::set_timesteps(&mut s, steps)?;
    Ok(s)
}

/// The scheduler with the package's settings on explicit discretisation points of the 40
/// (decreasing; `[0]` is one step at sigma_max). This model was distilled for one step from
/// sigma_max ("endpoint distillation") and denoises well only at high sigmas, so a useful
/// second point is small: `[3, 0]` re-noises to sigma 51.9, where diffusers' default two
/// steps (`[20, 0]`) re-noise to sigma 2.24 and leave speckle.
pub fn scheduler_at(points: &[usize]) -> Result<CmStochasticIterativeScheduler> {
    let cfg = SchedulerConfig::from_json_str(SCHEDULER_CONFIG, "terrain scheduler config")?;
    let mut s = CmStochasticIterativeScheduler::new(&cfg)?;
    s.set_custom_timesteps(points)?;
    Ok(s)
}

/// Loads the generated module's weights from `path` (normally [`WEIGHTS`]).
#[cfg(terrain_model)]
pub fn load<B: Backend>(path: &std::path::Path, device: &B::Device) -> Result<model::Model<B>> {
    use burn_store::{BurnpackStore, ModuleSnapshot};
    let mut net = model::Model::<B>::new(device);
    let mut store = BurnpackStore::from_file(path);
    let applied = net
        .load_from(&mut store)
        .map_err(|e| TerrainError::Weights {
            path: path.display().to_string(),
            message: format!("{e}; rebuild oxidiff-terrain to regenerate it"),
        })?;
    if !applied.missing.is_empty() {
        return Err(TerrainError::Weights {
            path: path.display().to_string(),
            message: format!("weights missing for {:?}", applied.missing),
        });
    }
    Ok(net)
}

/// One sampling loop over the schedule of `sched` (see [`scheduler`], [`scheduler_at`]),
/// diffusers' `ConsistencyModelPipeline`: initial noise `randn * sigma_max` and the step
/// noise from one `noise` source; `network(x, t, label)` is the model (eager, or a compiled
/// call). Returns the sample after each step (model space; the last is the result).
pub fn sample<B: Backend>(
    network: &mut dyn FnMut(Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) -> Result<Tensor<B, 4>>,
    mut sched: CmStochasticIterativeScheduler,
    difficulty: u32,
    batch: usize,
    noise: &mut dyn NoiseSource<B>,
    device: &B::Device,
) -> Result<Vec<Tensor<B, 4>>> {
    let label = difficulty_label(difficulty)?;
    let labels = Tensor::<B, 1>::from_data(TensorData::new(vec![label; batch], [batch]), device);
    let mut x = noise
        .randn([batch, 1, SIZE, SIZE], device)?
        .mul_scalar(Scheduler::<B>::init_noise_sigma(&sched));
    let mut out = Vec::new();
    for t in Scheduler::<B>::timesteps(&sched).to_vec() {
        let scaled = sched.scale_model_input(x.clone(), t)?;
        let timestep =
            Tensor::<B, 1>::from_data(TensorData::new(vec![t as f32; batch], [batch]), device);
        let model_output = network(scaled, timestep, labels.clone())?;
        x = sched.step(model_output, t, x, noise)?;
        out.push(x.clone());
    }
    Ok(out)
}

/// The package's `_from_model_space` with `zero_floor`: `v` in `[-1, 1]` to heights in
/// `[0, HEIGHT_RANGE]` (`asinh`-expanded), each map shifted so that its lowest point is 0.
pub fn heights(values: &[f32]) -> Vec<f32> {
    let normalizer = (HEIGHT_RANGE / ASINH_SCALE).asinh();
    let h: Vec<f32> = values
        .iter()
        .map(|&v| {
            let unit = ((v + 1.0) * 0.5).clamp(0.0, 1.0);
            (ASINH_SCALE * (unit * normalizer).sinh()).clamp(0.0, HEIGHT_RANGE)
        })
        .collect();
    let floor = h.iter().copied().fold(f32::INFINITY, f32::min);
    h.into_iter().map(|v| v - floor).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_flex::Flex;

    #[test]
    fn difficulty_labels_span_zero_to_one_and_reject_the_rest() {
        assert_eq!(difficulty_label(1).unwrap(), 0.0);
        assert_eq!(difficulty_label(100).unwrap(), 1.0);
        assert_eq!(difficulty_label(60).unwrap(), 59.0 / 99.0);
        for bad in [0, 101] {
            let err = difficulty_label(bad).unwrap_err();
            assert!(err.to_string().contains("1..=100"), "{err}");
        }
    }

    #[test]
    fn heights_follow_the_package_mapping_with_a_zero_floor() {
        // -1 is height 0, 1 is the whole range, 0 is asinh's midpoint; outside [-1, 1] clips.
        let h = heights(&[-1.0, 0.0, 1.0, 2.0, -3.0]);
        let mid = ASINH_SCALE * ((HEIGHT_RANGE / ASINH_SCALE).asinh() * 0.5).sinh();
        assert_eq!(h[0], 0.0);
        assert!((h[1] - mid).abs() < 1e-5, "{}", h[1]);
        assert!((h[2] - HEIGHT_RANGE).abs() < 1e-4, "{}", h[2]);
        assert_eq!(h[3], h[2]);
        assert_eq!(h[4], 0.0);
        // Shifted so that the lowest point is 0.
        let h = heights(&[0.5, 0.0]);
        assert_eq!(h[1], 0.0);
        assert!(h[0] > 0.0);
    }

    #[test]
    fn schedules_land_where_the_docs_say() {
        let two = scheduler::<Flex>(2).unwrap();
        let sigmas = Scheduler::<Flex>::sigmas(&two).unwrap();
        assert_eq!(sigmas[0], 80.0);
        assert!((sigmas[1] - 2.2404).abs() < 1e-4, "{sigmas:?}");
        let custom = scheduler_at(&[3, 0]).unwrap();
        let sigmas = Scheduler::<Flex>::sigmas(&custom).unwrap();
        assert!((sigmas[1] - 51.9).abs() < 0.05, "{sigmas:?}");
        assert!(matches!(scheduler::<Flex>(0), Err(TerrainError::Steps(0))));
        assert!(scheduler_at(&[40, 0]).is_err());
    }

    #[test]
    fn hillshade_lights_north_west_slopes() {
        // A ramp rising to the east faces west, towards the light: brighter than one rising
        // to the west.
        let n = 8;
        let east: Vec<f32> = (0..n * n).map(|i| (i % n) as f32 * 0.05).collect();
        let west: Vec<f32> = (0..n * n).map(|i| (n - 1 - i % n) as f32 * 0.05).collect();
        let (e, w) = (
            hillshade_rgb(&east, n, n, 0.1),
            hillshade_rgb(&west, n, n, 0.1),
        );
        let at = |rgb: &[u8]| rgb[(3 * n + 3) * 3] as i32;
        assert!(
            at(&e) > at(&w),
            "east-rising {} vs west-rising {}",
            at(&e),
            at(&w)
        );
        assert_eq!(e.len(), n * n * 3);
    }
}
