//! Replays diffusers' schedulers on the golden data of `tools/golden/make_schedulers.py`
//! (`tests/fixtures/golden/schedulers.*`) on burn-flex, f32.
//!
//! Tolerances: timesteps are compared exactly (diffusers' integer and f32 values are
//! reproduced bit for bit), except those derived from log-sigmas (Karras, exponential,
//! continuous), where numpy's vectorised f32 `log` and ours differ by an ulp or two. Samples
//! are compared relative to the tensor's largest magnitude at 1e-5: both sides run f32 tensor
//! math, but diffusers evaluates each step as several f32 tensor operations on f32 0-d
//! coefficient tensors while we fold the coefficients in f64 and apply one multiplication
//! each, so results differ by a few f32 ulps per step (about 1e-7 relative), accumulated over
//! up to 16 steps. The error is taken relative to the largest magnitude among the step's
//! input sample and output: where a step cancels (zero-SNR Euler: a sample of magnitude
//! ~1e4 becomes ~10), diffusers' own f32 rounding is at the input's scale (we checked its
//! result against f64: off by 4.8e-5 of the output, where ours is within 1e-7 of f64).

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Tensor, TensorData};
use burn_flex::{Flex, FlexDevice};
use oxidiff_schedulers::{
    calculate_shift, scheduler_from_config, NoNoise, NoiseSource, RecordedNoise, Scheduler,
    SchedulerConfig, TimestepOptions, TorchCpuGenerator,
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
        let meta_path = dir.join("schedulers.json");
        let text = std::fs::read_to_string(&meta_path)
            .unwrap_or_else(|e| panic!("{}: {e}", meta_path.display()));
        let bytes = std::fs::read(dir.join("schedulers.safetensors")).expect("golden tensors");
        Golden {
            meta: serde_json::from_str(&text).expect("golden json"),
            bytes,
        }
    }

    /// A stored f32 tensor as (shape, values), or None if absent.
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

    fn tensor(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        self.get(name)
            .unwrap_or_else(|| panic!("golden tensor {name} missing"))
    }

    /// A stacked `[n, b, c, h, w]` tensor split into its `n` 4-d tensors.
    fn stack(&self, name: &str) -> Vec<Tensor<B, 4>> {
        let (shape, values) = self.tensor(name);
        split(&shape, &values)
    }
}

fn split(shape: &[usize], values: &[f32]) -> Vec<Tensor<B, 4>> {
    let item: [usize; 4] = shape[1..].try_into().unwrap();
    let per = item.iter().product::<usize>();
    values
        .chunks(per)
        .map(|c| Tensor::from_data(TensorData::new(c.to_vec(), item), &FlexDevice))
        .collect()
}

fn to4(shape: &[usize], values: Vec<f32>) -> Tensor<B, 4> {
    let shape: [usize; 4] = shape.try_into().unwrap();
    Tensor::from_data(TensorData::new(values, shape), &FlexDevice)
}

fn values(t: &Tensor<B, 4>) -> Vec<f32> {
    t.clone().into_data().to_vec::<f32>().unwrap()
}

fn max_abs(t: &Tensor<B, 4>) -> f64 {
    oxidiff_test_support::max_magnitude("sample", &values(t))
}

/// max |ours - reference| / max(max |reference|, floor); NaN or infinity on either side fails.
fn rel_err(ours: &Tensor<B, 4>, reference: &Tensor<B, 4>, floor: f64) -> f64 {
    let (a, b) = (values(ours), values(reference));
    oxidiff_test_support::relative_error_with_floor("scheduler output", &a, &b, floor.max(1e-30)).0
}

/// Worst errors of one replay: scaled inputs, and prev samples relative to the step's
/// operands (asserted) and to the output alone (reported).
#[derive(Default)]
struct Errors {
    scaled: f64,
    prev: f64,
    prev_vs_output: f64,
    chain: f64,
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn build(name: &str, case: &Value) -> Box<dyn Scheduler<B>> {
    let text = serde_json::to_string(&case["config"]).unwrap();
    let mut cfg = SchedulerConfig::from_json_str(&text, name).unwrap();
    if let Some(target) = case["switch_to"].as_str() {
        cfg = cfg.switched_to(target.parse().unwrap());
    }
    let mut sched = scheduler_from_config::<B>(&cfg).unwrap();
    assert_eq!(
        sched.kind().class_name(),
        case["class"].as_str().unwrap(),
        "{name}"
    );
    if let Some(eta) = case["eta"].as_f64() {
        sched.set_eta(eta);
    }
    let n = case["num_inference_steps"].as_u64().unwrap() as usize;
    let options = timestep_options(case);
    if options == TimestepOptions::default() {
        sched.set_timesteps(n).unwrap();
    } else {
        sched.set_timesteps_with(n, &options).unwrap();
    }
    sched
}

/// The `sigmas=` and `mu=` diffusers' set_timesteps got (flow matching, as Flux passes them).
fn timestep_options(case: &Value) -> TimestepOptions {
    let kwargs = &case["set_timesteps"];
    TimestepOptions {
        sigmas: kwargs.get("sigmas").map(f64s),
        mu: kwargs.get("mu").and_then(Value::as_f64),
        timesteps: kwargs.get("timesteps").map(f64s),
    }
}

/// Runs a case. Each step gets diffusers' inputs (the recorded model output, and diffusers'
/// previous sample), so every error is that step's own; a free-running chain of our own
/// samples runs alongside.
fn replay(golden: &Golden, name: &str, case: &Value, noise: &mut dyn NoiseSource<B>) -> Errors {
    let mut sched = build(name, case);
    let mut chain = build(name, case);
    let mut chain_noise = noise_for(golden, name);
    let (shape, start) = golden.tensor(&format!("{name}.sample"));
    let start = to4(&shape, start);
    let outputs = golden.stack(&format!("{name}.model_output"));
    let scaled_ref = golden.stack(&format!("{name}.scaled_input"));
    let prev_ref = golden.stack(&format!("{name}.prev_sample"));
    let timesteps = sched.timesteps().to_vec();
    assert_eq!(timesteps.len(), outputs.len(), "{name}: step count");
    let mut worst = Errors::default();
    let mut own = start.clone();
    for (i, &t) in timesteps.iter().enumerate() {
        let sample = if i == 0 {
            start.clone()
        } else {
            prev_ref[i - 1].clone()
        };
        let scaled = sched.scale_model_input(sample.clone(), t).unwrap();
        worst.scaled = worst.scaled.max(rel_err(&scaled, &scaled_ref[i], 0.0));
        let input_scale = max_abs(&sample);
        let prev = sched
            .step(outputs[i].clone(), t, sample, noise)
            .unwrap_or_else(|e| panic!("{name} step {i}: {e}"));
        let err = rel_err(&prev, &prev_ref[i], input_scale);
        assert!(
            err <= SAMPLE_RTOL,
            "{name}: prev_sample of step {i} (t = {t}) off by {err:e} relative"
        );
        worst.prev = worst.prev.max(err);
        worst.prev_vs_output = worst.prev_vs_output.max(rel_err(&prev, &prev_ref[i], 0.0));

        let own_scale = max_abs(&own);
        chain.scale_model_input(own.clone(), t).unwrap();
        own = chain
            .step(outputs[i].clone(), t, own, chain_noise.as_mut())
            .unwrap();
        worst.chain = worst.chain.max(rel_err(&own, &prev_ref[i], own_scale));
    }
    assert!(
        worst.scaled <= SAMPLE_RTOL,
        "{name}: scaled model input off by {:e} relative",
        worst.scaled
    );
    // Free-running, diffusers' own rounding carries forward: its f32 zero-SNR first step
    // is 4.8e-5 off the exact value (see the top of the file).
    assert!(
        worst.chain <= 1e-4,
        "{name}: free-running chain off by {:e}",
        worst.chain
    );
    worst
}

/// The recorded noise of a case, or `NoNoise` for deterministic ones.
fn noise_for(golden: &Golden, name: &str) -> Box<dyn NoiseSource<B>> {
    match golden.get(&format!("{name}.noise")) {
        Some((shape, v)) => Box::new(RecordedNoise::new(split(&shape, &v))),
        None => Box::new(NoNoise),
    }
}

/// serde_json's default float parsing can land an f64 ulp off the decimal written by
/// Python; diffusers' timesteps are f32 values, so one that parses within 1e-15 of an f32 is
/// that f32.
fn snap_to_f32(x: f64) -> f64 {
    let f = x as f32 as f64;
    if (f - x).abs() <= 1e-15 * x.abs() {
        f
    } else {
        x
    }
}

/// Whether the case rescales betas to zero terminal SNR.
fn zero_snr(case: &Value) -> bool {
    case["config"]["rescale_betas_zero_snr"] == Value::Bool(true)
}

/// Timesteps that come from `ln(sigma)` through numpy's f32 log.
fn log_derived_timesteps(case: &Value) -> bool {
    let c = &case["config"];
    // KDPM2's midpoint timesteps come from ln(sigma) like Karras ones: the midpoint sigma is
    // exp(lerp(ln, ln)) in torch's vectorised f32 kernels, an ulp from ours, so the midpoint
    // timesteps land within an f32 ulp or two (3e-5 to 6e-5 at t ~ 500).
    case["class"]
        .as_str()
        .is_some_and(|c| c.starts_with("KDPM2"))
        || c["use_karras_sigmas"] == Value::Bool(true)
        || c["use_exponential_sigmas"] == Value::Bool(true)
        || c["timestep_type"] == "continuous"
}

#[test]
fn schedules_match_diffusers() {
    let golden = Golden::load();
    let cases = golden.meta["cases"].as_object().unwrap();
    assert!(cases.len() >= 40);
    for (name, case) in cases {
        let sched = build(name, case);
        let ours = sched.timesteps();
        let theirs = f64s(&case["timesteps"]);
        assert_eq!(ours.len(), theirs.len(), "{name}: number of timesteps");
        if log_derived_timesteps(case) {
            // KDPM2 ancestral's midpoints use sigma_down = sqrt(s_next^2 - s_up^2), an f32
            // cancellation that multiplies an ulp of the sigmas by up to s^2 / s_next^2.
            let tol = if case["class"] == "KDPM2AncestralDiscreteScheduler" {
                1e-3
            } else {
                1e-4
            };
            let mut worst = 0f64;
            for (a, b) in ours.iter().zip(&theirs) {
                // An ulp of numpy's f32 ln(sigma) moves the interpolated timestep by ~1e-5.
                assert!((a - b).abs() <= tol, "{name}: timestep {a} vs {b}");
                worst = worst.max((a - b).abs());
            }
            println!("{name:28} timesteps within {worst:.1e}");
        } else if case["config"]["use_beta_sigmas"] == Value::Bool(true) {
            // Beta sigmas come from the inverse Beta CDF (scipy's boost there, bisection
            // here): equal in f64 to ~1e-15, which can round to the neighbouring f32.
            for (a, b) in ours.iter().zip(&theirs) {
                assert!(
                    (a - b).abs() <= 2.0 * f32::EPSILON as f64 * b.abs(),
                    "{name}: timestep {a} vs {b}"
                );
            }
        } else {
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                let b = snap_to_f32(*b);
                assert_eq!(a.to_bits(), b.to_bits(), "{name}: timestep {i}: {a} vs {b}");
            }
        }
        match (sched.sigmas(), case["sigmas"].as_array()) {
            (Some(ours), Some(_)) => {
                let theirs = f64s(&case["sigmas"]);
                assert_eq!(ours.len(), theirs.len(), "{name}: number of sigmas");
                // Zero-SNR sigmas inherit the CPU-dependent rounding of the rescaled
                // alphas (see `alphas_cumprod_match_diffusers`): up to 16 ulps.
                let ulps = if zero_snr(case) { 16.0 } else { 4.0 };
                for (a, b) in ours.iter().zip(&theirs) {
                    // f32 values; interpolation and sigma conversions are repeated in
                    // diffusers' precisions, so at most an ulp or two apart.
                    assert!(
                        (a - b).abs() <= ulps * f32::EPSILON as f64 * b.abs(),
                        "{name}: sigma {a} vs {b}"
                    );
                }
            }
            (None, None) => {}
            (ours, _) => panic!("{name}: sigmas present here: {}", ours.is_some()),
        }
        let init = case["init_noise_sigma"].as_f64().unwrap();
        assert!(
            (sched.init_noise_sigma() - init).abs() <= 4.0 * f32::EPSILON as f64 * init,
            "{name}: init_noise_sigma {} vs {init}",
            sched.init_noise_sigma()
        );
    }
}

#[test]
fn steps_match_diffusers_with_recorded_noise() {
    let golden = Golden::load();
    let mut report = BTreeMap::new();
    for (name, case) in golden.meta["cases"].as_object().unwrap() {
        let worst = match golden.get(&format!("{name}.noise")) {
            Some((shape, v)) => {
                let mut noise = RecordedNoise::new(split(&shape, &v));
                let r = replay(&golden, name, case, &mut noise);
                assert_eq!(
                    noise.remaining(),
                    0,
                    "{name}: not all recorded noise was drawn"
                );
                r
            }
            None => replay(&golden, name, case, &mut NoNoise),
        };
        report.insert(name.clone(), worst);
    }
    for (name, e) in &report {
        println!(
            "{name:28} scaled input {:.1e}  prev_sample {:.1e} (vs output alone {:.1e}, free-running {:.1e})",
            e.scaled, e.prev, e.prev_vs_output, e.chain
        );
    }
}

#[test]
fn stochastic_steps_match_diffusers_with_torch_generator() {
    // The same runs with noise drawn by our re-implementation of torch's CPU generator,
    // seeded like diffusers' run: the whole stochastic trajectory matches.
    let golden = Golden::load();
    let mut seen = 0;
    for (name, case) in golden.meta["cases"].as_object().unwrap() {
        let Some(seed) = case["noise_seed"].as_u64() else {
            continue;
        };
        let mut generator = TorchCpuGenerator::new(seed);
        let worst = replay(&golden, name, case, &mut generator);
        println!(
            "{name:28} prev_sample with TorchCpuGenerator({seed}) {:.1e}",
            worst.prev
        );
        seen += 1;
    }
    assert!(
        seen >= 10,
        "expected the DDIM eta > 0, Euler ancestral, SDE-DPM-Solver++ and DDPM cases"
    );
}

#[test]
fn torch_cpu_generator_matches_torch_randn() {
    let golden = Golden::load();
    let rng = &golden.meta["rng"];
    let check = |name: &str, ours: Vec<f32>| {
        let (_, theirs) = golden.tensor(name);
        let worst = oxidiff_test_support::worst_difference(name, &ours, &theirs);
        // Bit for bit with torch's x86-64 kernel (the golden data's); torch builds with
        // its scalar libm kernel (other CPUs) would be an ulp or two away.
        assert!(worst.difference == 0.0, "{name}: {worst}");
        println!(
            "{name:20} torch.randn reproduced within {:e}",
            worst.difference
        );
    };
    let mut g = TorchCpuGenerator::new(42);
    for (i, shape) in rng["seed42"].as_array().unwrap().iter().enumerate() {
        let n = f64s(shape).iter().product::<f64>() as usize;
        check(&format!("rng.seed42.{i}"), g.randn_vec(n));
    }
    check(
        "rng.seed0.latents",
        TorchCpuGenerator::new(0).randn_vec(4 * 64 * 64),
    );
    check(
        "rng.seed_2p40p7",
        TorchCpuGenerator::new((1 << 40) + 7).randn_vec(64),
    );
    // Through the NoiseSource interface, as a pipeline draws initial latents.
    let t: Tensor<B, 4> =
        NoiseSource::<B>::randn(&mut TorchCpuGenerator::new(0), [1, 4, 64, 64], &FlexDevice)
            .unwrap();
    check("rng.seed0.latents", values(&t));
}

#[test]
fn add_noise_matches_diffusers() {
    // A batch of two noised to the schedule's 2nd and 4th timesteps (one coefficient per item).
    let golden = Golden::load();
    for (name, recorded) in golden.meta["add_noise"].as_object().unwrap() {
        let sched = build(name, &golden.meta["cases"][name]);
        let ts = [sched.timesteps()[1], sched.timesteps()[3]];
        for (a, b) in ts.iter().zip(f64s(recorded)) {
            assert!((a - b).abs() <= 1e-4, "{name}: timestep {a} vs {b}");
        }
        let load = |what: &str| {
            let (shape, v) = golden.tensor(&format!("add_noise.{name}.{what}"));
            to4(&shape, v)
        };
        let noisy = sched
            .add_noise(load("original"), load("noise"), &ts)
            .unwrap();
        let err = rel_err(&noisy, &load("noisy"), 0.0);
        // One f32 multiply-add per element on both sides: a few ulps.
        assert!(err <= 1e-6, "{name}: add_noise off by {err:e}");
    }
}

#[test]
fn calculate_shift_matches_the_flux_pipeline() {
    // The golden cases' mu came from diffusers' calculate_shift(image_seq_len, ..config..).
    let golden = Golden::load();
    let mut seen = 0;
    for (name, case) in golden.meta["cases"].as_object().unwrap() {
        let Some(len) = case["image_seq_len"].as_u64() else {
            continue;
        };
        let cfg = SchedulerConfig::from_json_str(&case["config"].to_string(), name).unwrap();
        let mu = case["set_timesteps"]["mu"].as_f64().unwrap();
        assert_eq!(calculate_shift(len as usize, &cfg), mu, "{name}");
        seen += 1;
    }
    assert!(seen >= 2);
}

#[test]
fn flow_matching_has_no_input_scaling_and_unit_noise() {
    let golden = Golden::load();
    for name in ["fm_euler_sd3", "fm_heun_sd3", "fm_euler_flux_dev"] {
        let case = &golden.meta["cases"][name];
        let sched = build(name, case);
        assert_eq!(sched.init_noise_sigma(), 1.0, "{name}");
        let x = golden.stack(&format!("{name}.prev_sample"))[0].clone();
        let t = sched.timesteps()[0];
        let y = sched.scale_model_input(x.clone(), t).unwrap();
        assert_eq!(values(&x), values(&y), "{name}");
        // timesteps = sigmas * num_train_timesteps, in f32.
        let sigmas = sched.sigmas().unwrap();
        for (i, &t) in sched.timesteps().iter().enumerate() {
            let j = if name.contains("heun") {
                i.div_ceil(2) * 2 - usize::from(i > 0)
            } else {
                i
            };
            assert_eq!(
                t,
                (sigmas[j] as f32 * 1000.0) as f64,
                "{name}: timestep {i}"
            );
        }
    }
}

#[test]
fn heun_lists_both_stages_in_timesteps() {
    // diffusers' Heun repeats every timestep but the first (2n - 1 entries, 2n sigmas);
    // the pipeline calls step() once per entry and order() says two entries make a step.
    let golden = Golden::load();
    let case = &golden.meta["cases"]["heun_sd15"];
    let sched = build("heun_sd15", case);
    let n = case["num_inference_steps"].as_u64().unwrap() as usize;
    assert_eq!(sched.order(), 2);
    assert_eq!(sched.timesteps().len(), 2 * n - 1);
    assert_eq!(sched.sigmas().unwrap().len(), 2 * n);
    let ts = sched.timesteps();
    assert!(ts[1..].chunks(2).all(|p| p[0] == p[1]), "{ts:?}");
}
