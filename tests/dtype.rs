//! `LoadOptions::dtype`: weights cast after loading, the UNet, the transformers (Flux, SD3,
//! PixArt), the text encoders and the VAE computing in their weights' dtype while the
//! pipeline's latents stay f32, on the CPU backend (burn-flex) and on XLA's CPU plugin.
//!
//! The folder pipelines' bf16/f16 runs are compared with diffusers' own bf16/f16 runs of the
//! same requests (`tools/golden/make_half.py`, `golden/half.*`), within bounds derived from how
//! far diffusers' half runs are from its f32 run (see `DiffusersHalf::bound`).

mod common;

use burn::tensor::FloatDType;
use common::half::{dtype_name, DiffusersHalf, HalfBound};
use common::{model_dir, relative_error};
use oxidiff::pipelines::{
    FluxPipeline, FluxRequest, GenerateRequest, LoadOptions, PixArtPipeline, PixArtRequest,
    Sd3Request, SingleFileOptions, StableDiffusion3Pipeline, StableDiffusionPipeline,
    StableDiffusionXLPipeline, XlRequest,
};
use oxidiff::{Oxi, OxiDevice};

/// oxidiff's f32 run against diffusers' f32 run of the same request: the f32 parity tests'
/// 1e-4 (1 vs 2 torch threads differ by about 1e-5). This proves both sides ran the same
/// request (prompt, seed draw, scheduler, size) before their half runs are compared.
const F32_TOLERANCE: f32 = 1e-4;

/// Checks oxidiff's f32 `reference` (latents, image) against diffusers' f32 latents of `case`,
/// then runs `generate` at each dtype and checks its latents and image against diffusers' run
/// in that dtype within `DiffusersHalf::bound`, and that they differ from the f32 run
/// (equal would mean the run did not compute in that dtype).
fn assert_matches_diffusers(
    case: &str,
    reference: &(Vec<f32>, Vec<f32>),
    dtypes: &[(FloatDType, HalfBound)],
    mut generate: impl FnMut(FloatDType) -> (Vec<f32>, Vec<f32>),
) {
    let half = DiffusersHalf::load();
    let err = relative_error(&reference.0, &half.values(case, "f32", "latents"));
    eprintln!("{case} f32 vs diffusers f32: latents {err:e}");
    assert!(
        err <= F32_TOLERANCE,
        "{case}: f32 latents {err:e} from diffusers': not the request make_half.py ran"
    );
    for &(dtype, how) in dtypes {
        let name = dtype_name(dtype);
        let (l, i) = generate(dtype);
        for (part, ours, own_f32) in [("latents", &l, &reference.0), ("image", &i, &reference.1)] {
            let err = relative_error(ours, &half.values(case, name, part));
            let bound = half.bound(case, name, part, how);
            eprintln!(
                "{case} {name} {part}: {err:e} from diffusers' {name} (bound {bound:e}); \
                 ours {:e} and diffusers' {:e} from f32",
                relative_error(ours, own_f32),
                half.recorded("distance_to_f32", case, name, part),
            );
            assert!(
                err <= bound,
                "{case} {name} {part}: {err:e} from diffusers' {name} run exceeds {bound:e}"
            );
        }
        assert!(
            relative_error(&l, &reference.0) > 0.0,
            "{case} {name} equals f32 exactly: not computed in {name}"
        );
    }
}

/// Runs `generate` at each `(dtype, tolerance)` and checks its latents and image against the
/// f32 `reference` (relative to the largest value): within the tolerance, and not equal
/// (equal would mean the run did not compute in that dtype).
fn assert_close_to_f32(
    label: &str,
    reference: &(Vec<f32>, Vec<f32>),
    cases: [(FloatDType, f32); 2],
    mut generate: impl FnMut(FloatDType) -> (Vec<f32>, Vec<f32>),
) {
    for (dtype, tolerance) in cases {
        let (l, i) = generate(dtype);
        let (el, ei) = (
            relative_error(&l, &reference.0),
            relative_error(&i, &reference.1),
        );
        eprintln!("{label} {dtype:?}: latents {el:e}, image {ei:e}");
        assert!(
            el <= tolerance && ei <= tolerance,
            "{label} {dtype:?}: {el:e} {ei:e}"
        );
        assert!(
            el > 0.0,
            "{label} {dtype:?} equals f32 exactly: not computed in {dtype:?}"
        );
    }
}

fn request() -> GenerateRequest<Oxi> {
    GenerateRequest {
        prompts: vec!["a red apple".into()],
        num_inference_steps: 2,
        seed: 3,
        ..Default::default()
    }
}

fn generate(dtype: Option<FloatDType>, device: &OxiDevice) -> (Vec<f32>, Vec<f32>) {
    let options = LoadOptions {
        dtype,
        ..Default::default()
    };
    let mut pipe =
        StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, device).unwrap();
    let want = dtype.unwrap_or(FloatDType::F32);
    for weight in [
        pipe.unet.conv_in.weight.val().dtype(),
        pipe.vae.decoder.conv_in.weight.val().dtype(),
        pipe.text_encoder.token_embedding.weight.val().dtype(),
    ] {
        assert_eq!(FloatDType::from(weight), want, "weights not cast");
    }
    let out = pipe.generate(&request()).unwrap();
    assert_eq!(
        FloatDType::from(out.latents.dtype()),
        FloatDType::F32,
        "latents stay f32"
    );
    let latents = out.latents.into_data().convert::<f32>().to_vec().unwrap();
    (latents, out.images.unwrap().data)
}

#[test]
fn sd_bf16_and_f16_match_diffusers_half_runs_on_the_cpu() {
    let cpu = OxiDevice::Cpu;
    let reference = generate(None, &cpu);
    assert_matches_diffusers(
        "sd1",
        &reference,
        &[
            (FloatDType::BF16, HalfBound::FromF32Distance),
            (FloatDType::F16, HalfBound::FromF32Distance),
        ],
        |dtype| generate(Some(dtype), &cpu),
    );
}

#[test]
fn bf16_compiled_step_on_xla_cpu_matches_eager_cpu_bf16() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let device: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let options = LoadOptions {
        dtype: Some(FloatDType::BF16),
        ..Default::default()
    };
    let mut pipe =
        StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, &device)
            .unwrap();
    pipe.compile().unwrap();
    let mut req = request();
    req.output = oxidiff::pipelines::OutputType::Latents;
    let out = pipe.generate(&req).unwrap();
    let compiled: Vec<f32> = out.latents.into_data().convert::<f32>().to_vec().unwrap();
    let (reference, _) = generate(Some(FloatDType::BF16), &OxiDevice::Cpu);
    // Both in bf16, but XLA fuses and orders the f32 accumulations differently.
    let err = relative_error(&compiled, &reference);
    eprintln!("bf16 compiled xla:cpu vs bf16 cpu: {err:e}");
    assert!(err <= 5e-2, "{err:e}");
    // And diffusers' own bf16 run of the request, as the eager one is bounded.
    let half = DiffusersHalf::load();
    let err = relative_error(&compiled, &half.values("sd1", "bf16", "latents"));
    let bound = half.bound("sd1", "bf16", "latents", HalfBound::FromF32Distance);
    eprintln!("bf16 compiled xla:cpu vs diffusers' bf16: {err:e} (bound {bound:e})");
    assert!(
        err <= bound,
        "{err:e} from diffusers' bf16 exceeds {bound:e}"
    );
}

fn flux_request(steps: usize) -> FluxRequest<Oxi> {
    FluxRequest {
        common: GenerateRequest {
            prompts: vec!["a red apple".into()],
            num_inference_steps: steps,
            width: Some(64),
            height: Some(32),
            seed: 3,
            ..Default::default()
        },
        max_sequence_length: 16,
        ..Default::default()
    }
}

fn generate_flux(
    dtype: Option<FloatDType>,
    steps: usize,
    device: &OxiDevice,
) -> (Vec<f32>, Vec<f32>) {
    let options = LoadOptions {
        dtype,
        ..Default::default()
    };
    let mut pipe =
        FluxPipeline::<Oxi>::from_dir(&model_dir("tiny-flux-dev"), &options, device).unwrap();
    let want = dtype.unwrap_or(FloatDType::F32);
    for weight in [
        pipe.transformer.proj_out.weight.val().dtype(),
        pipe.transformer.x_embedder.weight.val().dtype(),
        pipe.text_encoder.token_embedding.weight.val().dtype(),
        pipe.text_encoder_2.shared.weight.val().dtype(),
        pipe.vae.decoder.conv_in.weight.val().dtype(),
    ] {
        assert_eq!(FloatDType::from(weight), want, "weights not cast");
    }
    let out = pipe.generate(&flux_request(steps)).unwrap();
    assert_eq!(
        FloatDType::from(out.latents.dtype()),
        FloatDType::F32,
        "latents stay f32"
    );
    let latents = out.latents.into_data().convert::<f32>().to_vec().unwrap();
    (latents, out.images.unwrap().data)
}

#[test]
fn flux_bf16_and_f16_match_diffusers_half_runs_on_the_cpu() {
    let cpu = OxiDevice::Cpu;
    let reference = generate_flux(None, 2, &cpu);
    // The tiny random Flux is far more sensitive to bf16 than the tiny UNet: diffusers' own
    // bf16 run is 0.29 off its f32 latents (image 0.70), and so is ours, yet the two bf16 runs
    // are within 2e-2 of each other. It is the transformer's arithmetic (not the weights'
    // rounding, see make_half.py, nor the text encoders'): eager torch and burn-flex both
    // accumulate in f32 and round each op's output to bf16 at the same op boundaries, so they
    // make the same roundings, which this random model amplifies. The bf16 bound comes from
    // the spread between torch's kernel sets instead (1.0e-2 latents, 1.2e-2 image).
    assert_matches_diffusers(
        "flux",
        &reference,
        &[
            (FloatDType::F16, HalfBound::FromF32Distance),
            (FloatDType::BF16, HalfBound::FromCpuSpread),
        ],
        |dtype| generate_flux(Some(dtype), 2, &cpu),
    );
}

fn generate_sd3(dtype: Option<FloatDType>, device: &OxiDevice) -> (Vec<f32>, Vec<f32>) {
    let options = LoadOptions {
        dtype,
        ..Default::default()
    };
    let mut pipe =
        StableDiffusion3Pipeline::<Oxi>::from_dir(&model_dir("tiny-sd3"), &options, device)
            .unwrap();
    let want = dtype.unwrap_or(FloatDType::F32);
    let t5 = pipe.text_encoder_3.as_ref().expect("tiny-sd3 has T5");
    for weight in [
        pipe.transformer.proj_out.weight.val().dtype(),
        pipe.transformer.context_embedder.weight.val().dtype(),
        pipe.text_encoder.token_embedding.weight.val().dtype(),
        pipe.text_encoder_2.token_embedding.weight.val().dtype(),
        t5.shared.weight.val().dtype(),
        pipe.vae.decoder.conv_in.weight.val().dtype(),
    ] {
        assert_eq!(FloatDType::from(weight), want, "weights not cast");
    }
    let req = Sd3Request {
        common: GenerateRequest {
            prompts: vec!["a red apple".into()],
            negative_prompts: vec!["blurry".into()],
            num_inference_steps: 2,
            width: Some(48),
            height: Some(32),
            seed: 3,
            ..Default::default()
        },
        max_sequence_length: 16,
        ..Default::default()
    };
    let out = pipe.generate(&req).unwrap();
    assert_eq!(
        FloatDType::from(out.latents.dtype()),
        FloatDType::F32,
        "latents stay f32"
    );
    let latents = out.latents.into_data().convert::<f32>().to_vec().unwrap();
    (latents, out.images.unwrap().data)
}

#[test]
fn sd3_bf16_and_f16_match_diffusers_half_runs_on_the_cpu() {
    let cpu = OxiDevice::Cpu;
    let reference = generate_sd3(None, &cpu);
    assert_matches_diffusers(
        "sd3",
        &reference,
        &[
            (FloatDType::F16, HalfBound::FromF32Distance),
            (FloatDType::BF16, HalfBound::FromF32Distance),
        ],
        |dtype| generate_sd3(Some(dtype), &cpu),
    );
}

fn generate_pixart(dtype: Option<FloatDType>, device: &OxiDevice) -> (Vec<f32>, Vec<f32>) {
    let options = LoadOptions {
        dtype,
        ..Default::default()
    };
    let mut pipe =
        PixArtPipeline::<Oxi>::from_dir(&model_dir("tiny-pixart-alpha"), &options, device).unwrap();
    let want = dtype.unwrap_or(FloatDType::F32);
    for weight in [
        pipe.transformer.proj_out.weight.val().dtype(),
        pipe.text_encoder.shared.weight.val().dtype(),
        pipe.vae.decoder.conv_in.weight.val().dtype(),
    ] {
        assert_eq!(FloatDType::from(weight), want, "weights not cast");
    }
    let req = PixArtRequest {
        common: GenerateRequest {
            prompts: vec!["a red apple".into()],
            negative_prompts: vec!["blurry".into()],
            num_inference_steps: 2,
            width: Some(32),
            height: Some(48),
            seed: 3,
            ..Default::default()
        },
        max_sequence_length: Some(16),
        resolution_binning: false,
    };
    let out = pipe.generate(&req).unwrap();
    assert_eq!(
        FloatDType::from(out.latents.dtype()),
        FloatDType::F32,
        "latents stay f32"
    );
    let latents = out.latents.into_data().convert::<f32>().to_vec().unwrap();
    (latents, out.images.unwrap().data)
}

#[test]
fn pixart_bf16_and_f16_match_diffusers_half_runs_on_the_cpu() {
    let cpu = OxiDevice::Cpu;
    let reference = generate_pixart(None, &cpu);
    // Before the group norms kept their statistics in f32 this VAE's f16 image was 0.51 off
    // (an f16 variance overflows).
    assert_matches_diffusers(
        "pixart",
        &reference,
        &[
            (FloatDType::F16, HalfBound::FromF32Distance),
            (FloatDType::BF16, HalfBound::FromF32Distance),
        ],
        |dtype| generate_pixart(Some(dtype), &cpu),
    );
}

#[test]
fn flux_f16_and_bf16_compiled_on_xla_cpu() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let device: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let (reference, _) = generate_flux(None, 2, &OxiDevice::Cpu);
    for dtype in [FloatDType::F16, FloatDType::BF16] {
        let options = LoadOptions {
            dtype: Some(dtype),
            ..Default::default()
        };
        let mut pipe =
            FluxPipeline::<Oxi>::from_dir(&model_dir("tiny-flux-dev"), &options, &device).unwrap();
        pipe.compile().unwrap();
        let mut req = flux_request(2);
        req.common.output = oxidiff::pipelines::OutputType::Latents;
        let out = pipe.generate(&req).unwrap();
        assert_eq!(FloatDType::from(out.latents.dtype()), FloatDType::F32);
        let compiled: Vec<f32> = out.latents.into_data().convert::<f32>().to_vec().unwrap();
        let err = relative_error(&compiled, &reference);
        eprintln!("flux {dtype:?} compiled xla:cpu vs f32 cpu: {err:e}");
        // Observed: f16 1.8e-3, bf16 2.0e-2. XLA's CPU compiler widens bf16 arithmetic to f32
        // between stores, so its bf16 run is much closer to f32 than burn-flex's eager one
        // (0.3 off, see above; the two bf16 runs differ by as much).
        let tolerance = if dtype == FloatDType::F16 { 1e-2 } else { 8e-2 };
        assert!(err > 0.0 && err <= tolerance, "{dtype:?}: {err:e}");
    }
}

/// A single-file pipeline (`tests/fixtures/single-file/NAME.safetensors`, configs from the
/// folder) with `dtype`: its latents and image.
fn generate_single_file(
    name: &str,
    dtype: Option<FloatDType>,
    device: &OxiDevice,
) -> (Vec<f32>, Vec<f32>) {
    let path = common::fixtures()
        .join("single-file")
        .join(format!("{name}.safetensors"));
    let options = SingleFileOptions {
        load: LoadOptions {
            dtype,
            ..Default::default()
        },
        config: Some(model_dir(name)),
        ..Default::default()
    };
    let want = dtype.unwrap_or(FloatDType::F32);
    let check = |weights: &[burn::tensor::DType]| {
        for w in weights {
            assert_eq!(FloatDType::from(*w), want, "{name}: weights not cast");
        }
    };
    let out = if name == "tiny-sdxl" {
        let mut pipe =
            StableDiffusionXLPipeline::<Oxi>::from_single_file(&path, &options, device).unwrap();
        check(&[
            pipe.unet.conv_in.weight.val().dtype(),
            pipe.vae.decoder.conv_in.weight.val().dtype(),
            pipe.text_encoder_2.token_embedding.weight.val().dtype(),
        ]);
        pipe.generate(&XlRequest::new(request())).unwrap()
    } else {
        let mut pipe =
            StableDiffusionPipeline::<Oxi>::from_single_file(&path, &options, device).unwrap();
        check(&[
            pipe.unet.conv_in.weight.val().dtype(),
            pipe.vae.decoder.conv_in.weight.val().dtype(),
            pipe.text_encoder.token_embedding.weight.val().dtype(),
        ]);
        pipe.generate(&request()).unwrap()
    };
    assert_eq!(FloatDType::from(out.latents.dtype()), FloatDType::F32);
    let latents = out.latents.into_data().convert::<f32>().to_vec().unwrap();
    (latents, out.images.unwrap().data)
}

#[test]
fn single_file_pipelines_in_f16_and_bf16_stay_as_close_to_f32_as_folders() {
    let cpu = OxiDevice::Cpu;
    // Against oxidiff's own f32 run (the single files hold f16-rounded weights, which
    // make_half.py's folder runs do not): bf16 keeps 8 mantissa bits, f16 11.
    for name in ["tiny-sd1", "tiny-sdxl"] {
        let reference = generate_single_file(name, None, &cpu);
        let cases = [(FloatDType::F16, 1.5e-2), (FloatDType::BF16, 8e-2)];
        assert_close_to_f32(&format!("{name} single file"), &reference, cases, |dtype| {
            generate_single_file(name, Some(dtype), &cpu)
        });
    }
}
