//! The tiny Stable Diffusion 1.x models (CLIP text encoder, UNet, VAE) on the
//! XLA CPU plugin in eager mode, against the same models on the CPU device,
//! with the golden inputs of `tests/fixtures/golden/tiny-sd1.safetensors`.
//!
//! Tolerance 1e-4 relative to the largest magnitude: both sides compute in
//! f32, but XLA and burn-flex sum convolutions, matmuls and reductions in
//! different orders (the model parity tests accept the same 1e-4 against
//! PyTorch for the same reason).

mod common;

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use oxidiff_backend_tpu::{Oxi, OxiDevice};
use oxidiff_models::{AutoencoderKL, ClipTextModel, UNet2DConditionModel, Weights};

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn model_dir() -> PathBuf {
    fixtures().join("tiny-sd1")
}

fn golden() -> Weights {
    Weights::from_files(&[fixtures().join("golden/tiny-sd1.safetensors")])
        .unwrap_or_else(|e| panic!("golden tensors: {e}"))
}

fn golden_tensor<const D: usize>(
    golden: &Weights,
    key: &str,
    device: &OxiDevice,
) -> Tensor<Oxi, D> {
    let (values, shape) = golden
        .read_f32(key)
        .unwrap_or_else(|e| panic!("golden key {key}: {e}"));
    let shape: [usize; D] = shape
        .try_into()
        .unwrap_or_else(|s| panic!("{key}: rank of {s:?}"));
    Tensor::from_data(TensorData::new(values, shape), device)
}

fn values<const D: usize>(name: &str, tensor: Tensor<Oxi, D>) -> (Vec<usize>, Vec<f32>) {
    let dims = tensor.dims().to_vec();
    match tensor.try_into_data() {
        Ok(data) => (
            dims,
            data.convert::<f32>()
                .to_vec::<f32>()
                .unwrap_or_else(|e| panic!("{name}: {e:?}")),
        ),
        Err(e) => panic!("{name}: {e}"),
    }
}

fn assert_close<const D: usize>(name: &str, actual: Tensor<Oxi, D>, expected: Tensor<Oxi, D>) {
    let (actual_dims, actual) = values(name, actual);
    let (expected_dims, expected) = values(name, expected);
    assert_eq!(actual_dims, expected_dims, "{name}: shape");
    let error = oxidiff_test_support::assert_close(name, &actual, &expected, f64::from(TOL));
    eprintln!("{name}: relative error {error:e} (xla:cpu vs cpu)");
}

#[test]
fn clip_text_model_on_xla_cpu_matches_cpu() {
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    let dir = model_dir().join("text_encoder");
    let ids: Vec<Vec<u32>> = vec![
        vec![49406, 320, 1929, 6529, 525, 320, 2175, 49407, 49407, 49407],
        vec![
            49406, 1237, 49407, 49407, 49407, 49407, 49407, 49407, 49407, 49407,
        ],
    ];
    let run = |device: &OxiDevice| {
        let model = ClipTextModel::<Oxi>::from_dir(&dir, false, None, device)
            .unwrap_or_else(|e| panic!("{e}"));
        model.forward(&ids, false).unwrap_or_else(|e| panic!("{e}"))
    };
    let expected = run(&OxiDevice::Cpu);
    let actual = run(&xla);
    assert_close(
        "clip.last_hidden_state",
        actual.last_hidden_state,
        expected.last_hidden_state,
    );
    assert_close(
        "clip.pooler_output",
        actual.pooler_output,
        expected.pooler_output,
    );
}

/// Loads the UNet on the CPU and moves it with `Module::to_device`.
#[test]
fn unet_moved_to_xla_cpu_matches_cpu() {
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    let golden = golden();
    let unet =
        UNet2DConditionModel::<Oxi>::from_dir(&model_dir().join("unet"), None, &OxiDevice::Cpu)
            .unwrap_or_else(|e| panic!("{e}"));
    let run = |unet: &UNet2DConditionModel<Oxi>, device: &OxiDevice| {
        let timestep = Tensor::<Oxi, 1>::from_data(TensorData::new(vec![500.0f32], [1]), device);
        unet.forward(
            golden_tensor(&golden, "unet.sample", device),
            timestep,
            golden_tensor(&golden, "unet.encoder_hidden_states", device),
        )
    };
    let start = std::time::Instant::now();
    let expected = run(&unet, &OxiDevice::Cpu);
    let _ = expected.clone().into_data();
    let cpu_time = start.elapsed();
    let unet = unet.to_device(&xla);
    let stats = || match burn_router::get_client::<oxidiff_backend_tpu::OxiChannel>(&xla) {
        oxidiff_backend_tpu::OxiClient::Pjrt(client) => Some(client.stats()),
        oxidiff_backend_tpu::OxiClient::Cpu(_) => None,
    };
    let before = stats();
    let start = std::time::Instant::now();
    let actual = run(&unet, &xla);
    let _ = actual.clone().into_data();
    let first = start.elapsed();
    let middle = stats();
    let start = std::time::Instant::now();
    let _ = run(&unet, &xla).into_data();
    let second = start.elapsed();
    let after = stats();
    eprintln!(
        "unet forward: cpu {cpu_time:?}; xla:cpu eager first {first:?}, cached {second:?}; stats before {before:?}, after first {middle:?}, after second {after:?}"
    );
    assert_close("unet.out", actual, expected);
}

#[test]
fn vae_on_xla_cpu_matches_cpu() {
    let Some(xla) = common::xla_cpu(1) else {
        return;
    };
    let golden = golden();
    let run = |device: &OxiDevice| {
        let vae = AutoencoderKL::<Oxi>::from_dir(&model_dir().join("vae"), None, device)
            .unwrap_or_else(|e| panic!("{e}"));
        let decoded = vae.decode(golden_tensor(&golden, "vae.decode.in", device));
        let dist = vae.encode(golden_tensor(&golden, "vae.encode.in", device));
        (decoded, dist.mean, dist.logvar)
    };
    let (decoded, mean, logvar) = run(&OxiDevice::Cpu);
    let (xla_decoded, xla_mean, xla_logvar) = run(&xla);
    assert_close("vae.decode", xla_decoded, decoded);
    assert_close("vae.encode.mean", xla_mean, mean);
    assert_close("vae.encode.logvar", xla_logvar, logvar);
}
