//! `StableDiffusionXLPipeline` against diffusers on the tiny SDXL pipeline
//! (`tools/golden/make_tiny_sdxl.py`): both text encoders, the prompt encoding (with a negative
//! prompt, none, and an empty one), one UNet call with SDXL's added condition, the per-step
//! latents of a 4-step Euler generation with size/crop conditioning, the final image, the
//! all-zero negative path and `denoising_end`. Tensors within 1e-4 relative (f32 on both sides,
//! 1 vs 2 torch threads differ by about 1e-5); PNG pixels within 2 levels.

mod common;

use std::cell::RefCell;

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, model_dir, relative_error, Golden, B};
use oxidiff::models::AddedCondition;
use oxidiff::pipelines::{
    GenerateRequest, LoadOptions, OutputType, PipelineError, StableDiffusionXLPipeline, XlOptions,
    XlRequest,
};
use oxidiff::schedulers::NoNoise;

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-sdxl";

fn load() -> (StableDiffusionXLPipeline<B>, Golden) {
    let golden = Golden::load(NAME);
    let pipe = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir(NAME),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    (pipe, golden)
}

fn pair(v: &serde_json::Value) -> (usize, usize) {
    (
        v[0].as_u64().unwrap() as usize,
        v[1].as_u64().unwrap() as usize,
    )
}

fn request(golden: &Golden, negative: bool) -> XlRequest<B> {
    let s = &golden.json["pipeline"];
    let req = GenerateRequest {
        prompts: vec![s["prompt"].as_str().unwrap().into()],
        negative_prompts: if negative {
            vec![s["negative_prompt"].as_str().unwrap().into()]
        } else {
            Vec::new()
        },
        num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: s["guidance_scale"].as_f64().unwrap(),
        width: Some(s["width"].as_u64().unwrap() as usize),
        height: Some(s["height"].as_u64().unwrap() as usize),
        latents: Some(golden.tensor("pipe.latents")),
        ..Default::default()
    };
    let xl = XlOptions {
        original_size: Some(pair(&s["original_size"])),
        crops_coords_top_left: pair(&s["crops_coords_top_left"]),
        target_size: Some(pair(&s["target_size"])),
        ..Default::default()
    };
    XlRequest { common: req, xl }
}

#[test]
fn text_encoders_match_diffusers_penultimate_states_and_pooled_projection() {
    let (pipe, golden) = load();
    let texts = ["prompt", "negative_prompt"]
        .map(|k| golden.json["pipeline"][k].as_str().unwrap().to_string());
    let texts = [texts[0].clone(), texts[1].clone(), String::new()];
    for (key, tokenizer) in [
        ("te1", pipe.tokenizer.as_ref().unwrap()),
        ("te2", &pipe.tokenizer_2),
    ] {
        let expected = golden.token_rows(&format!("{key}.input_ids"));
        let ours: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| tokenizer.encode(t).unwrap().ids)
            .collect();
        assert_eq!(ours, expected, "{key}: token ids");
    }
    // tokenizer_2 pads with `!` (id 0), as in real SDXL.
    assert_eq!(*golden.token_rows("te2.input_ids")[0].last().unwrap(), 0);

    let ids = golden.token_rows("te1.input_ids");
    let out = pipe
        .text_encoder
        .as_ref()
        .unwrap()
        .forward(&ids, true)
        .unwrap();
    let n = out.hidden_states.len();
    assert_close(
        &golden,
        "te1.penultimate",
        out.hidden_states[n - 2].clone(),
        TOL,
    );
    let ids = golden.token_rows("te2.input_ids");
    let out = pipe.text_encoder_2.forward(&ids, true).unwrap();
    let n = out.hidden_states.len();
    assert_close(
        &golden,
        "te2.penultimate",
        out.hidden_states[n - 2].clone(),
        TOL,
    );
    assert_close(&golden, "te2.text_embeds", out.text_embeds.unwrap(), TOL);
}

#[test]
fn encode_prompt_matches_diffusers_with_negative_and_empty_prompts() {
    let (pipe, golden) = load();
    let s = &golden.json["pipeline"];
    let prompt = vec![s["prompt"].as_str().unwrap().to_string()];
    let negative = vec![s["negative_prompt"].as_str().unwrap().to_string()];
    let pos = pipe.encode_prompts(&prompt, &prompt, 1).unwrap();
    assert_close(&golden, "encode.prompt_embeds", pos.prompt_embeds, TOL);
    assert_close(
        &golden,
        "encode.pooled_prompt_embeds",
        pos.pooled_prompt_embeds,
        TOL,
    );
    let neg = pipe.encode_prompts(&negative, &negative, 1).unwrap();
    assert_close(
        &golden,
        "encode.negative_prompt_embeds",
        neg.prompt_embeds,
        TOL,
    );
    assert_close(
        &golden,
        "encode.negative_pooled_prompt_embeds",
        neg.pooled_prompt_embeds,
        TOL,
    );
    // An empty string is encoded (only a missing negative prompt gives zeros).
    let empty = vec![String::new()];
    let neg = pipe.encode_prompts(&empty, &empty, 1).unwrap();
    assert_close(
        &golden,
        "encode.empty_negative_prompt_embeds",
        neg.prompt_embeds,
        TOL,
    );
    assert_close(
        &golden,
        "encode.empty_negative_pooled_prompt_embeds",
        neg.pooled_prompt_embeds,
        TOL,
    );
}

#[test]
fn unet_with_added_condition_matches_diffusers() {
    let (pipe, golden) = load();
    let t = golden.json["unet_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::<B, 1>::from_data(TensorData::new(vec![t], [1]), &Default::default());
    let added = AddedCondition {
        text_embeds: golden.tensor("unet.text_embeds"),
        time_ids: golden.tensor("unet.time_ids"),
    };
    let out = pipe
        .unet
        .forward_with_condition(
            golden.tensor("unet.sample"),
            timestep.clone(),
            golden.tensor("unet.encoder_hidden_states"),
            Some(&added),
        )
        .unwrap();
    assert_close(&golden, "unet.out", out, TOL);
    // An SDXL UNet without its added condition is an error, not a silently different output.
    let err = pipe
        .unet
        .forward_with_condition(
            golden.tensor("unet.sample"),
            timestep,
            golden.tensor("unet.encoder_hidden_states"),
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("text_time"), "{err}");
}

#[test]
fn sdxl_euler_generation_matches_diffusers_step_by_step() {
    let (mut pipe, golden) = load();
    let req = request(&golden, true);
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
    let (expected, _) = golden.host("pipe.image");
    let err = relative_error(&images.data, &expected);
    eprintln!("pipe.image: relative error {err:e}");
    assert!(err <= TOL, "image relative error {err:e}");
    common::assert_png_close(&images.to_rgb8(0).unwrap(), "tiny-sdxl-euler.png", 2);
}

#[test]
fn no_negative_prompt_uses_zero_embeddings_and_denoising_end_stops_early() {
    let (mut pipe, golden) = load();
    let mut req = request(&golden, false);
    req.common.output = OutputType::Latents;
    let out = pipe.generate(&req).unwrap();
    assert_close(&golden, "pipe.zeros.latents", out.latents, TOL);

    let mut req = request(&golden, true);
    req.common.output = OutputType::Latents;
    req.xl.denoising_end = golden.json["pipeline"]["denoising_end"].as_f64();
    let mut steps = 0;
    let out = pipe
        .generate_with(&req, &mut NoNoise, |_| steps += 1)
        .unwrap();
    assert_eq!(
        steps,
        golden.json["denoising_end_steps"].as_u64().unwrap() as usize
    );
    assert_close(&golden, "pipe.denoising_end.latents", out.latents, TOL);
}

#[test]
fn bad_sizes_and_a_missing_second_text_encoder_are_clear_errors() {
    let (mut pipe, golden) = load();
    let mut req = request(&golden, true);
    req.common.width = Some(60);
    req.common.latents = None;
    let err = pipe.generate(&req).unwrap_err().to_string();
    assert!(
        err.contains("multiples of 8") && err.contains("60x64"),
        "{err}"
    );
    req.common.width = Some(64);
    let mut bad_end = req.clone();
    bad_end.xl.denoising_end = Some(1.5);
    let err = pipe.generate(&bad_end).unwrap_err().to_string();
    assert!(err.contains("denoising_end"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        model_dir(NAME).join("model_index.json"),
        dir.path().join("model_index.json"),
    )
    .unwrap();
    for sub in [
        "tokenizer",
        "tokenizer_2",
        "text_encoder",
        "unet",
        "vae",
        "scheduler",
    ] {
        std::fs::create_dir(dir.path().join(sub)).unwrap();
    }
    let err = match StableDiffusionXLPipeline::<B>::from_dir(
        dir.path(),
        &LoadOptions::default(),
        &Default::default(),
    ) {
        Err(e) => e,
        Ok(_) => panic!("loaded a folder without text_encoder_2"),
    };
    assert!(
        matches!(err, PipelineError::MissingComponent { .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("text_encoder_2") && msg.contains(&dir.path().display().to_string()),
        "{msg}"
    );

    // The SD 1.x/2.x pipeline refuses an SDXL folder by its class name.
    let err = match oxidiff::pipelines::StableDiffusionPipeline::<B>::from_dir(
        &model_dir(NAME),
        &LoadOptions::default(),
        &Default::default(),
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("SD pipeline loaded SDXL"),
    };
    assert!(err.contains("StableDiffusionXLPipeline"), "{err}");
}

#[test]
fn a_unet_that_does_not_fit_text_encoder_2_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        for entry in walk(from) {
            let target = to.join(entry.strip_prefix(from).unwrap());
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::copy(&entry, target).unwrap();
        }
    };
    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files.extend(walk(&path));
            } else {
                files.push(path);
            }
        }
        files
    }
    copy(&model_dir(NAME), dir.path());
    let config = dir.path().join("unet/config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text.replace(
        "\"projection_class_embeddings_input_dim\": 32",
        "\"projection_class_embeddings_input_dim\": 40",
    );
    assert_ne!(text, edited, "the fixture's config has the field");
    std::fs::write(&config, edited).unwrap();
    let err = match StableDiffusionXLPipeline::<B>::from_dir(
        dir.path(),
        &LoadOptions::default(),
        &Default::default(),
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("loaded a mismatched UNet"),
    };
    assert!(
        err.contains("projection_class_embeddings_input_dim") && err.contains("unet/config.json"),
        "{err}"
    );
}
