//! Tensor and data parallelism on XLA's CPU plugin with four devices (`cpu_device_count`
//! 4): the tiny UNet's compiled step (UNet and guidance) and the tiny PixArt transformer,
//! partitioned by GSPMD with tp 2 and 4, dp 2 and dp 2 x tp 2, equal the single-device program;
//! the optimized programs hold the all-reduces of the row-wise layers; each device holds
//! `1/tp` of the split weights; bad configs are refused before anything moves; the pipeline
//! with tp 2 matches diffusers' own 4-step DDIM run (`tools/golden/make_tiny_sd.py`).
//!
//! Tolerances: 1e-5 relative for the UNet and the transformer alone: the partitioned program
//! sums each row-wise layer's partial products across devices (an all-reduce) instead of in one
//! dot, and XLA tiles the smaller per-device dots differently, which reorders f32 sums
//! (observed 1.5e-7 to 1.2e-6). With classifier-free guidance at scale 7.5 the step returns
//! `uncond + 7.5 (text - uncond)`, which multiplies the rounding of the two nearly equal halves
//! by about 15: 1e-4 there (observed 1.2e-5 for the step, 1.3e-6 for two whole DDIM steps).

mod common;

use std::sync::Arc;

use burn::tensor::Tensor;
use common::{model_dir, relative_error, to_vec};
use oxidiff::backend::eager::XLA_CPU_DEVICES_ENV;
use oxidiff::backend::spmd::{Layout, SpmdPlacement};
use oxidiff::backend::CompiledFn;
use oxidiff::models::PixArtTransformer2DModel;
use oxidiff::models::{sharded_params, TensorParallel, UNet2DConditionModel};
use oxidiff::pipelines::parallel::{
    enable_parallelism, DataParallelConfig, ParallelConfig, ParallelError, TensorParallelConfig,
};
use oxidiff::pipelines::{guided_noise, PipelineError};
use oxidiff::{Oxi, OxiDevice};

const TOLERANCE: f32 = 1e-5;
const GUIDED_TOLERANCE: f32 = 1e-4;

fn skip() -> bool {
    std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1")
}

/// `xla:cpu:0` of a client with four devices: only in the child process of [`four_devices`].
fn xla() -> OxiDevice {
    assert_eq!(
        std::env::var(XLA_CPU_DEVICES_ENV).as_deref(),
        Ok("4"),
        "a test on four devices starts with `four_devices(TEST_NAME)`"
    );
    "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"))
}

/// Whether this is the child process that runs `test` with four XLA CPU devices: the count is
/// read from the environment when the process's first client is made, so each such test gets
/// a process of its own rather than setting the variable under the other tests.
fn four_devices(test: &str) -> bool {
    oxidiff_test_support::isolated(test, &[(XLA_CPU_DEVICES_ENV, "4")])
}

fn unet(device: &OxiDevice) -> UNet2DConditionModel<Oxi> {
    UNet2DConditionModel::from_dir(&model_dir("tiny-sd1").join("unet"), None, device)
        .unwrap_or_else(|e| panic!("{e}"))
}

type StepInputs = (
    Tensor<Oxi, 4>,
    Tensor<Oxi, 1>,
    Tensor<Oxi, 3>,
    Tensor<Oxi, 1>,
);

/// Values for one step: `batch` latents 8x8 and `rows` context rows of 77 x 32 (`2 * batch`:
/// with the negative half, so the step applies guidance 7.5); the same in every run.
fn step_inputs(batch: usize, rows: usize) -> Vec<f32> {
    let n = batch * 4 * 8 * 8 + rows * 77 * 32;
    // A fixed pseudo-random pattern, the same in every run.
    (0..n)
        .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 2.0)
        .collect()
}

fn to_inputs(values: &[f32], batch: usize, device: &OxiDevice) -> StepInputs {
    let latents = batch * 4 * 8 * 8;
    let rows = (values.len() - latents) / (77 * 32);
    let sample =
        Tensor::<Oxi, 1>::from_floats(&values[..latents], device).reshape([batch, 4, 8, 8]);
    let context = Tensor::<Oxi, 1>::from_floats(&values[latents..], device).reshape([rows, 77, 32]);
    (
        sample,
        Tensor::from_floats([500.0], device),
        context,
        Tensor::from_floats([7.5], device),
    )
}

type Step = CompiledFn<StepInputs, Tensor<Oxi, 4>, Box<dyn Fn(StepInputs) -> Tensor<Oxi, 4>>>;

fn step(unet: UNet2DConditionModel<Oxi>, placement: Option<Arc<SpmdPlacement>>) -> Step {
    let f: Box<dyn Fn(StepInputs) -> Tensor<Oxi, 4>> =
        Box::new(move |(s, t, c, g)| guided_noise(&unet, s, t, c, g));
    let step = CompiledFn::new("unet+cfg", f);
    match placement {
        Some(placement) => step.with_spmd(
            placement,
            vec![
                Layout::BatchSplit(0),
                Layout::Replicated,
                Layout::BatchSplit(0),
                Layout::Replicated,
            ],
        ),
        None => step,
    }
}

fn run_step(step: &Step, values: &[f32], batch: usize, device: &OxiDevice) -> Vec<f32> {
    let out = step
        .call(to_inputs(values, batch, device))
        .unwrap_or_else(|e| panic!("{e}"));
    to_vec(out.to_device(&OxiDevice::Cpu))
}

fn all_reduces(step: &Step) -> usize {
    let counts = step
        .optimized_opcode_counts()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(counts.len(), 1);
    eprintln!(
        "collectives: {:?}",
        counts[0]
            .iter()
            .filter(|(op, _)| op.starts_with("all-")
                || op.contains("collective")
                || op.starts_with("reduce-scatter"))
            .collect::<Vec<_>>()
    );
    counts[0]
        .iter()
        .filter(|(op, _)| op.starts_with("all-reduce"))
        .map(|(_, n)| n)
        .sum()
}

#[test]
fn unet_step_tensor_and_data_parallel_match_one_device() {
    if skip() || !four_devices("unet_step_tensor_and_data_parallel_match_one_device") {
        return;
    }
    let device = xla();
    let plan = UNet2DConditionModel::<Oxi>::tensor_parallel_plan();
    let reference_unet = unet(&device);
    let params = sharded_params::<Oxi, _>(&reference_unet, &plan);
    // 16 transformer blocks (6 down, 1 mid, 9 up), 10 split linear layers each.
    let row_layers = params
        .iter()
        .filter(|p| p.key.ends_with(".weight") && p.split_dim == 0)
        .count();
    assert_eq!(row_layers, 16 * 3, "to_out.0 twice and ff.net.2 per block");
    let sharded_bytes: usize = params
        .iter()
        .map(|p| p.dims.iter().product::<usize>() * 4)
        .sum();

    // (batch, context rows, configs): the UNet alone, then with guidance.
    let tp = |n| ParallelConfig::from(TensorParallelConfig::new(n));
    let cases = [
        (1, 1, vec![tp(2), tp(4)]),
        (
            2,
            2,
            vec![DataParallelConfig::new(2).into(), ParallelConfig::new(2, 2)],
        ),
        (1, 2, vec![tp(2)]),
    ];
    for (batch, rows, configs) in cases {
        let values = step_inputs(batch, rows);
        let single = step(unet(&device), None);
        let expected = run_step(&single, &values, batch, &device);
        assert_eq!(all_reduces(&single), 0);
        let tolerance = if rows == batch {
            TOLERANCE
        } else {
            GUIDED_TOLERANCE
        };
        for config in configs {
            let mut model = unet(&device);
            let placement =
                enable_parallelism(&mut model, &device, config).unwrap_or_else(|e| panic!("{e}"));
            let parallel = step(model, Some(placement.clone()));
            let actual = run_step(&parallel, &values, batch, &device);
            let err = relative_error(&actual, &expected);
            let reduces = all_reduces(&parallel);
            let bytes = placement.weight_bytes();
            eprintln!(
                "batch {batch}, guidance {}, dp {} x tp {}: relative error {err:e}, {reduces} all-reduces, weight bytes per device {bytes:?}",
                rows != batch,
                config.dp(),
                config.tp()
            );
            assert!(
                err <= tolerance,
                "dp {} tp {}: {err:e}",
                config.dp(),
                config.tp()
            );
            assert_eq!(bytes.len(), config.devices());
            // Each device holds 1/tp of the split weights and all of the others.
            for b in &bytes {
                assert_eq!(
                    b.sharded,
                    if config.tp() > 1 {
                        sharded_bytes / config.tp()
                    } else {
                        0
                    }
                );
                assert_eq!(b.replicated, bytes[0].replicated);
            }
            if config.tp() > 1 {
                // GEGLU's value and gate columns are placed shard-aligned: no transfer
                // between the devices before `value * gelu(gate)`.
                let counts = parallel.optimized_opcode_counts().unwrap();
                assert!(
                    !counts[0]
                        .keys()
                        .any(|op| op.starts_with("collective-permute")),
                    "{:?}",
                    counts[0]
                );
                assert!(
                    reduces >= row_layers,
                    "{reduces} all-reduces for {row_layers} row-wise layers"
                );
            }
            // A second call runs the cached program on the same shards.
            assert_eq!(run_step(&parallel, &values, batch, &device), actual);
            assert_eq!(parallel.compiles(), 1);
        }
    }
}

#[test]
fn pixart_transformer_tensor_parallel_matches_one_device() {
    if skip() || !four_devices("pixart_transformer_tensor_parallel_matches_one_device") {
        return;
    }
    let device = xla();
    let dir = model_dir("tiny-pixart-alpha").join("transformer");
    let load = || {
        PixArtTransformer2DModel::<Oxi>::from_dir(&dir, None, &device)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    type Inputs = (Tensor<Oxi, 4>, Tensor<Oxi, 1>, Tensor<Oxi, 3>);
    type F = Box<dyn Fn(Inputs) -> Tensor<Oxi, 4>>;
    let make = |model: PixArtTransformer2DModel<Oxi>| -> CompiledFn<Inputs, Tensor<Oxi, 4>, F> {
        CompiledFn::new(
            "pixart",
            Box::new(move |(x, t, caption): Inputs| {
                model.forward_checked(x, t, caption, None, None)
            }) as F,
        )
    };
    let inputs = || -> Inputs {
        (
            Tensor::<Oxi, 1>::from_floats(
                step_inputs(1, 1)[..4 * 16 * 16].to_vec().as_slice(),
                &device,
            )
            .reshape([1, 4, 16, 16]),
            Tensor::from_floats([250.0], &device),
            Tensor::<Oxi, 1>::from_floats(&step_inputs(1, 1)[..12 * 32], &device)
                .reshape([1, 12, 32]),
        )
    };
    let single = make(load());
    let expected = to_vec(single.call(inputs()).unwrap().to_device(&OxiDevice::Cpu));
    for tp in [2, 4] {
        let mut model = load();
        let placement =
            enable_parallelism(&mut model, &device, TensorParallelConfig::new(tp).into())
                .unwrap_or_else(|e| panic!("{e}"));
        let parallel = make(model).with_spmd(placement.clone(), Vec::new());
        let actual = to_vec(parallel.call(inputs()).unwrap().to_device(&OxiDevice::Cpu));
        let err = relative_error(&actual, &expected);
        let counts = parallel.optimized_opcode_counts().unwrap();
        let reduces: usize = counts[0]
            .iter()
            .filter(|(op, _)| op.starts_with("all-reduce"))
            .map(|(_, n)| n)
            .sum();
        eprintln!(
            "pixart tp {tp}: relative error {err:e}, {reduces} all-reduces, weight bytes {:?}",
            placement.weight_bytes()
        );
        assert!(err <= TOLERANCE, "tp {tp}: {err:e}");
        // Two blocks, three row-wise layers each.
        assert!(reduces >= 6, "{reduces} all-reduces");
    }
}

#[test]
fn bad_parallel_configs_are_refused_before_anything_moves() {
    if skip() || !four_devices("bad_parallel_configs_are_refused_before_anything_moves") {
        return;
    }
    let device = xla();
    let mut model = unet(&device);
    // The tiny UNet has 8 heads per attention: 3 does not divide them.
    let err = enable_parallelism(&mut model, &device, TensorParallelConfig::new(3).into())
        .err()
        .expect("tp 3 is refused");
    assert!(
        matches!(
            err,
            PipelineError::Parallel(ParallelError::Indivisible { tp: 3, .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("attention heads"), "{err}");
    // Four devices here.
    let err = enable_parallelism(&mut model, &device, TensorParallelConfig::new(8).into())
        .err()
        .expect("tp 8 is refused");
    assert!(
        matches!(
            err,
            PipelineError::Parallel(ParallelError::TooFewDevices {
                needed: 8,
                available: 4,
                ..
            })
        ),
        "{err}"
    );
    let err = enable_parallelism(&mut model, &device, ParallelConfig::new(2, 4))
        .err()
        .expect("dp 2 x tp 4 is refused");
    assert!(err.to_string().contains("needs 8 devices"), "{err}");
    // The CPU backend cannot be partitioned.
    let mut cpu_model = unet(&OxiDevice::Cpu);
    let err = enable_parallelism(
        &mut cpu_model,
        &OxiDevice::Cpu,
        TensorParallelConfig::new(2).into(),
    )
    .err()
    .expect("tp on the CPU backend is refused");
    assert!(
        matches!(
            err,
            PipelineError::Parallel(ParallelError::NeedsCompiledMode { .. })
        ),
        "{err}"
    );
    // Nothing moved: the model still runs on one device.
    let values = step_inputs(1, 2);
    let out = run_step(&step(model, None), &values, 1, &device);
    assert!(out.iter().all(|v| v.is_finite()));
}

#[test]
fn pipeline_enable_parallelism_generates_what_one_device_does() {
    if skip() || !four_devices("pipeline_enable_parallelism_generates_what_one_device_does") {
        return;
    }
    use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
    use oxidiff::schedulers::NoNoise;
    use oxidiff::ToDevice;

    let device = xla();
    let load = || {
        let options = LoadOptions {
            scheduler: Some("ddim".into()),
            ..Default::default()
        };
        StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, &OxiDevice::Cpu)
            .unwrap_or_else(|e| panic!("{e}"))
            .to(&device)
    };
    let golden = common::Golden::load("tiny-sd1");
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    let request = GenerateRequest::<Oxi> {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 2,
        guidance_scale: 7.5,
        latents: Some(Tensor::from_data(
            burn::tensor::TensorData::new(values, shape),
            &OxiDevice::Cpu,
        )),
        ..Default::default()
    };
    let latents = |pipe: &mut StableDiffusionPipeline<Oxi>| {
        let out = pipe
            .generate_with(&request, &mut NoNoise, |_| {})
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(out.images.is_some());
        to_vec(out.latents.to_device(&OxiDevice::Cpu))
    };
    let mut single = load();
    single.compile().unwrap();
    let expected = latents(&mut single);
    assert!(single.parallel_weight_bytes().is_none());

    let mut parallel = load();
    parallel
        .enable_parallelism(TensorParallelConfig::new(2))
        .unwrap_or_else(|e| panic!("{e}"));
    let actual = latents(&mut parallel);
    let err = relative_error(&actual, &expected);
    eprintln!("pipeline tp 2, 2 DDIM steps at guidance 7.5: relative error {err:e}");
    assert!(err <= GUIDED_TOLERANCE, "{err:e}");
    // diffusers itself: its 4-step DDIM run of this request (tools/golden/make_tiny_sd.py), at
    // the 1e-4 of the one-device parity tests (tests/pipeline.rs).
    let four_steps = GenerateRequest {
        num_inference_steps: 4,
        ..request.clone()
    };
    let out = parallel
        .generate_with(&four_steps, &mut NoNoise, |_| {})
        .unwrap_or_else(|e| panic!("{e}"));
    for (what, actual, key) in [
        (
            "latents",
            to_vec(out.latents.to_device(&OxiDevice::Cpu)),
            "pipe.ddim.step3",
        ),
        ("image", out.images.expect("images").data, "pipe.ddim.image"),
    ] {
        let err = relative_error(&actual, &golden.host(key).0);
        eprintln!("pipeline tp 2, 4 DDIM steps vs diffusers {what}: relative error {err:e}");
        assert!(err <= GUIDED_TOLERANCE, "tp 2 vs diffusers {what}: {err:e}");
    }
    // One program for both steps, on two devices holding half the split weights each.
    assert_eq!(parallel.compile_stats().map(|s| s.programs), Some(1));
    let bytes = parallel.parallel_weight_bytes().expect("parallel");
    assert_eq!(bytes.len(), 2);
    assert_eq!(bytes[0], bytes[1]);
    assert!(bytes[0].sharded > 0);
}

/// A pipeline loaded with its weights staged (`stage_weights`, what `txt2img --tp` does) sends
/// each device only its shards: device 0 receives every weight but the split ones (counted by
/// its client, against the same pipeline loaded without staging), each device half of the
/// split bytes, and the images are those of the pipeline placed after an ordinary load, bit
/// for bit (the same shards, cut from the file's bytes instead of from device 0's buffers).
#[test]
fn a_staged_load_sends_each_device_only_its_shards() {
    if skip() || !four_devices("a_staged_load_sends_each_device_only_its_shards") {
        return;
    }
    use oxidiff::backend::pjrt_client;
    use oxidiff::pipelines::parallel::stage_weights;
    use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
    use oxidiff::schedulers::NoNoise;

    let load = |device: &OxiDevice| {
        let options = LoadOptions {
            scheduler: Some("ddim".into()),
            ..Default::default()
        };
        StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, device)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let uploaded = |device: &OxiDevice| pjrt_client(device).expect("pjrt").stats();
    let request = |device: &OxiDevice| GenerateRequest::<Oxi> {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        num_inference_steps: 2,
        guidance_scale: 7.5,
        latents: Some(Tensor::from_data(
            burn::tensor::TensorData::new(
                (0..256)
                    .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                    .collect::<Vec<_>>(),
                [1, 4, 8, 8],
            ),
            device,
        )),
        ..Default::default()
    };

    // Devices 0 and 1: staged. Devices 2 and 3: loaded on device 2, then split.
    let staged_device: OxiDevice = xla();
    let plain_device: OxiDevice = "xla:cpu:2".parse().unwrap();
    let mut staged = stage_weights(&staged_device, || load(&staged_device));
    let held = uploaded(&staged_device);
    assert!(held.staged > 100, "the load staged its weights: {held:?}");
    assert_eq!(held.uploaded_bytes, 0, "{held:?}");
    let mut plain = load(&plain_device);
    let whole = uploaded(&plain_device).uploaded_bytes;
    for (pipe, device) in [(&mut staged, &staged_device), (&mut plain, &plain_device)] {
        pipe.compile().unwrap();
        pipe.enable_parallelism(TensorParallelConfig::new(2))
            .unwrap_or_else(|e| panic!("{device}: {e}"));
    }
    let after = uploaded(&staged_device);
    assert_eq!(
        after.staged, 0,
        "enable_parallelism uploads the rest: {after:?}"
    );
    let bytes = staged.parallel_weight_bytes().expect("parallel");
    let split: usize = bytes.iter().map(|b| b.sharded).sum();
    eprintln!(
        "uploaded to device 0: {} bytes staged, {whole} bytes without staging; split weights {split} bytes, per device {bytes:?}",
        after.uploaded_bytes
    );
    assert!(
        split > 0 && bytes[0].sharded == bytes[1].sharded,
        "{bytes:?}"
    );
    assert_eq!(
        after.uploaded_bytes + split as u64,
        whole,
        "device 0 received everything but the split weights"
    );
    assert_eq!(plain.parallel_weight_bytes(), Some(bytes));

    let mut latents = Vec::new();
    for (pipe, device) in [(&mut staged, &staged_device), (&mut plain, &plain_device)] {
        let out = pipe
            .generate_with(&request(device), &mut NoNoise, |_| {})
            .unwrap_or_else(|e| panic!("{e}"));
        latents.push(to_vec(out.latents.to_device(&OxiDevice::Cpu)));
    }
    assert_eq!(
        latents[0], latents[1],
        "the staged shards are the placed ones"
    );
}

#[test]
fn txt2img_tp_and_dp_need_compile_and_a_fitting_degree() {
    if skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_txt2img"))
            .args(["--model"])
            .arg(model_dir("tiny-sd1"))
            .args([
                "--steps", "1", "--seed", "1", "--quiet", "--device", "xla:cpu",
            ])
            .args(extra)
            .env(XLA_CPU_DEVICES_ENV, "4")
            .arg("-o")
            .arg(tmp.path().join("out.png"))
            .arg("a horse")
            .output()
            .expect("txt2img runs");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let stderr = run(&["--tp", "2"]);
    assert!(stderr.contains("add --compile"), "{stderr}");
    let stderr = run(&["--compile", "--tp", "3"]);
    assert!(
        stderr.contains("does not divide the 8 attention heads"),
        "{stderr}"
    );
}

/// Runs `txt2img --compile` on `model` once on one device and once per `splits` entry, and
/// checks each split run writes the one-device image within 1 PNG level, and that `--json`'s
/// `memory` puts the denoiser's weights where the split put them: under `--tp` each of the two
/// devices holds the same bytes, fewer than the one device (the split weights' halves); under
/// `--dp` each holds them all.
fn split_runs_match_one_device(model: &str, size: &str, splits: &[[&str; 2]]) {
    split_runs_with(model, size, &[], splits)
}

/// [`split_runs_match_one_device`] with `common` flags on every run (ControlNets: their
/// weights are in the denoiser's placement, so the one device's "whole" is the denoiser's and
/// the ControlNets' bytes together).
fn split_runs_with(model: &str, size: &str, common: &[&str], splits: &[[&str; 2]]) {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out_path = tmp.path().join(name);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_txt2img"))
            .args(["--model"])
            .arg(model_dir(model))
            .args([
                "--steps",
                "2",
                "--seed",
                "7",
                "--width",
                size,
                "--height",
                size,
                "--device",
                "xla:cpu",
                "--compile",
                "--json",
                "--quiet",
            ])
            .args(common)
            .args(extra)
            .env(XLA_CPU_DEVICES_ENV, "4")
            .arg("-o")
            .arg(&out_path)
            .arg("a horse")
            .output()
            .expect("txt2img runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{model} {extra:?}: {stderr}");
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let memory = &summary["memory"];
        let denoiser = if memory["unet"].is_object() {
            &memory["unet"]
        } else {
            &memory["transformer"]
        };
        let places = |component: &serde_json::Value| -> Vec<(String, u64)> {
            component["places"]
                .as_object()
                .unwrap_or_else(|| panic!("{model} {extra:?}: no memory places: {summary}"))
                .iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
                .collect()
        };
        let controlnets: u64 = memory
            .as_object()
            .unwrap()
            .iter()
            .filter(|(name, _)| name.starts_with("controlnet"))
            .flat_map(|(_, c)| places(c))
            .map(|(_, bytes)| bytes)
            .sum();
        (
            image::open(&out_path).unwrap().to_rgb8(),
            places(denoiser),
            controlnets,
        )
    };
    let (single, one_device, controlnets) = run("single.png", &[]);
    assert_eq!(one_device.len(), 1, "{one_device:?}");
    assert_eq!(one_device[0].0, "xla:cpu:0");
    assert_eq!(controlnets > 0, !common.is_empty(), "{model} {common:?}");
    let whole = one_device[0].1 + controlnets;
    for (k, extra) in splits.iter().enumerate() {
        let (split, places, _) = run(&format!("split-{k}.png"), extra);
        eprintln!("{model} {extra:?}: denoiser bytes {places:?}, one device {whole}");
        let names: Vec<&str> = places.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["xla:cpu:0", "xla:cpu:1"], "{model} {extra:?}");
        assert_eq!(places[0].1, places[1].1, "{model} {extra:?}");
        if extra[0] == "--tp" {
            assert!(
                places[0].1 < whole,
                "{model} {extra:?}: {places:?} vs {whole}"
            );
        } else {
            assert_eq!(places[0].1, whole, "{model} {extra:?}");
        }
        let worst = single
            .as_raw()
            .iter()
            .zip(split.as_raw())
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        eprintln!("{model} {extra:?}: {worst} PNG levels off one device");
        assert!(
            worst <= 1,
            "{model} {extra:?}: {worst} PNG levels off one device"
        );
    }
}

#[test]
fn txt2img_tp_and_dp_write_the_image_of_one_device() {
    if skip() {
        return;
    }
    // Guidance 7.5 doubles the batch, so dp 2 splits the two CFG halves over the devices.
    split_runs_match_one_device("tiny-sd1", "64", &[["--tp", "2"], ["--dp", "2"]]);
}

#[test]
fn txt2img_tp_and_dp_for_sdxl_sd3_and_flux_write_the_image_of_one_device() {
    if skip() {
        return;
    }
    split_runs_match_one_device("tiny-sdxl", "64", &[["--tp", "2"]]);
    split_runs_match_one_device("tiny-sd3", "64", &[["--tp", "2"], ["--dp", "2"]]);
    // Flux dev is guidance-distilled (one transformer call per step, batch 1): tp only.
    split_runs_match_one_device("tiny-flux-dev", "64", &[["--tp", "2"]]);
}

/// The ControlNet pipelines split the UNet and their ControlNets over the devices (each by
/// its plan, the controlled step one program): SD 1.x with two ControlNets, SDXL with one.
#[test]
fn txt2img_tp_with_controlnets_writes_the_image_of_one_device() {
    if skip() {
        return;
    }
    let image = common::fixtures().join("golden/controlnet-input.png");
    let image = image.to_str().unwrap();
    let (a, b, xl) = (
        model_dir("tiny-controlnet-sd1"),
        model_dir("tiny-controlnet-sd1-b"),
        model_dir("tiny-controlnet-sdxl"),
    );
    let (a, b, xl) = (
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        xl.to_str().unwrap(),
    );
    let two = [
        "--controlnet",
        a,
        "--control-image",
        image,
        "--controlnet",
        b,
        "--control-image",
        image,
    ];
    split_runs_with("tiny-sd1", "64", &two, &[["--tp", "2"]]);
    let one = ["--controlnet", xl, "--control-image", image, "--guess-mode"];
    split_runs_with("tiny-sdxl", "64", &one, &[["--tp", "2"]]);
}

/// A ControlNet's plan splits exactly what the UNet's splits in the half it copies: the same
/// checkpoint keys (the down and mid blocks' transformer layers), along the same dimensions,
/// with the same widths for the degree to divide.
#[test]
fn a_controlnet_splits_the_layers_its_unet_splits_in_the_down_and_mid_blocks() {
    use oxidiff::models::ControlNetModel;
    type Cpu = common::B;
    let device = Default::default();
    let net =
        ControlNetModel::<Cpu>::from_dir(&model_dir("tiny-controlnet-sd1"), None, &device).unwrap();
    let unet =
        UNet2DConditionModel::<Cpu>::from_dir(&model_dir("tiny-sd1").join("unet"), None, &device)
            .unwrap();
    let keys = |params: Vec<oxidiff::models::ShardedParam<Cpu>>| -> Vec<(String, usize, usize)> {
        let mut v: Vec<_> = params
            .into_iter()
            .filter(|p| !p.key.starts_with("up_blocks."))
            .map(|p| (p.key, p.split_dim, p.packed))
            .collect();
        v.sort();
        v
    };
    let ours = keys(sharded_params(
        &net,
        &ControlNetModel::<Cpu>::tensor_parallel_plan(),
    ));
    assert!(!ours.is_empty());
    assert_eq!(
        ours,
        keys(sharded_params(
            &unet,
            &UNet2DConditionModel::<Cpu>::tensor_parallel_plan()
        ))
    );
    let widths = |w: Vec<oxidiff_parallel::ShardedWidth>| -> Vec<String> {
        let mut v: Vec<String> = w
            .iter()
            .map(|w| format!("{w:?}"))
            .filter(|w| !w.contains("up_blocks."))
            .collect();
        v.sort();
        v
    };
    assert_eq!(widths(net.sharded_widths()), widths(unet.sharded_widths()));
}
