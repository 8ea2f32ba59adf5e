//! The whole SD3 pipeline against diffusers, step by step, on the CPU backend and on XLA's CPU
//! plugin (eager and compiled); a checkpoint without T5; the errors of broken SD3 folders.
//!
//! Fixtures of `tools/golden/make_tiny_sd3.py`: diffusers ran with the same initial latents,
//! FlowMatchEulerDiscrete with the folder's shift 3, guidance 5 with a negative prompt, 64x48.
//! Embeddings, latents and float images within 1e-4 relative (f32 on both sides; CLIP-L is
//! stored in fp16 and T5 in bf16, widened on load, as the reference used the same values);
//! 8-bit PNG pixels within 2 levels of diffusers' PNG.

mod common;

use std::cell::RefCell;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use common::{assert_close, fixtures, model_dir, relative_error, to_vec, Golden, B};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, Sd3Request, StableDiffusion3Pipeline};
use oxidiff::schedulers::NoNoise;
use oxidiff::{Oxi, OxiDevice, ToDevice};

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-sd3";

fn setting<'a>(golden: &'a Golden, key: &str) -> &'a serde_json::Value {
    &golden.json["pipeline"][key]
}

fn request<Bk: Backend>(golden: &Golden, device: &Bk::Device) -> Sd3Request<Bk> {
    let s = |key| setting(golden, key);
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    Sd3Request {
        common: GenerateRequest {
            prompts: vec![s("prompt").as_str().unwrap().into()],
            negative_prompts: vec![s("negative_prompt").as_str().unwrap().into()],
            num_inference_steps: s("num_inference_steps").as_u64().unwrap() as usize,
            guidance_scale: s("guidance_scale").as_f64().unwrap(),
            width: Some(s("width").as_u64().unwrap() as usize),
            height: Some(s("height").as_u64().unwrap() as usize),
            latents: Some(Tensor::from_data(TensorData::new(values, shape), device)),
            ..Default::default()
        },
        max_sequence_length: s("max_sequence_length").as_u64().unwrap() as usize,
        ..Default::default()
    }
}

fn load<Bk: Backend>(dir: &Path, device: &Bk::Device) -> StableDiffusion3Pipeline<Bk> {
    StableDiffusion3Pipeline::<Bk>::from_dir(dir, &LoadOptions::default(), device).unwrap()
}

/// A pipeline folder of links to the fixture's components, with `model_index.json` edited by
/// `index` and the components in `replace` linked elsewhere (`None`: left out).
fn assembled(
    index: impl FnOnce(&mut serde_json::Value),
    replace: &[(&str, Option<PathBuf>)],
) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let source = model_dir(NAME);
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if name == "model_index.json" {
            continue;
        }
        let target = match replace.iter().find(|(n, _)| *n == name) {
            Some((_, Some(other))) => other.clone(),
            Some((_, None)) => continue,
            None => entry.path(),
        };
        std::os::unix::fs::symlink(target, tmp.path().join(&name)).unwrap();
    }
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("model_index.json")).unwrap())
            .unwrap();
    index(&mut value);
    std::fs::write(tmp.path().join("model_index.json"), value.to_string()).unwrap();
    tmp
}

fn without_t5() -> tempfile::TempDir {
    assembled(
        |index| {
            index["text_encoder_3"] = serde_json::json!([null, null]);
            index["tokenizer_3"] = serde_json::json!([null, null]);
        },
        &[("text_encoder_3", None), ("tokenizer_3", None)],
    )
}

fn expected_timesteps(golden: &Golden) -> Vec<f64> {
    golden.json["timesteps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

#[test]
fn sd3_prompt_embeddings_match_diffusers() {
    let golden = Golden::load(NAME);
    let pipe = load::<B>(&model_dir(NAME), &Default::default());
    let max_len = setting(&golden, "max_sequence_length").as_u64().unwrap() as usize;
    for (side, key) in [("prompt", ""), ("negative_prompt", "negative_")] {
        let text = vec![setting(&golden, side).as_str().unwrap().to_string()];
        let embeds = pipe
            .encode_prompts(&text, &text, &text, 1, max_len)
            .unwrap();
        assert_close(
            &golden,
            &format!("encode.{key}prompt_embeds"),
            embeds.prompt_embeds,
            TOL,
        );
        assert_close(
            &golden,
            &format!("encode.{key}pooled_prompt_embeds"),
            embeds.pooled_prompt_embeds,
            TOL,
        );
    }
}

/// A `tracing` writer into a shared buffer, to read the pipeline's warnings.
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
fn sd3_long_prompt_is_truncated_with_a_warning_as_diffusers_does() {
    use tracing_subscriber::util::SubscriberInitExt;
    let golden = Golden::load(NAME);
    let pipe = load::<B>(&model_dir(NAME), &Default::default());
    let text = vec![golden.json["long_prompt"].as_str().unwrap().to_string()];
    let max_len = golden.json["long_max_sequence_length"].as_u64().unwrap() as usize;
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let embeds = {
        let _guard = subscriber.set_default();
        pipe.encode_prompts(&text, &text, &text, 1, max_len)
            .unwrap()
    };
    assert_eq!(embeds.prompt_embeds.dims(), [1, 77 + max_len, 32]);
    assert_close(&golden, "long.prompt_embeds", embeds.prompt_embeds, TOL);
    assert_close(
        &golden,
        "long.pooled_prompt_embeds",
        embeds.pooled_prompt_embeds,
        TOL,
    );
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains(&format!(
            "longer than max_sequence_length ({max_len} T5 tokens)"
        )),
        "{log}"
    );
    assert!(log.contains("longer than CLIP's 77 tokens"), "{log}");
}

#[test]
fn sd3_matches_diffusers_step_by_step() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe = load::<B>(&model_dir(NAME), &device);
    assert_eq!(pipe.default_size(), 64);
    let req = request::<B>(&golden, &device);
    let steps = RefCell::new(Vec::new());
    let out = pipe
        .generate_with(&req, &mut NoNoise, |info| {
            steps
                .borrow_mut()
                .push((info.timestep, info.latents.clone()))
        })
        .unwrap();
    let steps = steps.into_inner();
    let timesteps: Vec<f64> = steps.iter().map(|(t, _)| *t).collect();
    let expected = expected_timesteps(&golden);
    assert_eq!(timesteps.len(), expected.len());
    for (ours, theirs) in timesteps.iter().zip(&expected) {
        assert!(
            (ours - theirs).abs() < 1e-3,
            "{timesteps:?} vs {expected:?}"
        );
    }
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(&golden, &format!("pipe.step{i}"), latents, TOL);
    }
    let images = out.images.unwrap();
    assert_eq!((images.width, images.height), (48, 64));
    let (reference, _) = golden.host("pipe.image");
    let err = relative_error(&images.data, &reference);
    eprintln!("pipe.image: relative error {err:e}");
    assert!(err <= TOL, "image relative error {err:e}");
    common::assert_png_close(&images.to_rgb8(0).unwrap(), &format!("{NAME}.png"), 2);
}

#[test]
fn sd3_batch_of_prompts_and_images_keeps_each_row_its_own() {
    // Two prompts, two images each: rows [p0, p0, p1, p1] (diffusers' repeat order), each
    // image guided by its own prompt. Row 0 starts from diffusers' latents and must end as
    // diffusers' single-prompt run does; row 2 (the other prompt, same start) must not.
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe = load::<B>(&model_dir(NAME), &device);
    let mut req = request::<B>(&golden, &device);
    let start: Tensor<B, 4> = golden.tensor("pipe.latents");
    let other = start.clone().mul_scalar(-1.0);
    req.common.latents = Some(Tensor::cat(
        vec![start.clone(), other, start.clone(), start],
        0,
    ));
    req.common.prompts.push("a red cube on a table".into());
    req.common.num_images_per_prompt = 2;
    req.common.output = oxidiff::pipelines::OutputType::Latents;
    let out = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    assert_eq!(out.latents.dims(), [4, 16, 8, 6]);
    let last = expected_timesteps(&golden).len() - 1;
    let key = format!("pipe.step{last}");
    assert_close(&golden, &key, out.latents.clone().narrow(0, 0, 1), TOL);
    let (reference, _) = golden.host(&key);
    let err = relative_error(&to_vec(out.latents.narrow(0, 2, 1)), &reference);
    assert!(err > 1e-2, "the second prompt changed nothing: {err:e}");
}

#[test]
fn sd3_with_dynamic_shifting_matches_diffusers() {
    // `use_dynamic_shifting: true`: mu from the image's 4x3 patch tokens, as the pipeline
    // computes it for diffusers' scheduler.
    let golden = Golden::load(NAME);
    let device = Default::default();
    let scheduler = tempfile::tempdir().unwrap();
    let config_path = model_dir(NAME).join("scheduler/scheduler_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(config_path).unwrap()).unwrap();
    config["use_dynamic_shifting"] = serde_json::json!(true);
    std::fs::write(
        scheduler.path().join("scheduler_config.json"),
        config.to_string(),
    )
    .unwrap();
    let dir = assembled(|_| {}, &[("scheduler", Some(scheduler.path().into()))]);
    let mut pipe = load::<B>(dir.path(), &device);
    let mut req = request::<B>(&golden, &device);
    req.common.output = oxidiff::pipelines::OutputType::Latents;
    let timesteps = RefCell::new(Vec::new());
    let out = pipe
        .generate_with(&req, &mut NoNoise, |info| {
            timesteps.borrow_mut().push(info.timestep)
        })
        .unwrap();
    let expected = golden.json["dynamic_timesteps"].as_array().unwrap();
    let timesteps = timesteps.into_inner();
    assert_eq!(timesteps.len(), expected.len());
    for (ours, theirs) in timesteps.iter().zip(expected) {
        let theirs = theirs.as_f64().unwrap();
        assert!(
            (ours - theirs).abs() < 1e-3,
            "{timesteps:?} vs {expected:?}"
        );
    }
    assert_close(&golden, "dynamic.final", out.latents, TOL);
}

#[test]
fn sd35_transformer_in_the_pipeline_with_and_without_skip_layer_guidance_matches_diffusers() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let dir = assembled(
        |_| {},
        &[(
            "transformer",
            Some(fixtures().join("tiny-sd35-transformer")),
        )],
    );
    let mut pipe = load::<B>(dir.path(), &device);
    let mut req = request::<B>(&golden, &device);
    req.common.output = oxidiff::pipelines::OutputType::Latents;
    let out = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    assert_close(&golden, "pipe_sd35.final", out.latents, TOL);

    // Skip-layer guidance, as diffusers' `skip_guidance_layers`.
    let slg = &golden.json["skip_layer_guidance"];
    let number = |key: &str| slg[key].as_f64().unwrap();
    req.skip_guidance_layers = vec![1];
    assert_eq!(slg["skip_guidance_layers"], serde_json::json!([1]));
    req.skip_layer_guidance_scale = number("skip_layer_guidance_scale");
    req.skip_layer_guidance_start = number("skip_layer_guidance_start");
    req.skip_layer_guidance_stop = number("skip_layer_guidance_stop");
    let out = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    assert_close(&golden, "pipe_sd35_slg.final", out.latents, TOL);
    req.skip_guidance_layers = vec![3];
    let message = pipe.generate(&req).unwrap_err().to_string();
    assert!(message.contains("skip layer 3 does not exist"), "{message}");
}

#[test]
fn sd3_without_t5_uses_zeros_as_diffusers_does() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let dir = without_t5();
    let mut pipe = load::<B>(dir.path(), &device);
    assert!(pipe.text_encoder_3.is_none() && pipe.tokenizer_3.is_none());
    let max_len = setting(&golden, "max_sequence_length").as_u64().unwrap() as usize;
    let text = vec![setting(&golden, "prompt").as_str().unwrap().to_string()];
    let embeds = pipe
        .encode_prompts(&text, &text, &text, 1, max_len)
        .unwrap();
    assert_close(&golden, "no_t5.prompt_embeds", embeds.prompt_embeds, TOL);
    let mut req = request::<B>(&golden, &device);
    req.common.output = oxidiff::pipelines::OutputType::Latents;
    let out = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    assert_close(&golden, "no_t5.final", out.latents, TOL);
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

/// The last step's latents and the image of a run on `pipe` against diffusers'.
fn assert_run_matches(golden: &Golden, pipe: &mut StableDiffusion3Pipeline<Oxi>, what: &str) {
    let device = pipe.device.clone();
    let req = request::<Oxi>(golden, &device);
    let out = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    let last = expected_timesteps(golden).len() - 1;
    let (reference, _) = golden.host(&format!("pipe.step{last}"));
    let err = relative_error(&to_vec(out.latents.to_device(&OxiDevice::Cpu)), &reference);
    eprintln!("{what}: final latents relative error {err:e}");
    assert!(err <= TOL, "{what}: final latents relative error {err:e}");
    let (reference, _) = golden.host("pipe.image");
    let images = out.images.unwrap();
    let err = relative_error(&images.data, &reference);
    eprintln!("{what}: image relative error {err:e}");
    assert!(err <= TOL, "{what}: image relative error {err:e}");
    common::assert_png_close(&images.to_rgb8(0).unwrap(), &format!("{NAME}.png"), 2);
}

#[test]
fn sd3_on_xla_cpu_eager_matches_diffusers() {
    let Some(device) = xla_device() else { return };
    let golden = Golden::load(NAME);
    let mut pipe = load::<Oxi>(&model_dir(NAME), &OxiDevice::Cpu).to(&device);
    assert_run_matches(&golden, &mut pipe, "xla:cpu eager");

    // The three text encoders handed back after each request and uploaded again.
    pipe.offload = oxidiff::pipelines::Offload::TextEncoders;
    let client = oxidiff::backend::pjrt_client(&device).unwrap();
    for request in 0..2 {
        let before = client.stats().released_bytes;
        assert_run_matches(&golden, &mut pipe, &format!("offload, request {request}"));
        assert!(
            client.stats().released_bytes > before,
            "request {request}: nothing handed back"
        );
    }
}

#[test]
fn sd3_on_xla_cpu_compiled_matches_diffusers_and_compiles_once() {
    let Some(device) = xla_device() else { return };
    let golden = Golden::load(NAME);
    // The text encoders stay on the host (as T5-XXL would), the transformer and VAE on XLA.
    let mut pipe = load::<Oxi>(&model_dir(NAME), &OxiDevice::Cpu).to_components(
        &OxiDevice::Cpu,
        &device,
        &device,
    );
    pipe.compile().unwrap();
    assert_run_matches(&golden, &mut pipe, "xla:cpu compiled");
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(1),
        "one program for every step"
    );
    let mut other = request::<Oxi>(&golden, &device);
    other.common.num_inference_steps = 1;
    other.common.prompts = vec!["another prompt".into()];
    other.common.guidance_scale = 3.0;
    other.common.latents = None;
    other.common.seed = 7;
    pipe.generate(&other).unwrap();
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(1),
        "a new prompt, seed and guidance scale reuse the program"
    );
}

// ------------------------------------------------------------------------------ bad input

fn load_error(dir: &Path) -> String {
    match StableDiffusion3Pipeline::<B>::from_dir(dir, &LoadOptions::default(), &Default::default())
    {
        Ok(_) => panic!("a broken folder loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn sd3_missing_required_components_are_named() {
    for name in [
        "vae",
        "transformer",
        "text_encoder_2",
        "tokenizer",
        "scheduler",
    ] {
        let dir = assembled(|_| {}, &[(name, None)]);
        let message = load_error(dir.path());
        assert!(message.contains(&format!("`{name}`")), "{name}: {message}");
    }
    // Listed in model_index.json but its folder is gone: not the same as leaving T5 out.
    let dir = assembled(|_| {}, &[("text_encoder_3", None)]);
    let message = load_error(dir.path());
    assert!(message.contains("`text_encoder_3`"), "{message}");
    // A required component set to null.
    let dir = assembled(
        |index| index["text_encoder"] = serde_json::json!([null, null]),
        &[("text_encoder", None)],
    );
    let message = load_error(dir.path());
    assert!(
        message.contains("`text_encoder` is null") && message.contains("needs it"),
        "{message}"
    );
    // Half of T5 left out.
    let dir = assembled(
        |index| index["tokenizer_3"] = serde_json::json!([null, null]),
        &[("tokenizer_3", None)],
    );
    let message = load_error(dir.path());
    assert!(message.contains("tokenizer_3"), "{message}");
}

#[test]
fn sd3_bad_requests_are_clear_errors() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe = load::<B>(&model_dir(NAME), &device);
    let mut req = request::<B>(&golden, &device);
    req.common.latents = None;
    req.max_sequence_length = 513;
    let message = pipe.generate(&req).unwrap_err().to_string();
    assert!(message.contains("max_sequence_length"), "{message}");
    req.max_sequence_length = 24;
    req.common.width = Some(40);
    let message = pipe.generate(&req).unwrap_err().to_string();
    assert!(message.contains("multiples of 16"), "{message}");
    // 13 patches of 2 rows of latents: beyond the transformer's pos_embed_max_size of 12.
    req.common.width = Some(48);
    req.common.height = Some(208);
    let message = pipe.generate(&req).unwrap_err().to_string();
    assert!(message.contains("pos_embed_max_size"), "{message}");
    req.common.height = Some(64);
    req.prompts_2 = vec!["a".into(), "b".into()];
    let message = pipe.generate(&req).unwrap_err().to_string();
    assert!(
        message.contains("2 second prompts for 1 prompts"),
        "{message}"
    );
}
