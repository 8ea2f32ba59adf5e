//! The whole PixArt-Alpha pipeline against diffusers, step by step, on the CPU backend and on
//! XLA's CPU plugin (eager PJRT); and the errors of broken PixArt folders.
//!
//! diffusers ran with the same initial latents, resolution binning on (200x128 is generated at
//! the bin's 304x208 and resized back), DPM-Solver++ 2M from the folder. Latents and float
//! images within 1e-4 relative (f32 on both sides); 8-bit PNG pixels within 2 levels of
//! diffusers' PNG.

mod common;

use std::cell::RefCell;
use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use common::{assert_close, copy_dir, model_dir, relative_error, to_vec, Golden, B};
use oxidiff::pipelines::{
    GenerateRequest, LoadOptions, OutputType, PixArtPipeline, PixArtRequest, PixArtVariant,
};
use oxidiff::schedulers::NoNoise;
use oxidiff::{Oxi, OxiDevice, ToDevice};

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-pixart-alpha";

fn request<Bk: Backend>(golden: &Golden, device: &Bk::Device) -> PixArtRequest<Bk> {
    let s = &golden.json["pipeline"];
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    PixArtRequest {
        common: GenerateRequest {
            prompts: vec![s["prompt"].as_str().unwrap().into()],
            negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
            num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
            guidance_scale: s["guidance_scale"].as_f64().unwrap(),
            width: Some(s["width"].as_u64().unwrap() as usize),
            height: Some(s["height"].as_u64().unwrap() as usize),
            latents: Some(Tensor::from_data(TensorData::new(values, shape), device)),
            ..Default::default()
        },
        max_sequence_length: Some(s["max_sequence_length"].as_u64().unwrap() as usize),
        resolution_binning: s["use_resolution_binning"].as_bool().unwrap(),
    }
}

#[test]
fn pixart_alpha_with_binning_matches_diffusers_step_by_step() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe =
        PixArtPipeline::<B>::from_dir(&model_dir(NAME), &LoadOptions::default(), &device).unwrap();
    let req = request::<B>(&golden, &device);
    let (requested, generated) = pipe.sizes(&req).unwrap();
    assert_eq!(requested, (128, 200));
    let binned = (
        golden.json["binned_width"].as_u64().unwrap() as usize,
        golden.json["binned_height"].as_u64().unwrap() as usize,
    );
    assert_eq!(generated, binned, "the 256 bin of 200x128");

    let steps = RefCell::new(Vec::new());
    let out = pipe
        .generate_with(&req, &mut NoNoise, |info| {
            steps
                .borrow_mut()
                .push((info.timestep, info.latents.clone()))
        })
        .unwrap();
    let expected: Vec<f64> = golden.json["timesteps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let steps = steps.into_inner();
    assert_eq!(steps.iter().map(|(t, _)| *t).collect::<Vec<_>>(), expected);
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(&golden, &format!("pipe.step{i}"), latents, TOL);
    }
    let images = out.images.unwrap();
    assert_eq!((images.width, images.height), (128, 200));
    let (reference, _) = golden.host("pipe.image");
    let err = relative_error(&images.data, &reference);
    eprintln!("pipe.image: relative error {err:e}");
    assert!(err <= TOL, "image relative error {err:e}");
    common::assert_png_close(&images.to_rgb8(0).unwrap(), &format!("{NAME}.png"), 2);
}

#[test]
fn resolution_binning_can_be_switched_off() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe =
        PixArtPipeline::<B>::from_dir(&model_dir(NAME), &LoadOptions::default(), &device).unwrap();
    let mut req = request::<B>(&golden, &device);
    req.resolution_binning = false;
    req.common.latents = None;
    req.common.num_inference_steps = 1;
    req.common.width = Some(64);
    req.common.height = Some(48);
    assert_eq!(pipe.sizes(&req).unwrap(), ((64, 48), (64, 48)));
    let out = pipe.generate(&req).unwrap();
    assert_eq!(out.latents.dims(), [1, 4, 6, 8]);
    let images = out.images.unwrap();
    assert_eq!((images.width, images.height), (64, 48));
    // Off, a size that does not divide into 2x2 latent patches is an error; on, it is binned.
    req.common.height = Some(40);
    req.common.width = Some(100);
    let err = pipe.sizes(&req).unwrap_err().to_string();
    assert!(err.contains("multiples of 16"), "{err}");
    req.resolution_binning = true;
    assert_eq!(
        pipe.sizes(&req).unwrap().1,
        (400, 160),
        "the 0.4 bin of 100x40"
    );
}

#[test]
fn pixart_on_xla_cpu_matches_cpu() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load(NAME);
    let cpu = OxiDevice::Cpu;
    let mut pipe =
        PixArtPipeline::<Oxi>::from_dir(&model_dir(NAME), &LoadOptions::default(), &cpu).unwrap();
    let mut req = request::<Oxi>(&golden, &cpu);
    req.common.num_inference_steps = 2;
    let on_cpu = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();

    let device: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let mut pipe = pipe.to(&device);
    let on_xla = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    let reference = to_vec(on_cpu.latents);
    let err = relative_error(&to_vec(on_xla.latents.to_device(&cpu)), &reference);
    eprintln!("xla:cpu vs cpu latents: relative error {err:e}");
    assert!(err <= TOL, "xla:cpu vs cpu latents: relative error {err:e}");
    let expected = on_cpu.images.unwrap().data;
    let err = relative_error(&on_xla.images.unwrap().data, &expected);
    eprintln!("xla:cpu vs cpu image: relative error {err:e}");
    assert!(err <= TOL, "xla:cpu vs cpu image: relative error {err:e}");

    // Compiled: one program for the transformer call, reused by a new prompt and seed.
    pipe.compile().unwrap();
    let compiled = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    let err = relative_error(&to_vec(compiled.latents.to_device(&cpu)), &reference);
    eprintln!("compiled xla:cpu vs cpu latents: relative error {err:e}");
    assert!(
        err <= TOL,
        "compiled vs cpu latents: relative error {err:e}"
    );
    let err = relative_error(&compiled.images.unwrap().data, &expected);
    assert!(err <= TOL, "compiled vs cpu image: relative error {err:e}");
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(1));

    let mut other = request::<Oxi>(&golden, &device);
    other.common.num_inference_steps = 1;
    other.common.prompts = vec!["another prompt".into()];
    other.common.latents = None;
    other.common.seed = 7;
    pipe.generate(&other).unwrap();
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(1),
        "a new prompt and seed reuse the program"
    );

    // T5 handed back after each request and uploaded again (its token table then looked up
    // on the host): the same image, bit for bit. In bf16, so that the fixture's bf16 T5 is
    // used in the file's own bytes (a weight converted at load has no file to come back from,
    // and stays).
    let options = LoadOptions {
        dtype: Some(burn::tensor::FloatDType::BF16),
        ..Default::default()
    };
    let mut pipe = PixArtPipeline::<Oxi>::from_dir(&model_dir(NAME), &options, &device).unwrap();
    let kept = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    let kept = kept.images.unwrap().data;
    pipe.offload = oxidiff::pipelines::Offload::TextEncoders;
    let client = oxidiff::backend::pjrt_client(&device).unwrap();
    for request in 0..2 {
        let before = client.stats().released_bytes;
        let image = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
        assert!(
            image.images.unwrap().data == kept,
            "request {request}: offload changed the image"
        );
        assert!(
            client.stats().released_bytes > before,
            "request {request}: nothing was handed back"
        );
    }
}

// ------------------------------------------------------------------------------ bad input

/// Loads a damaged copy of the fixture and returns the error message.
fn load_error(damage: impl FnOnce(&Path)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&model_dir(NAME), &model);
    damage(&model);
    let device = Default::default();
    match PixArtPipeline::<B>::from_dir(&model, &LoadOptions::default(), &device) {
        Ok(_) => panic!("a damaged folder loaded"),
        Err(e) => e.to_string(),
    }
}

fn edit(file: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(file).unwrap();
    assert!(text.contains(from), "{} has no {from:?}", file.display());
    std::fs::write(file, text.replace(from, to)).unwrap();
}

#[test]
fn missing_t5_weights_name_the_folder() {
    let err =
        load_error(|m| std::fs::remove_file(m.join("text_encoder/model.safetensors")).unwrap());
    assert!(
        err.contains("text_encoder") && err.contains("model.safetensors"),
        "{err}"
    );
    let err = load_error(|m| std::fs::remove_dir_all(m.join("text_encoder")).unwrap());
    assert!(err.contains("no `text_encoder` folder"), "{err}");
}

#[test]
fn t5_config_that_does_not_match_the_weights_names_the_key() {
    let err = load_error(|m| {
        edit(
            &m.join("text_encoder/config.json"),
            "\"d_ff\": 37",
            "\"d_ff\": 40",
        )
    });
    assert!(
        err.contains("DenseReluDense.wi_0.weight")
            && err.contains("[40, 32]")
            && err.contains("[37, 32]"),
        "{err}"
    );
}

#[test]
fn transformer_config_that_does_not_match_the_weights_names_the_key() {
    let err = load_error(|m| {
        edit(
            &m.join("transformer/config.json"),
            "\"caption_channels\": 32",
            "\"caption_channels\": 48",
        )
    });
    assert!(err.contains("caption_projection.linear_1.weight"), "{err}");
}

#[test]
fn t5_tokenizer_without_tokenizer_json_says_how_to_convert() {
    let err = load_error(|m| {
        std::fs::remove_file(m.join("tokenizer/tokenizer.json")).unwrap();
        std::fs::write(m.join("tokenizer/spiece.model"), b"").unwrap();
    });
    assert!(
        err.contains("spiece.model") && err.contains("save_pretrained"),
        "{err}"
    );
}

#[test]
fn unknown_pipeline_class_is_refused_with_the_supported_ones() {
    let err = load_error(|m| {
        edit(
            &m.join("model_index.json"),
            "PixArtAlphaPipeline",
            "PixArtFooPipeline",
        )
    });
    assert!(
        err.contains("PixArtFooPipeline") && err.contains("PixArtSigmaPipeline"),
        "{err}"
    );
}

#[test]
fn bad_requests_are_clear_errors() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let mut pipe =
        PixArtPipeline::<B>::from_dir(&model_dir(NAME), &LoadOptions::default(), &device).unwrap();
    let mut req = request::<B>(&golden, &device);
    req.common.latents = Some(Tensor::zeros([1, 4, 8, 8], &device));
    let err = pipe.generate(&req).unwrap_err().to_string();
    assert!(err.contains("[1, 4, 38, 26]"), "{err}");
    let mut req = request::<B>(&golden, &device);
    req.max_sequence_length = Some(0);
    let err = pipe.generate(&req).unwrap_err().to_string();
    assert!(err.contains("max_sequence_length"), "{err}");
}

#[test]
fn pixart_sigma_class_with_its_300_token_default_matches_diffusers() {
    // The Alpha components under `PixArtSigmaPipeline`, as the golden script ran them.
    let golden = Golden::load("tiny-pixart-sigma");
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&model_dir(NAME), &model);
    edit(
        &model.join("model_index.json"),
        "PixArtAlphaPipeline",
        "PixArtSigmaPipeline",
    );
    let device = Default::default();
    let mut pipe = PixArtPipeline::<B>::from_dir(&model, &LoadOptions::default(), &device).unwrap();
    assert_eq!(pipe.variant, PixArtVariant::Sigma);
    let s = &golden.json["pipeline"];
    let prompt = s["prompt"].as_str().unwrap();
    let encoded = pipe
        .encode_prompts(
            &[prompt.into()],
            1,
            pipe.variant.default_max_sequence_length(),
        )
        .unwrap();
    assert_eq!(encoded.embeds.dims()[1], 300);
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    let req = PixArtRequest {
        common: GenerateRequest {
            prompts: vec![prompt.into()],
            negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
            num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
            guidance_scale: s["guidance_scale"].as_f64().unwrap(),
            width: Some(s["width"].as_u64().unwrap() as usize),
            height: Some(s["height"].as_u64().unwrap() as usize),
            latents: Some(Tensor::from_data(TensorData::new(values, shape), &device)),
            ..Default::default()
        },
        ..Default::default()
    };
    let steps = RefCell::new(Vec::new());
    let out = pipe
        .generate_with(&req, &mut NoNoise, |info| {
            steps.borrow_mut().push(info.latents.clone())
        })
        .unwrap();
    let steps = steps.into_inner();
    assert_eq!(
        steps.len(),
        golden.json["timesteps"].as_array().unwrap().len()
    );
    for (i, latents) in steps.into_iter().enumerate() {
        assert_close(&golden, &format!("pipe.step{i}"), latents, TOL);
    }
    let images = out.images.unwrap();
    let (reference, _) = golden.host("pipe.image");
    let err = relative_error(&images.data, &reference);
    eprintln!("sigma pipe.image: relative error {err:e}");
    assert!(err <= TOL, "image relative error {err:e}");
    common::assert_png_close(&images.to_rgb8(0).unwrap(), "tiny-pixart-sigma.png", 2);
}

#[test]
fn pixart_alpha_1024_bins_and_micro_conditions_match_diffusers() {
    // The Alpha folder with the sample_size 128 transformer, as the golden script ran it.
    let golden = Golden::load("tiny-pixart-alpha-1024");
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&model_dir(NAME), &model);
    std::fs::remove_dir_all(model.join("transformer")).unwrap();
    copy_dir(
        &common::fixtures().join("tiny-pixart-transformer-1024"),
        &model.join("transformer"),
    );
    let device = Default::default();
    let mut pipe = PixArtPipeline::<B>::from_dir(&model, &LoadOptions::default(), &device).unwrap();
    assert!(pipe.transformer.uses_micro_conditions());
    let s = &golden.json["pipeline"];
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    let req = PixArtRequest {
        common: GenerateRequest {
            prompts: vec![s["prompt"].as_str().unwrap().into()],
            num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
            guidance_scale: s["guidance_scale"].as_f64().unwrap(),
            width: Some(s["width"].as_u64().unwrap() as usize),
            height: Some(s["height"].as_u64().unwrap() as usize),
            latents: Some(Tensor::from_data(TensorData::new(values, shape), &device)),
            output: OutputType::Latents,
            ..Default::default()
        },
        ..Default::default()
    };
    let binned = (
        golden.json["binned_width"].as_u64().unwrap() as usize,
        golden.json["binned_height"].as_u64().unwrap() as usize,
    );
    assert_eq!(
        pipe.sizes(&req).unwrap().1,
        binned,
        "the 1024 bin of 1000x760"
    );
    let out = pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    assert!(out.images.is_none());
    assert_close(&golden, "pipe.final", out.latents, TOL);
}
