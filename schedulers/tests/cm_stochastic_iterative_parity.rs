//! Replays diffusers' `CMStochasticIterativeScheduler` on the golden data of
//! `tools/golden/make_cm_scheduler.py` (`tests/fixtures/golden/cm_stochastic_iterative.*`)
//! on burn-flex, f32.
//!
//! Tolerances: sigmas are diffusers' f32 values exactly (compared as f32); timesteps (`250 ln sigma` in f64
//! from f64 sigmas) within 1e-12 relative (libm's and numpy's `log` may differ by an ulp).
//! Samples within 1e-5 of the step's largest operand: diffusers evaluates `c_out * F +
//! c_skip * x` with f32 0-d coefficients, we fold them in f64, so they differ by f32 ulps.

use std::path::PathBuf;

use burn::tensor::{Tensor, TensorData};
use burn_flex::{Flex, FlexDevice};
use oxidiff_schedulers::{
    scheduler_from_config, CmStochasticIterativeScheduler, NoNoise, RecordedNoise, Scheduler,
    SchedulerConfig, SchedulerError, SchedulerKind, TorchCpuGenerator,
};
use safetensors::SafeTensors;
use serde_json::Value;

type B = Flex;

const SAMPLE_RTOL: f64 = 1e-5;

struct Golden {
    meta: Value,
    bytes: Vec<u8>,
}

impl Golden {
    fn load() -> Self {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden");
        let meta_path = dir.join("cm_stochastic_iterative.json");
        let text = std::fs::read_to_string(&meta_path)
            .unwrap_or_else(|e| panic!("{}: {e}", meta_path.display()));
        let bytes =
            std::fs::read(dir.join("cm_stochastic_iterative.safetensors")).expect("golden tensors");
        Golden {
            meta: serde_json::from_str(&text).expect("golden json"),
            bytes,
        }
    }

    fn get(&self, name: &str) -> Option<(Vec<usize>, Vec<f32>)> {
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors header");
        let view = st.tensor(name).ok()?;
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Some((view.shape().to_vec(), values))
    }

    fn tensor4(&self, name: &str) -> Tensor<B, 4> {
        let (shape, values) = self.get(name).unwrap_or_else(|| panic!("{name} missing"));
        let shape: [usize; 4] = shape.try_into().unwrap();
        Tensor::from_data(TensorData::new(values, shape), &FlexDevice)
    }

    /// A stacked `[n, b, c, h, w]` tensor split into its `n` 4-d tensors.
    fn stack(&self, name: &str) -> Vec<Tensor<B, 4>> {
        let (shape, values) = self.get(name).unwrap_or_else(|| panic!("{name} missing"));
        let item: [usize; 4] = shape[1..].try_into().unwrap();
        let per = item.iter().product::<usize>();
        values
            .chunks(per)
            .map(|c| Tensor::from_data(TensorData::new(c.to_vec(), item), &FlexDevice))
            .collect()
    }
}

fn values(t: &Tensor<B, 4>) -> Vec<f32> {
    t.clone().into_data().to_vec::<f32>().unwrap()
}

fn max_abs(t: &Tensor<B, 4>) -> f64 {
    oxidiff_test_support::max_magnitude("sample", &values(t))
}

/// max |a - b|; NaN or infinity on either side fails, naming the element.
fn max_diff(a: &Tensor<B, 4>, b: &Tensor<B, 4>) -> f64 {
    oxidiff_test_support::worst_difference("scheduler output", &values(a), &values(b)).difference
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn build(case: &Value) -> CmStochasticIterativeScheduler {
    let cfg = SchedulerConfig::from_json_str(&case["config"].to_string(), "golden config").unwrap();
    let mut s = CmStochasticIterativeScheduler::new(&cfg).unwrap();
    match case["custom_timesteps"].as_array() {
        Some(points) => {
            let points: Vec<usize> = points
                .iter()
                .map(|p| p.as_u64().unwrap() as usize)
                .collect();
            s.set_custom_timesteps(&points).unwrap();
        }
        None => Scheduler::<B>::set_timesteps(
            &mut s,
            case["num_inference_steps"].as_u64().unwrap() as usize,
        )
        .unwrap(),
    }
    s
}

/// Replays one case with the given noise source; returns the worst relative step error.
fn replay(golden: &Golden, name: &str, noise: &mut dyn oxidiff_schedulers::NoiseSource<B>) -> f64 {
    let case = &golden.meta["cases"][name];
    let mut s = build(case);
    let timesteps = Scheduler::<B>::timesteps(&s).to_vec();
    let outputs = golden.stack(&format!("{name}.model_output"));
    let scaled = golden.stack(&format!("{name}.scaled_input"));
    let prevs = golden.stack(&format!("{name}.prev_sample"));
    assert_eq!(timesteps.len(), outputs.len(), "{name}: step count");
    let mut sample = golden.tensor4(&format!("{name}.sample"));
    let mut worst = 0f64;
    for (i, &t) in timesteps.iter().enumerate() {
        let x = s.scale_model_input(sample.clone(), t).unwrap();
        let err = max_diff(&x, &scaled[i]) / max_abs(&scaled[i]);
        assert!(
            err < SAMPLE_RTOL,
            "{name} step {i}: scaled input off by {err:.2e}"
        );
        let scale = max_abs(&sample)
            .max(max_abs(&outputs[i]))
            .max(max_abs(&prevs[i]));
        // Feed diffusers' own previous sample, so errors do not compound across steps.
        let prev = s.step(outputs[i].clone(), t, sample, noise).unwrap();
        let err = max_diff(&prev, &prevs[i]) / scale;
        assert!(
            err < SAMPLE_RTOL,
            "{name} step {i}: prev_sample off by {err:.2e}"
        );
        worst = worst.max(err);
        sample = prevs[i].clone();
    }
    worst
}

#[test]
fn cm_schedule_matches_diffusers() {
    let golden = Golden::load();
    for (name, case) in golden.meta["cases"].as_object().unwrap() {
        let s = build(case);
        // Compared as f32 (their values): serde_json's f64 parsing may be off by an ulp.
        let sigmas: Vec<f32> = Scheduler::<B>::sigmas(&s)
            .unwrap()
            .iter()
            .map(|&v| v as f32)
            .collect();
        let want: Vec<f32> = f64s(&case["sigmas"]).iter().map(|&v| v as f32).collect();
        assert_eq!(sigmas, want, "{name}: sigmas");
        let want = f64s(&case["timesteps"]);
        let got = Scheduler::<B>::timesteps(&s);
        assert_eq!(got.len(), want.len(), "{name}: timesteps");
        for (a, b) in got.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-12 * b.abs(),
                "{name}: timestep {a} vs {b}"
            );
        }
        assert_eq!(
            Scheduler::<B>::init_noise_sigma(&s),
            case["init_noise_sigma"].as_f64().unwrap(),
            "{name}"
        );
    }
}

#[test]
fn cm_steps_match_diffusers_with_recorded_noise() {
    let golden = Golden::load();
    for name in golden.meta["cases"].as_object().unwrap().keys() {
        let mut noise = match golden.get(&format!("{name}.noise")) {
            Some(_) => RecordedNoise::new(golden.stack(&format!("{name}.noise"))),
            None => RecordedNoise::new(Vec::new()),
        };
        let err = replay(&golden, name, &mut noise);
        assert_eq!(
            noise.remaining(),
            0,
            "{name}: not every recorded draw was used"
        );
        println!("{name}: worst step error {err:.2e}");
    }
}

#[test]
fn cm_steps_match_diffusers_with_the_torch_generator() {
    // The same replay drawing from a re-implemented torch generator seeded like diffusers'.
    let golden = Golden::load();
    for (name, case) in golden.meta["cases"].as_object().unwrap() {
        let seed = case["noise_seed"].as_u64().unwrap();
        let mut gen = TorchCpuGenerator::new(seed);
        replay(&golden, name, &mut gen);
    }
}

#[test]
fn cm_one_step_draws_no_noise() {
    // A one-step schedule never calls the noise source (diffusers uses zeros).
    let golden = Golden::load();
    assert_eq!(
        golden.meta["cases"]["cm_imagenet64_1step"]["noise_draws"],
        0
    );
    replay(&golden, "cm_imagenet64_1step", &mut NoNoise);
}

#[test]
fn cm_add_noise_matches_diffusers() {
    let golden = Golden::load();
    for (name, case) in golden.meta["cases"].as_object().unwrap() {
        let s = build(case);
        let original = golden.tensor4(&format!("{name}.add_noise.original"));
        let noise = golden.tensor4(&format!("{name}.add_noise.noise"));
        let want = golden.tensor4(&format!("{name}.add_noise.noisy"));
        let got = s
            .add_noise(original, noise, &f64s(&case["add_noise_timesteps"]))
            .unwrap();
        let err = max_diff(&got, &want) / max_abs(&want);
        assert!(err < SAMPLE_RTOL, "{name}: add_noise off by {err:.2e}");
    }
}

#[test]
fn cm_from_config_by_class_name_and_alias() {
    let cfg = SchedulerConfig::from_json_str(
        r#"{"_class_name": "CMStochasticIterativeScheduler", "num_train_timesteps": 40}"#,
        "cm.json",
    )
    .unwrap();
    let s = scheduler_from_config::<B>(&cfg).unwrap();
    assert_eq!(s.kind(), SchedulerKind::CmStochasticIterative);
    assert_eq!(s.init_noise_sigma(), 80.0);
    assert_eq!(
        "consistency".parse::<SchedulerKind>().unwrap(),
        SchedulerKind::CmStochasticIterative
    );
}

#[test]
fn cm_bad_schedules_are_errors() {
    let cfg = SchedulerConfig::from_json_str(
        r#"{"_class_name": "CMStochasticIterativeScheduler", "num_train_timesteps": 40}"#,
        "cm.json",
    )
    .unwrap();
    let mut s = CmStochasticIterativeScheduler::new(&cfg).unwrap();
    for n in [0, 41] {
        let err = Scheduler::<B>::set_timesteps(&mut s, n).unwrap_err();
        assert!(
            matches!(err, SchedulerError::InvalidSteps { got, .. } if got == n),
            "{err}"
        );
    }
    let err = s.set_custom_timesteps(&[0, 22]).unwrap_err();
    assert!(err.to_string().contains("strictly decreasing"), "{err}");
    let err = s.set_custom_timesteps(&[40, 0]).unwrap_err();
    assert!(
        err.to_string().contains("below num_train_timesteps = 40"),
        "{err}"
    );
    let mut bad = cfg.clone();
    bad.sigma_min = Some(100.0);
    let err = CmStochasticIterativeScheduler::new(&bad).err().unwrap();
    assert!(err.to_string().contains("sigma_min < sigma_max"), "{err}");
    // step after the schedule is used up.
    Scheduler::<B>::set_timesteps(&mut s, 1).unwrap();
    let x = Tensor::<B, 4>::zeros([1, 1, 2, 2], &FlexDevice);
    let t = Scheduler::<B>::timesteps(&s)[0];
    s.step(x.clone(), t, x.clone(), &mut NoNoise).unwrap();
    let err = s.step(x.clone(), t, x, &mut NoNoise).unwrap_err();
    assert!(
        matches!(err, SchedulerError::ScheduleExhausted { .. }),
        "{err}"
    );
}
