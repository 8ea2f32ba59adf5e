//! LoRA files fused into tiny-sd1 against diffusers' `load_lora_weights` + `fuse_lora`
//! (tools/golden/make_lora.py), in diffusers/PEFT and kohya format, and the errors a wrong file
//! gets.
//!
//! Tolerances as in tests/models.rs: f32 on both sides, 1e-4 relative; 8-bit PNGs within 2
//! levels of diffusers' PNG.

mod common;

use std::path::PathBuf;

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, fixtures, model_dir, relative_error, to_vec, txt2img, Golden, B};
use oxidiff::models::lora::{lora_modules, LoraComponent, LoraFile, LoraFormat, LoraLayerKind};
use oxidiff::models::{ClipTextModel, UNet2DConditionModel, Weights};
use oxidiff::pipelines::{
    GenerateRequest, LoadOptions, OutputType, StableDiffusionPipeline, StableDiffusionXLPipeline,
};

const TOL: f32 = 1e-4;
const GOLDEN: &str = "tiny-sd1-lora";

fn lora(name: &str) -> PathBuf {
    fixtures().join("lora").join(name)
}

fn sd1() -> StableDiffusionPipeline<B> {
    StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

fn scale(golden: &Golden, key: &str) -> f32 {
    golden.json[key].as_f64().unwrap() as f32
}

fn unet_out(golden: &Golden, unet: &UNet2DConditionModel<B>) -> Tensor<B, 4> {
    let t = golden.json["unet_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::<B, 1>::from_data(TensorData::new(vec![t], [1]), &Default::default());
    unet.forward(
        golden.tensor("unet.sample"),
        timestep,
        golden.tensor("unet.encoder_hidden_states"),
    )
}

fn clip_out(golden: &Golden, encoder: &ClipTextModel<B>) -> Tensor<B, 3> {
    encoder
        .forward(&golden.token_rows("clip.input_ids"), false)
        .unwrap()
        .last_hidden_state
}

/// UNet output, text embeddings, the final latents of a 2-step run and its PNG, against the
/// diffusers outputs stored under `tag`.
fn check_pipeline(golden: &Golden, pipe: &mut StableDiffusionPipeline<B>, tag: &str) {
    assert_close(
        golden,
        &format!("{tag}.unet.out"),
        unet_out(golden, &pipe.unet),
        TOL,
    );
    assert_close(
        golden,
        &format!("{tag}.clip.last_hidden_state"),
        clip_out(golden, &pipe.text_encoder),
        TOL,
    );
    let settings = &golden.json["pipeline"];
    let request = GenerateRequest {
        prompts: vec![settings["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![settings["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: settings["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: settings["guidance_scale"].as_f64().unwrap(),
        width: Some(settings["width"].as_u64().unwrap() as usize),
        height: Some(settings["height"].as_u64().unwrap() as usize),
        latents: Some(golden.tensor("pipe.latents")),
        output: OutputType::Images,
        ..Default::default()
    };
    let out = pipe.generate(&request).unwrap();
    assert_close(golden, &format!("{tag}.pipe.latents_out"), out.latents, TOL);
    common::assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        &format!("{GOLDEN}-{tag}.png"),
        2,
    );
}

#[test]
fn base_pipeline_matches_the_lora_golden_run() {
    // The reference every LoRA case differs from: same settings, no LoRA.
    let golden = Golden::load(GOLDEN);
    check_pipeline(&golden, &mut sd1(), "base");
}

#[test]
fn peft_lora_matches_diffusers_fuse_lora() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = sd1();
    let report = pipe
        .load_lora(lora("tiny-sd1-peft.safetensors"), scale(&golden, "scale_a"))
        .unwrap();
    assert_eq!(report.format, LoraFormat::Diffusers);
    assert_eq!(
        report.layers,
        vec![
            (
                "unet",
                golden.json["unet_modules_a"].as_u64().unwrap() as usize
            ),
            (
                "text_encoder",
                golden.json["text_encoder_modules_a"].as_u64().unwrap() as usize
            ),
        ]
    );
    check_pipeline(&golden, &mut pipe, "peft");
}

#[test]
fn a_lora_fuses_into_bf16_weights_converted_at_their_first_use() {
    // tiny-sd1 stores f32: in bf16 every weight waits for its first use, which fusing is.
    let golden = Golden::load(GOLDEN);
    let options = LoadOptions {
        dtype: Some(burn::tensor::FloatDType::BF16),
        ..Default::default()
    };
    let mut pipe = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &options,
        &Default::default(),
    )
    .unwrap();
    let report = pipe
        .load_lora(lora("tiny-sd1-peft.safetensors"), scale(&golden, "scale_a"))
        .unwrap();
    assert_eq!(report.layers[0].0, "unet");
    assert_eq!(
        report.layers[0].1,
        golden.json["unet_modules_a"].as_u64().unwrap() as usize
    );
    let out = to_vec(unet_out(&golden, &pipe.unet));
    let with_lora = relative_error(&out, &golden.host("peft.unet.out").0);
    let without = relative_error(&out, &golden.host("base.unet.out").0);
    // bf16's rounding through the tiny UNet is about 3% of its largest output; the LoRA moves
    // the output by about 90%.
    assert!(with_lora < 5e-2, "{with_lora}");
    assert!(without > 10.0 * with_lora, "{without} against {with_lora}");
}

#[test]
fn kohya_lora_matches_diffusers_fuse_lora() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = sd1();
    let report = pipe
        .load_lora(
            lora("tiny-sd1-kohya.safetensors"),
            scale(&golden, "scale_a"),
        )
        .unwrap();
    assert_eq!(report.format, LoraFormat::Kohya);
    assert_eq!(report.name, "tiny-sd1-kohya");
    assert_eq!(report.short_hash.len(), 12);
    check_pipeline(&golden, &mut pipe, "kohya");
}

#[test]
fn two_loras_add_up_like_diffusers_set_adapters() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = sd1();
    pipe.load_lora(lora("tiny-sd1-peft.safetensors"), scale(&golden, "scale_a"))
        .unwrap();
    let b = pipe
        .load_lora(
            lora("tiny-sd1-kohya-b.safetensors"),
            scale(&golden, "scale_b"),
        )
        .unwrap();
    assert_eq!(b.layers.len(), 1, "LoRA B has UNet layers only");
    assert_close(&golden, "two.unet.out", unet_out(&golden, &pipe.unet), TOL);
    assert_close(
        &golden,
        "two.clip.last_hidden_state",
        clip_out(&golden, &pipe.text_encoder),
        TOL,
    );
}

#[test]
fn scale_zero_leaves_the_model_as_it_was() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = sd1();
    let before = to_vec(unet_out(&golden, &pipe.unet));
    let report = pipe
        .load_lora(lora("tiny-sd1-kohya.safetensors"), 0.0)
        .unwrap();
    assert!(report.layers.iter().all(|(_, n)| *n > 0));
    let after = to_vec(unet_out(&golden, &pipe.unet));
    assert_eq!(before, after, "scale 0 must add exactly zero");
    // and a real scale changes it by far more than the tolerance
    pipe.load_lora(lora("tiny-sd1-kohya.safetensors"), 1.0)
        .unwrap();
    let changed = to_vec(unet_out(&golden, &pipe.unet));
    assert!(relative_error(&changed, &before) > 0.05);
}

#[test]
fn fusing_the_negated_scale_unloads_a_lora() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = sd1();
    pipe.load_lora(lora("tiny-sd1-peft.safetensors"), 0.75)
        .unwrap();
    pipe.load_lora(lora("tiny-sd1-peft.safetensors"), -0.75)
        .unwrap();
    assert_close(&golden, "base.unet.out", unet_out(&golden, &pipe.unet), TOL);
}

/// Every Linear/Conv2d a LoRA can reach has the checkpoint name and shape its weight was
/// loaded from: the names LoRA keys are matched against are the checkpoint's own.
fn layer_names_match(model_dir: PathBuf, modules: Vec<oxidiff::models::lora::LoraModule>) {
    let weights =
        Weights::from_component_dir(&model_dir, &["diffusion_pytorch_model", "model"], None)
            .unwrap();
    assert!(!modules.is_empty());
    for module in modules {
        let key = [
            format!("{}.weight", module.name),
            format!("text_model.{}.weight", module.name),
        ]
        .into_iter()
        .find(|k| weights.contains(k))
        .unwrap_or_else(|| panic!("{} ({}) is not a checkpoint key", module.name, module.path));
        let expected = match module.kind {
            LoraLayerKind::Linear { d_in, d_out } => vec![d_out, d_in],
            LoraLayerKind::Conv {
                c_in,
                c_out,
                kernel,
            } => vec![c_out, c_in, kernel, kernel],
        };
        assert_eq!(weights.shape(&key).unwrap(), expected.as_slice(), "{key}");
    }
}

#[test]
fn lora_layer_names_are_the_checkpoint_keys() {
    let device = Default::default();
    for (name, encoders) in [
        ("tiny-sd1", &["text_encoder"][..]),
        ("tiny-sdxl", &["text_encoder", "text_encoder_2"][..]),
    ] {
        let dir = model_dir(name);
        let unet = UNet2DConditionModel::<B>::from_dir(&dir.join("unet"), None, &device).unwrap();
        layer_names_match(dir.join("unet"), lora_modules(&unet));
        for encoder in encoders {
            let projection = *encoder == "text_encoder_2";
            let model = ClipTextModel::<B>::from_dir(&dir.join(encoder), projection, None, &device)
                .unwrap();
            layer_names_match(dir.join(encoder), lora_modules(&model));
        }
    }
}

#[test]
fn sd1_lora_on_sdxl_names_the_mismatched_keys_and_shapes() {
    let mut pipe = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let before = to_vec(pipe.unet.conv_in.weight.val());
    let err = pipe
        .load_lora(lora("tiny-sd1-kohya.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    eprintln!("{err}");
    assert!(err.contains("tiny-sd1-kohya.safetensors"), "{err}");
    assert!(err.contains("do not match this model"), "{err}");
    assert!(err.contains("lora_unet_"), "names keys: {err}");
    assert!(
        err.contains("shapes that do not fit: `lora_unet_"),
        "names shapes: {err}"
    );
    assert!(
        err.contains("layers the unet does not have: `lora_unet_"),
        "{err}"
    );
    assert_eq!(
        before,
        to_vec(pipe.unet.conv_in.weight.val()),
        "nothing fused"
    );
}

#[test]
fn sdxl_text_encoder_2_lora_on_sd1_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("te2.safetensors");
    write_safetensors(
        &path,
        &[
            (
                "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
                &[1, 32],
            ),
            (
                "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight",
                &[32, 1],
            ),
        ],
    );
    let err = sd1().load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(
        err.contains("text_encoder_2") && err.contains("another model family"),
        "{err}"
    );
}

/// Writes an F32 safetensors file of the given names and shapes (values 0.01 each).
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &[usize])]) {
    write_safetensors_with(path, tensors, None);
}

/// [`write_safetensors`] with diffusers' `lora_adapter_metadata` (PEFT configs) in the header.
fn write_safetensors_with(
    path: &std::path::Path,
    tensors: &[(&str, &[usize])],
    adapter_metadata: Option<serde_json::Value>,
) {
    let mut header = serde_json::Map::new();
    if let Some(meta) = adapter_metadata {
        header.insert(
            "__metadata__".into(),
            serde_json::json!({ "lora_adapter_metadata": meta.to_string() }),
        );
    }
    let mut data = Vec::new();
    for (name, shape) in tensors {
        let n: usize = if shape.contains(&0) {
            0
        } else {
            shape.iter().product()
        };
        let start = data.len();
        for _ in 0..n {
            data.extend_from_slice(&0.01f32.to_le_bytes());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let text = serde_json::Value::Object(header).to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn adapter_metadata_that_contradicts_itself_or_the_weights_is_an_error() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.safetensors");
    let pair: [(&str, &[usize]); 2] = [
        ("unet.conv_in.lora_A.weight", &[1, 4, 3, 3]),
        ("unet.conv_in.lora_B.weight", &[16, 1, 1, 1]),
    ];
    for (meta, needle) in [
        (
            json!({"unet.lora_alpha": "notanumber"}),
            "`unet.lora_alpha` is not a number",
        ),
        (json!({"unet.r": -1}), "`unet.r` must be a positive integer"),
        (
            json!({"unet.r": "four"}),
            "`unet.r` must be a positive integer",
        ),
        (
            json!({"unet.r": 8, "unet.lora_alpha": 8}),
            "has rank 1, but the adapter metadata says `r: 8`",
        ),
    ] {
        write_safetensors_with(&path, &pair, Some(meta.clone()));
        let err = LoraFile::open(&path)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("meta.safetensors") && err.contains(needle),
            "{meta}: {err}"
        );
    }
    // Consistent metadata loads, scaled alpha / r as PEFT does; a rank_pattern entry
    // overrides `r` for its module.
    for meta in [
        json!({"unet.r": 1, "unet.lora_alpha": 2}),
        json!({"unet.r": 8, "unet.lora_alpha": 2, "unet.rank_pattern": {"conv_in": 1}}),
    ] {
        write_safetensors_with(&path, &pair, Some(meta.clone()));
        let file = LoraFile::open(&path).unwrap_or_else(|e| panic!("{meta}: {e}"));
        let layers: Vec<_> = file.layers.values().flatten().collect();
        assert_eq!(layers.len(), 1, "{meta}");
        assert_eq!(layers[0].scaling, 2.0, "{meta}");
    }
}

#[test]
fn unknown_keys_are_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.safetensors");
    write_safetensors(
        &path,
        &[
            ("lora_unet_conv_in.lora_down.weight", &[1, 4, 3, 3]),
            ("lora_unet_conv_in.lora_up.weight", &[16, 1, 1, 1]),
            ("lora_unet_conv_in.hada_w1_a", &[1, 4]),
            ("vae.encoder.conv_in.lora_A.weight", &[1, 3]),
        ],
    );
    let err = LoraFile::open(&path).unwrap_err().to_string();
    assert!(err.contains("odd.safetensors"), "{err}");
    assert!(err.contains("`lora_unet_conv_in.hada_w1_a`"), "{err}");
    assert!(err.contains("`vae.encoder.conv_in.lora_A.weight`"), "{err}");
    assert!(err.contains("2 key(s)"), "{err}");
    // a layer the UNet does not have
    write_safetensors(
        &path,
        &[
            (
                "lora_unet_down_blocks_9_resnets_0_conv1.lora_down.weight",
                &[1, 16, 3, 3],
            ),
            (
                "lora_unet_down_blocks_9_resnets_0_conv1.lora_up.weight",
                &[16, 1, 1, 1],
            ),
        ],
    );
    let err = sd1().load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(
        err.contains("layers the unet does not have: `lora_unet_down_blocks_9_resnets_0_conv1`"),
        "{err}"
    );
    // a pair with its up weight missing
    write_safetensors(&path, &[("unet.conv_in.lora_A.weight", &[1, 4, 3, 3])]);
    let err = LoraFile::open(&path).unwrap_err().to_string();
    assert!(
        err.contains("`unet.conv_in`") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn conv_lora_in_kohya_format_reaches_conv_in() {
    // A LoCon-style 3x3 conv LoRA with alpha: W += alpha / rank * up @ down, checked by hand.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locon.safetensors");
    write_safetensors(
        &path,
        &[
            ("lora_unet_conv_in.alpha", &[]),
            ("lora_unet_conv_in.lora_down.weight", &[2, 4, 3, 3]),
            ("lora_unet_conv_in.lora_up.weight", &[16, 2, 1, 1]),
        ],
    );
    let file = LoraFile::open(&path).unwrap();
    let layer = &file.layers_of(LoraComponent::Unet)[0];
    assert_eq!(layer.scaling, 0.01 / 2.0, "alpha 0.01 over rank 2");
    let mut pipe = sd1();
    let before = to_vec(pipe.unet.conv_in.weight.val());
    pipe.load_lora(&path, 2.0).unwrap();
    let after = to_vec(pipe.unet.conv_in.weight.val());
    // each entry of up @ down is rank * 0.01 * 0.01; times scale 2 and alpha / rank 0.005
    let expected = 2.0 * 0.005 * 2.0 * 0.01 * 0.01;
    for (a, b) in after.iter().zip(&before) {
        // within a few f32 ulps of weights about 0.1 (ulp 7e-9)
        assert!((a - b - expected).abs() < 3e-8, "{a} - {b} != {expected}");
    }
}

#[test]
fn corrupt_lora_file_error_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.safetensors");
    let bytes = std::fs::read(lora("tiny-sd1-kohya-b.safetensors")).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let mut pipe = sd1();
    let err = pipe.load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(err.contains("broken.safetensors"), "{err}");
    assert!(err.contains("not a valid safetensors file"), "{err}");
    let missing = dir.path().join("missing.safetensors");
    let err = pipe.load_lora(&missing, 1.0).unwrap_err().to_string();
    assert!(err.contains("missing.safetensors"), "{err}");
    std::fs::write(&path, b"").unwrap();
    let err = pipe.load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(err.contains("broken.safetensors"), "{err}");
}

#[test]
fn txt2img_lora_flag_matches_diffusers_and_is_recorded_like_a1111() {
    let golden = Golden::load(GOLDEN);
    let tmp = tempfile::tempdir().unwrap();
    let (values, shape) = golden.host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    std::fs::write(&latents, oxidiff::latents::encode_npy(&values, &shape)).unwrap();
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sd1");
    let lora_arg = format!("{}:0.75", lora("tiny-sd1-peft.safetensors").display());
    let settings = &golden.json["pipeline"];
    let steps = settings["num_inference_steps"].to_string();
    let base = [
        "--model",
        model.to_str().unwrap(),
        "--latents",
        latents.to_str().unwrap(),
        "--steps",
        &steps,
        "--guidance",
        "7.5",
        "--negative-prompt",
        settings["negative_prompt"].as_str().unwrap(),
        "--quiet",
        "--json",
    ];
    let mut args = base.to_vec();
    args.extend(["--lora", &lora_arg, "-o", out.to_str().unwrap()]);
    args.push(settings["prompt"].as_str().unwrap());
    let result = txt2img(&args);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{stderr}");
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, &format!("{GOLDEN}-peft.png"), 2);
    let params = oxidiff::pipelines::GenerationParameters::from_png(&out).unwrap();
    assert_eq!(
        params.prompt,
        format!(
            "{} <lora:tiny-sd1-peft:0.75>",
            settings["prompt"].as_str().unwrap()
        )
    );
    let hashes = params
        .extra
        .iter()
        .find(|(k, _)| k == "Lora hashes")
        .map(|(_, v)| v.clone())
        .expect("Lora hashes field");
    // A1111's short LoRA hash (sha256 of the bytes after the header, 12 hex digits), as
    // Python's hashlib gives it for this fixture.
    assert_eq!(hashes, "tiny-sd1-peft: 87434e4a2b0d");
    let summary: serde_json::Value =
        serde_json::from_slice(&result.stdout).expect("--json summary");
    assert_eq!(summary["loras"][0]["scale"], 0.75);

    // --from-png strips the tags from the prompt and warns when no --lora is given
    let again = tmp.path().join("again.png");
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--latents",
        latents.to_str().unwrap(),
        "--quiet",
        "--from-png",
        out.to_str().unwrap(),
        "-o",
        again.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{stderr}");
    assert!(
        stderr.contains("<lora:tiny-sd1-peft:0.75>") && stderr.contains("--lora"),
        "{stderr}"
    );
    let without = image::open(&again).unwrap().to_rgb8();
    common::assert_png_close(&without, &format!("{GOLDEN}-base.png"), 2);

    // a LoRA for the wrong model fails before anything is written
    let bad = tmp.path().join("bad.png");
    let te2 = tmp.path().join("te2.safetensors");
    write_safetensors(
        &te2,
        &[
            (
                "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
                &[1, 32],
            ),
            (
                "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight",
                &[32, 1],
            ),
        ],
    );
    let mut args = base.to_vec();
    args.extend([
        "--lora",
        te2.to_str().unwrap(),
        "-o",
        bad.to_str().unwrap(),
        "x",
    ]);
    let result = txt2img(&args);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(!result.status.success());
    assert!(
        stderr.contains("te2.safetensors") && stderr.contains("text_encoder_2"),
        "{stderr}"
    );
    assert!(!bad.exists());
}

/// An SDXL LoRA over the UNet (attention, feed-forward, resnets, down/upsamplers, conv_in/out,
/// time and added-condition embeddings) and both text encoders, in PEFT format and in kohya
/// format with the original (SGM) UNet block names, against diffusers with it fused.
fn sdxl_lora_matches(file: &str, tag: &str) {
    let golden = Golden::load("tiny-sdxl-lora");
    let mut pipe = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let report = pipe.load_lora(lora(file), scale(&golden, "scale")).unwrap();
    let count = |key: &str| golden.json[key].as_u64().unwrap() as usize;
    assert_eq!(
        report.layers,
        vec![
            ("unet", count("unet_modules")),
            ("text_encoder", count("text_encoder_modules")),
            ("text_encoder_2", count("text_encoder_2_modules")),
        ]
    );
    let s = &golden.json["pipeline"];
    let prompt = vec![s["prompt"].as_str().unwrap().to_string()];
    let embeds = pipe.encode_prompts(&prompt, &prompt, 1).unwrap();
    assert_close(
        &golden,
        &format!("{tag}.encode.prompt_embeds"),
        embeds.prompt_embeds,
        TOL,
    );
    assert_close(
        &golden,
        &format!("{tag}.encode.pooled_prompt_embeds"),
        embeds.pooled_prompt_embeds,
        TOL,
    );
    let t = golden.json["unet_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::<B, 1>::from_data(TensorData::new(vec![t], [1]), &Default::default());
    let added = oxidiff::models::AddedCondition {
        text_embeds: golden.tensor("unet.text_embeds"),
        time_ids: golden.tensor("unet.time_ids"),
    };
    let out = pipe
        .unet
        .forward_with_condition(
            golden.tensor("unet.sample"),
            timestep,
            golden.tensor("unet.encoder_hidden_states"),
            Some(&added),
        )
        .unwrap();
    assert_close(&golden, &format!("{tag}.unet.out"), out, TOL);
}

#[test]
fn sdxl_peft_lora_with_both_text_encoders_matches_diffusers() {
    sdxl_lora_matches("tiny-sdxl-peft.safetensors", "peft");
}

#[test]
fn sdxl_kohya_lora_with_sgm_block_names_matches_diffusers() {
    sdxl_lora_matches("tiny-sdxl-kohya-sgm.safetensors", "kohya");
}

/// Why fused: on XLA's CPU plugin, a pipeline with a LoRA fused compiles to the very program of
/// the pipeline without it. With the on-disk cache on, the base pipeline's compile is the only
/// compile of a program; the LoRA pipeline's step loads that executable (its weights are
/// arguments), and its latents still match diffusers with the LoRA. `load_lora` after `compile` is an error.
#[test]
fn compiled_mode_with_a_fused_lora_reuses_the_base_program() {
    use oxidiff::{Oxi, OxiDevice};
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load(GOLDEN);
    // The disk cache's folder is read from the environment: this test runs in a process of its
    // own with the variable set, so no other test sees it.
    let cache = tempfile::tempdir().unwrap();
    if !oxidiff_test_support::isolated(
        "compiled_mode_with_a_fused_lora_reuses_the_base_program",
        &[("OXIDIFF_COMPILE_CACHE", cache.path())],
    ) {
        return;
    }
    let xla: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let load = || {
        StableDiffusionPipeline::<Oxi>::from_dir(
            &model_dir("tiny-sd1"),
            &LoadOptions::default(),
            &OxiDevice::Cpu,
        )
        .unwrap()
        .to_components(&OxiDevice::Cpu, &xla, &xla)
    };
    let settings = &golden.json["pipeline"];
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    let request = GenerateRequest::<Oxi> {
        prompts: vec![settings["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![settings["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: settings["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: settings["guidance_scale"].as_f64().unwrap(),
        latents: Some(Tensor::from_data(
            TensorData::new(values, shape),
            &OxiDevice::Cpu,
        )),
        output: OutputType::Latents,
        ..Default::default()
    };
    let latents = |pipe: &mut StableDiffusionPipeline<Oxi>| {
        to_vec(
            pipe.generate(&request)
                .unwrap()
                .latents
                .to_device(&OxiDevice::Cpu),
        )
    };

    let mut base = load();
    base.compile().unwrap();
    let base_latents = latents(&mut base);
    let stats = base.compile_stats().unwrap();
    // The program alone: its convolution kernels came permuted straight from the checkpoint,
    // so no kernel transpose ran.
    assert_eq!((stats.programs, stats.xla_compiles), (1, 1), "{stats:?}");

    let mut pipe = load();
    // fused on the devices the weights live on: the UNet on XLA, the text encoder on the CPU
    pipe.load_lora(lora("tiny-sd1-peft.safetensors"), scale(&golden, "scale_a"))
        .unwrap();
    pipe.compile().unwrap();
    let lora_latents = latents(&mut pipe);
    let log = pipe.compiled.as_ref().unwrap().compile_log();
    assert!(
        log.len() == 1 && log[0].from_disk,
        "the LoRA pipeline's step should be the base program, loaded from the cache: {log:?}"
    );
    // What XLA compiled besides: the transposes of the kernels the LoRA changed (fused on the
    // device, so not permuted from the checkpoint's bytes), one small program per shape.
    let stats = pipe.compile_stats().unwrap();
    eprintln!("the LoRA pipeline: {stats:?}");
    let (expected, _) = golden.host("peft.pipe.latents_out");
    let err = relative_error(&lora_latents, &expected);
    eprintln!("compiled LoRA latents vs diffusers: relative error {err:e}");
    assert!(err <= TOL, "relative error {err:e}");
    assert!(
        relative_error(&base_latents, &expected) > 0.01,
        "the LoRA changed nothing"
    );

    let err = pipe
        .load_lora(lora("tiny-sd1-kohya-b.safetensors"), 0.5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("before compile()"), "{err}");
}

#[test]
fn non_finite_lora_weights_and_absurd_shapes_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nan.safetensors");
    write_safetensors(
        &path,
        &[
            ("lora_unet_conv_in.lora_down.weight", &[1, 4, 3, 3]),
            ("lora_unet_conv_in.lora_up.weight", &[16, 1, 1, 1]),
        ],
    );
    // turn the first value of the data into NaN
    let mut bytes = std::fs::read(&path).unwrap();
    let data = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[data..data + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = LoraFile::open(&path).unwrap_err().to_string();
    assert!(
        err.contains("NaN") && err.contains("lora_unet_conv_in"),
        "{err}"
    );
    // a zero-sized down weight whose other dimensions multiply past usize
    let huge = 1usize << 40;
    write_safetensors(
        &path,
        &[
            ("lora_unet_conv_in.lora_down.weight", &[1, huge, huge, 0]),
            ("lora_unet_conv_in.lora_up.weight", &[16, 1]),
        ],
    );
    let err = sd1().load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(
        err.contains("nan.safetensors") && err.contains("overflow"),
        "{err}"
    );
    // an empty down weight fits no layer
    write_safetensors(
        &path,
        &[
            ("lora_unet_conv_in.lora_down.weight", &[1, 0, 3, 3]),
            ("lora_unet_conv_in.lora_up.weight", &[16, 1]),
        ],
    );
    let err = sd1().load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(err.contains("shapes that do not fit"), "{err}");
}

#[test]
fn attention_processor_lora_names_are_read_like_peft_names() {
    // diffusers' older format names the processor (`attn1.processor.to_out_lora.down.weight`,
    // `self_attn.to_q_lora.down.weight`); the same weights under PEFT names fuse identically.
    let golden = Golden::load(GOLDEN);
    let dir = tempfile::tempdir().unwrap();
    let block = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1";
    let layer = "text_encoder.text_model.encoder.layers.1.self_attn";
    let old = dir.path().join("old.safetensors");
    let new = dir.path().join("new.safetensors");
    let names = |old_style: bool| -> Vec<(String, Vec<usize>)> {
        let unet = |proj: &str, peft: &str| {
            if old_style {
                format!("{block}.processor.{proj}_lora")
            } else {
                format!("{block}.{peft}")
            }
        };
        let te = |proj: &str, peft: &str| {
            if old_style {
                format!("{layer}.{proj}_lora")
            } else {
                format!("{layer}.{peft}")
            }
        };
        let (down, up) = if old_style {
            ("down.weight", "up.weight")
        } else {
            ("lora_A.weight", "lora_B.weight")
        };
        vec![
            (format!("{}.{down}", unet("to_q", "to_q")), vec![2, 16]),
            (format!("{}.{up}", unet("to_q", "to_q")), vec![16, 2]),
            (
                format!("{}.{down}", unet("to_out", "to_out.0")),
                vec![2, 16],
            ),
            (format!("{}.{up}", unet("to_out", "to_out.0")), vec![16, 2]),
            (format!("{}.{down}", te("to_v", "v_proj")), vec![2, 32]),
            (format!("{}.{up}", te("to_v", "v_proj")), vec![32, 2]),
        ]
    };
    for (path, old_style) in [(&old, true), (&new, false)] {
        let tensors = names(old_style);
        let refs: Vec<(&str, &[usize])> = tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        write_safetensors(path, &refs);
    }
    let fused = |path: &PathBuf| {
        let mut pipe = sd1();
        let report = pipe.load_lora(path, 1.0).unwrap();
        assert_eq!(report.layers, vec![("unet", 2), ("text_encoder", 1)]);
        (
            to_vec(unet_out(&golden, &pipe.unet)),
            to_vec(clip_out(&golden, &pipe.text_encoder)),
        )
    };
    assert_eq!(fused(&old), fused(&new));
}
