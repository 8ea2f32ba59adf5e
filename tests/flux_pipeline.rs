//! The whole Flux pipeline against diffusers, step by step: dev (guidance embedding, dynamic
//! shift, latents from the seed), dev with true classifier-free guidance, and schnell (no
//! guidance embedding, no shift, latents given), on the CPU backend; dev on XLA's CPU plugin,
//! eager and compiled; and the errors of broken folders and requests.
//!
//! Fixtures of `tools/golden/make_tiny_flux.py`. Latents and float images within 1e-4 relative
//! (f32 on both sides, different summation orders); 8-bit PNG pixels within 2 levels of
//! diffusers' PNG.

mod common;

use std::cell::RefCell;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use common::{assert_close, copy_dir, model_dir, relative_error, to_vec, Golden, B};
use oxidiff::pipelines::flux::pack_latents;
use oxidiff::pipelines::{FluxPipeline, FluxRequest, GenerateRequest, LoadOptions};
use oxidiff::schedulers::TorchCpuGenerator;
use oxidiff::{Oxi, OxiDevice, ToDevice};

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-flux";

fn load<Bk: Backend>(variant: &str, device: &Bk::Device) -> FluxPipeline<Bk> {
    FluxPipeline::<Bk>::from_dir(
        &model_dir(&format!("tiny-flux-{variant}")),
        &LoadOptions::default(),
        device,
    )
    .unwrap()
}

/// The request of golden run `key` (`dev`, `dev_true_cfg`, `schnell`).
fn request<Bk: Backend>(golden: &Golden, key: &str) -> FluxRequest<Bk> {
    let s = &golden.json[key];
    let int = |k: &str| s[k].as_u64().unwrap() as usize;
    FluxRequest {
        common: GenerateRequest {
            prompts: vec![s["prompt"].as_str().unwrap().into()],
            negative_prompts: s["negative_prompt"]
                .as_str()
                .map(|n| vec![n.to_string()])
                .unwrap_or_default(),
            num_inference_steps: int("num_inference_steps"),
            guidance_scale: s["guidance_scale"].as_f64().unwrap(),
            width: Some(int("width")),
            height: Some(int("height")),
            seed: s["seed"].as_u64().unwrap_or(0),
            ..Default::default()
        },
        max_sequence_length: int("max_sequence_length"),
        true_cfg_scale: s["true_cfg_scale"].as_f64().unwrap_or(1.0),
        ..Default::default()
    }
}

/// Runs `req` and compares timesteps, every step's (packed) latents, the float image and the
/// PNG with golden run `tag`.
fn assert_matches_golden<Bk: Backend>(
    golden: &Golden,
    pipe: &mut FluxPipeline<Bk>,
    req: &FluxRequest<Bk>,
    tag: &str,
) {
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.common.seed);
    let out = pipe
        .generate_with(req, &mut generator, |info| {
            steps
                .borrow_mut()
                .push((info.timestep, pack_latents(info.latents.clone())))
        })
        .unwrap();
    let expected: Vec<f64> = golden.json[format!("{tag}.timesteps")]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let steps = steps.into_inner();
    let ours: Vec<f64> = steps.iter().map(|(t, _)| *t).collect();
    assert_eq!(ours.len(), expected.len());
    for (a, e) in ours.iter().zip(&expected) {
        // diffusers' timesteps are f32 `sigma * 1000`.
        assert!((a - e).abs() <= 1e-3, "timesteps {ours:?} vs {expected:?}");
    }
    let sigmas: Vec<f64> = golden.json[format!("{tag}.sigmas")]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let ours = pipe.scheduler.sigmas().expect("flow matching has sigmas");
    assert_eq!(ours.len(), sigmas.len());
    for (a, e) in ours.iter().zip(&sigmas) {
        assert!((a - e).abs() <= 1e-6, "sigmas {ours:?} vs {sigmas:?}");
    }
    let cpu = Default::default();
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        let latents: Tensor<B, 3> = Tensor::from_data(latents.into_data(), &cpu);
        assert_close(golden, &format!("{tag}.step{i}"), latents, TOL);
    }
    let images = out.images.unwrap();
    let (reference, shape) = golden.host(&format!("{tag}.image"));
    assert_eq!((images.height, images.width), (shape[1], shape[2]));
    let err = relative_error(&images.data, &reference);
    eprintln!("{tag}.image: relative error {err:e}");
    assert!(err <= TOL, "{tag} image relative error {err:e}");
    common::assert_png_close(&images.to_rgb8(0).unwrap(), &format!("{NAME}-{tag}.png"), 2);
}

#[test]
fn flux_dev_with_guidance_embedding_matches_diffusers_step_by_step() {
    let golden = Golden::load(NAME);
    let mut pipe = load::<B>("dev", &Default::default());
    assert!(pipe.guidance_embeds());
    let req = request(&golden, "dev");
    assert_matches_golden(&golden, &mut pipe, &req, "dev");
}

#[test]
fn flux_dev_with_true_cfg_and_negative_prompt_matches_diffusers() {
    let golden = Golden::load(NAME);
    let mut pipe = load::<B>("dev", &Default::default());
    let req = request(&golden, "dev_true_cfg");
    assert!(FluxPipeline::does_true_cfg(&req));
    assert_matches_golden(&golden, &mut pipe, &req, "dev-true-cfg");
}

#[test]
fn flux_schnell_without_guidance_embedding_matches_diffusers() {
    let golden = Golden::load(NAME);
    let mut pipe = load::<B>("schnell", &Default::default());
    assert!(!pipe.guidance_embeds());
    let mut req = request(&golden, "schnell");
    req.common.latents = Some(golden.tensor("schnell.initial_latents"));
    assert_matches_golden(&golden, &mut pipe, &req, "schnell");
}

#[test]
fn seeded_latents_are_diffusers_draw() {
    let golden = Golden::load(NAME);
    let mut pipe = load::<B>("dev", &Default::default());
    let mut req = request::<B>(&golden, "dev");
    req.common.output = oxidiff::pipelines::OutputType::Latents;
    req.common.num_inference_steps = 1;
    let steps = RefCell::new(0);
    // The first draw of the seeded generator is diffusers' `randn_tensor` of shape
    // [1, 16, 8, 12]; with `latents` given the same tensor, one step gives the same result.
    let a = pipe
        .generate_with(&req, &mut TorchCpuGenerator::new(req.common.seed), |_| {
            *steps.borrow_mut() += 1
        })
        .unwrap();
    req.common.latents = Some(golden.tensor("dev.initial_latents"));
    let b = pipe.generate(&req).unwrap();
    assert_eq!(*steps.borrow(), 1);
    assert_eq!(to_vec(a.latents), to_vec(b.latents));
}

#[test]
fn two_images_per_prompt_each_match_the_single_run() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe = load::<B>("dev", &device);
    let mut req = request::<B>(&golden, "dev");
    req.common.num_images_per_prompt = 2;
    let initial: Tensor<B, 4> = golden.tensor("dev.initial_latents");
    req.common.latents = Some(Tensor::cat(vec![initial.clone(), initial], 0));
    req.common.output = oxidiff::pipelines::OutputType::Latents;
    let steps = RefCell::new(Vec::new());
    pipe.generate_with(&req, &mut TorchCpuGenerator::new(0), |info| {
        steps.borrow_mut().push(pack_latents(info.latents.clone()))
    })
    .unwrap();
    for (i, latents) in steps.into_inner().into_iter().enumerate() {
        assert_eq!(latents.dims()[0], 2);
        for row in 0..2 {
            assert_close(
                &golden,
                &format!("dev.step{i}"),
                latents.clone().narrow(0, row, 1),
                TOL,
            );
        }
    }
}

/// A `tracing` writer into a shared buffer, to see the pipeline's warnings.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn long_prompt_is_cut_to_max_sequence_length_with_a_warning() {
    use tracing_subscriber::util::SubscriberInitExt;
    let golden = Golden::load(NAME);
    let pipe = load::<B>("dev", &Default::default());
    let long = golden.json["long_prompt"].as_str().unwrap().to_string();
    let max_len = golden.json["dev"]["max_sequence_length"].as_u64().unwrap() as usize;
    let captured = Captured::default();
    let writer = captured.clone();
    let embeds = {
        let _guard = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish()
            .set_default();
        pipe.encode_prompts(&[long], &[], 1, max_len).unwrap()
    };
    assert_eq!(embeds.prompt_embeds.dims()[1], max_len);
    assert_close(&golden, "long.prompt_embeds", embeds.prompt_embeds, TOL);
    assert_close(
        &golden,
        "long.pooled_prompt_embeds",
        embeds.pooled_prompt_embeds,
        TOL,
    );
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("WARN") && log.contains("max_sequence_length (24 T5 tokens)"),
        "{log}"
    );
    assert!(log.contains("CLIP's 77 tokens"), "{log}");
}

fn xla_device() -> Option<OxiDevice> {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return None;
    }
    Some(
        "xla:cpu:0".parse().unwrap_or_else(|e| {
            panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh")
        }),
    )
}

#[test]
fn flux_dev_on_xla_cpu_eager_matches_diffusers() {
    let Some(device) = xla_device() else { return };
    let golden = Golden::load(NAME);
    let mut pipe = load::<Oxi>("dev", &OxiDevice::Cpu).to(&device);
    let req = request(&golden, "dev");
    assert_matches_golden(&golden, &mut pipe, &req, "dev");

    // CLIP and T5 handed back after each request and uploaded again.
    pipe.offload = oxidiff::pipelines::Offload::TextEncoders;
    let client = oxidiff::backend::pjrt_client(&device).unwrap();
    for request in 0..2 {
        let before = client.stats().released_bytes;
        assert_matches_golden(&golden, &mut pipe, &req, "dev");
        assert!(
            client.stats().released_bytes > before,
            "request {request}: nothing handed back"
        );
    }
}

#[test]
fn flux_compiled_on_xla_cpu_matches_diffusers_and_reuses_its_program() {
    let Some(device) = xla_device() else { return };
    let golden = Golden::load(NAME);
    let mut pipe = load::<Oxi>("dev", &OxiDevice::Cpu).to(&device);
    pipe.compile().unwrap();
    let req = request(&golden, "dev");
    assert_matches_golden(&golden, &mut pipe, &req, "dev");
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(1));
    let mut other = request::<Oxi>(&golden, "dev");
    other.common.prompts = vec!["another prompt".into()];
    other.common.seed = 7;
    other.common.guidance_scale = 5.0;
    other.common.num_inference_steps = 1;
    other.common.output = oxidiff::pipelines::OutputType::Latents;
    pipe.generate(&other).unwrap();
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(1),
        "a new prompt, seed, guidance and step count reuse the program"
    );
    // schnell has no guidance input to use: its compiled step ignores the scale.
    let mut schnell = load::<Oxi>("schnell", &OxiDevice::Cpu).to(&device);
    schnell.compile().unwrap();
    let mut req = request::<Oxi>(&golden, "schnell");
    req.common.latents = Some(Tensor::from_data(
        golden.tensor::<4>("schnell.initial_latents").into_data(),
        &device,
    ));
    assert_matches_golden(&golden, &mut schnell, &req, "schnell");
}

// ------------------------------------------------------------------------------ bad input

fn load_error(damage: impl FnOnce(&Path)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&model_dir("tiny-flux-dev"), &model);
    damage(&model);
    match FluxPipeline::<B>::from_dir(&model, &LoadOptions::default(), &Default::default()) {
        Ok(_) => panic!("a damaged folder loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_components_are_named() {
    for part in [
        "text_encoder_2",
        "tokenizer_2",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
        "scheduler",
    ] {
        let err = load_error(|m| std::fs::remove_dir_all(m.join(part)).unwrap());
        assert!(
            err.contains(&format!("no `{part}` folder")),
            "{part}: {err}"
        );
    }
    let err = load_error(|m| {
        std::fs::remove_file(m.join("transformer/diffusion_pytorch_model.safetensors")).unwrap()
    });
    assert!(
        err.contains("transformer") && err.contains("diffusion_pytorch_model"),
        "{err}"
    );
}

#[test]
fn transformer_config_that_does_not_match_the_weights_names_the_key() {
    let err = load_error(|m| {
        let path = m.join("transformer/config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(
            &path,
            text.replace(
                "\"pooled_projection_dim\": 8",
                "\"pooled_projection_dim\": 12",
            ),
        )
        .unwrap();
    });
    assert!(
        err.contains("time_text_embed.text_embedder.linear_1.weight"),
        "{err}"
    );
}

#[test]
fn bad_requests_are_clear_errors() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe = load::<B>("dev", &device);
    let mut req = request::<B>(&golden, "dev");
    req.common.width = Some(72);
    let err = pipe.generate(&req).unwrap_err().to_string();
    assert!(err.contains("multiples of 16"), "{err}");
    let mut req = request::<B>(&golden, "dev");
    req.max_sequence_length = 513;
    let err = pipe.generate(&req).unwrap_err().to_string();
    assert!(err.contains("max_sequence_length"), "{err}");
    let mut req = request::<B>(&golden, "dev");
    req.common.latents = Some(Tensor::zeros([1, 4, 8, 12], &device));
    let err = pipe.generate(&req).unwrap_err().to_string();
    assert!(err.contains("[1, 16, 8, 12]"), "{err}");
}

#[test]
fn txt2img_picks_flux_by_class_name_and_makes_diffusers_png() {
    let golden = Golden::load(NAME);
    let s = &golden.json["dev"];
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("flux.png");
    let text = |k: &str| s[k].to_string().trim_matches('"').to_string();
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_txt2img"))
            .args(["--model", model_dir("tiny-flux-dev").to_str().unwrap()])
            .args(["--steps", &text("num_inference_steps")])
            .args(["--seed", &text("seed")])
            .args(["--width", &text("width"), "--height", &text("height")])
            .args(["--max-sequence-length", &text("max_sequence_length")])
            .args(["-o", out.to_str().unwrap()])
            .args(extra)
            .arg(text("prompt"))
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let result = run(&[]);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{stderr}");
    // Default guidance 3.5, diffusers' FluxPipeline default, is the golden run's.
    assert!(stderr.contains("guidance 3.5"), "{stderr}");
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, &format!("{NAME}-dev.png"), 2);
    // PixArt's switch is refused for Flux.
    let result = run(&["--force", "--no-resolution-binning"]);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        !result.status.success() && stderr.contains("PixArt"),
        "{stderr}"
    );
}
