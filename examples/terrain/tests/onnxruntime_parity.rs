//! The imported terrain consistency model against onnxruntime (golden data of
//! `tools/golden/make_terrain.py`, `tests/fixtures/golden/terrain.*`): one network call, the
//! consistency function it makes with the scheduler (the full ONNX graph's output), and whole
//! 1-step and 2-step samples from a seed, on burn-flex and on XLA's CPU plugin (eager and
//! compiled).
//!
//! Only built with the model (`tools/fetch-terrain.sh`; `tools/test.sh` fetches it).
//! Tolerance 1e-4 relative to the reference's largest magnitude: onnxruntime, burn-flex and
//! XLA sum the convolutions and matmuls of 10.5M parameters in different orders (about 1e-5
//! seen between torch thread counts), and the 2-step sample feeds the first step's result
//! back through the network. The initial noise must equal torch's draws exactly.

#![cfg(terrain_model)]

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oxidiff::backend::pjrt::{Error as PjrtError, Plugin};
use oxidiff::backend::CompiledFn;
use oxidiff::schedulers::{NoNoise, NoiseSource, Scheduler, TorchCpuGenerator};
use oxidiff::{Cpu, Oxi, OxiDevice};
use oxidiff_terrain::{
    difficulty_label, load, sample, scheduler, with_large_stack, Result, WEIGHTS,
};
use safetensors::SafeTensors;
use serde_json::Value;

const RTOL: f64 = 1e-4;

struct Golden {
    meta: Value,
    bytes: Vec<u8>,
}

impl Golden {
    fn load() -> Self {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden");
        let text = std::fs::read_to_string(dir.join("terrain.json")).expect("terrain.json");
        Golden {
            meta: serde_json::from_str(&text).expect("golden json"),
            bytes: std::fs::read(dir.join("terrain.safetensors")).expect("terrain.safetensors"),
        }
    }

    /// A stored f32 tensor: shape and values.
    fn get(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors header");
        let view = st.tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (view.shape().to_vec(), values)
    }

    /// Item `i` of a stacked `[n, b, c, h, w]` tensor, or the whole of a 4-d one.
    fn item(&self, name: &str, i: usize) -> Vec<f32> {
        let (shape, values) = self.get(name);
        let per: usize = shape[shape.len() - 4..].iter().product();
        values[i * per..(i + 1) * per].to_vec()
    }

    fn tensor<B: Backend>(&self, name: &str, device: &B::Device) -> Tensor<B, 4> {
        let (shape, values) = self.get(name);
        let shape: [usize; 4] = shape.try_into().unwrap();
        Tensor::from_data(TensorData::new(values, shape), device)
    }
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// max |ours - reference| / max |reference|; NaN or infinity on either side fails.
fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    oxidiff_test_support::relative_error("terrain output", ours, reference)
}

type Network<'a, B> =
    dyn FnMut(Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) -> Result<Tensor<B, 4>> + 'a;

/// Everything the test compares, for one backend and way of calling the network.
fn check<B: Backend>(what: &str, network: &mut Network<'_, B>, device: &B::Device) {
    let golden = Golden::load();
    let seed = golden.meta["seed"].as_u64().unwrap();
    let difficulty = golden.meta["difficulty"].as_u64().unwrap() as u32;
    let label = difficulty_label(difficulty).unwrap();
    assert_eq!(
        label as f64,
        golden.meta["difficulty_label"].as_f64().unwrap()
    );

    // The seed gives torch's noise, bit for bit.
    let noise: Tensor<B, 4> = TorchCpuGenerator::new(seed)
        .randn([1, 1, 128, 128], device)
        .unwrap();
    assert_eq!(
        values(noise),
        golden.item("noise", 0),
        "{what}: initial noise"
    );

    // One network call at sigma_max, then the consistency function (the full graph's output).
    let mut sched = scheduler::<B>(1).unwrap();
    let t = Scheduler::<B>::timesteps(&sched)[0];
    assert_eq!(t, golden.meta["call"]["timestep"].as_f64().unwrap());
    let x = golden.tensor::<B>("noise", device).mul_scalar(80.0);
    let scaled = sched.scale_model_input(x.clone(), t).unwrap();
    let err = rel_err(&values(scaled.clone()), &golden.item("call.model_input", 0));
    assert!(err < 1e-6, "{what}: scaled input off by {err:.2e}");
    let timestep = Tensor::<B, 1>::from_floats([t as f32], device);
    let labels = Tensor::<B, 1>::from_floats([label], device);
    let model_output = network(scaled, timestep, labels).unwrap();
    let err = rel_err(
        &values(model_output.clone()),
        &golden.item("call.model_output", 0),
    );
    eprintln!("{what}: network call vs onnxruntime: {err:.2e}");
    assert!(err < RTOL, "{what}: network call off by {err:.2e}");
    let denoised = sched.step(model_output, t, x, &mut NoNoise).unwrap();
    let err = rel_err(&values(denoised), &golden.item("call.denoised", 0));
    eprintln!("{what}: consistency function vs the full ONNX graph: {err:.2e}");
    assert!(err < RTOL, "{what}: denoised off by {err:.2e}");

    // Whole samples from the seed, every step compared.
    for steps in [1usize, 2] {
        let mut gen = TorchCpuGenerator::new(seed);
        let sched = scheduler::<B>(steps).unwrap();
        let out = sample::<B>(network, sched, difficulty, 1, &mut gen, device).unwrap();
        assert_eq!(out.len(), steps);
        for (i, x) in out.into_iter().enumerate() {
            let reference = golden.item(&format!("steps{steps}.prev_sample"), i);
            let err = rel_err(&values(x), &reference);
            eprintln!("{what}: {steps}-step sample, step {i} vs onnxruntime: {err:.2e}");
            assert!(
                err < RTOL,
                "{what}: {steps}-step sample, step {i} off by {err:.2e}"
            );
        }
    }
}

#[test]
fn terrain_model_matches_onnxruntime_on_cpu() {
    with_large_stack(|| {
        let device = Default::default();
        let net = load::<Cpu>(WEIGHTS.as_ref(), &device).unwrap();
        check::<Cpu>("cpu", &mut |x, t, d| Ok(net.forward(x, t, d)), &device);
    })
    .expect("the model thread starts");
}

/// XLA's CPU plugin, or `None` (test skipped) when it is missing and
/// `OXIDIFF_SKIP_PJRT_TESTS=1`; otherwise a missing plugin fails with how to fetch it.
fn xla_cpu() -> Option<OxiDevice> {
    match Plugin::discover("xla:cpu") {
        Ok(_) => Some("xla:cpu".parse().unwrap()),
        Err(e @ PjrtError::PluginNotFound { .. })
            if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").is_ok_and(|v| v == "1") =>
        {
            eprintln!("skipped (OXIDIFF_SKIP_PJRT_TESTS=1): {e}");
            None
        }
        Err(e) => panic!("{e}\n(set OXIDIFF_SKIP_PJRT_TESTS=1 to skip PJRT tests instead)"),
    }
}

#[test]
fn terrain_model_matches_onnxruntime_on_xla_cpu_eager_and_compiled() {
    let Some(xla) = xla_cpu() else {
        return;
    };
    with_large_stack(|| {
        let net = load::<Oxi>(WEIGHTS.as_ref(), &OxiDevice::Cpu)
            .unwrap()
            .to_device(&xla);
        check::<Oxi>(
            "xla:cpu eager",
            &mut |x, t, d| Ok(net.forward(x, t, d)),
            &xla,
        );
        let step = CompiledFn::new("terrain_unet", |(x, t, d)| net.forward(x, t, d));
        check::<Oxi>(
            "xla:cpu compiled",
            &mut |x, t, d| Ok(step.call((x, t, d)).expect("compiled call")),
            &xla,
        );
        // Two timesteps (1 and 2 steps), one program.
        assert_eq!(step.compiles(), 1, "a new timestep must not recompile");
    })
    .expect("the model thread starts");
}
