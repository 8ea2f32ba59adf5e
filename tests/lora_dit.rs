//! LoRA files fused into the transformer pipelines (tiny-flux-dev, tiny-sd3,
//! tiny-pixart-alpha) against what diffusers makes of them (tools/golden/make_lora_dit.py):
//! Flux in diffusers/PEFT and kohya (sd-scripts) format, SD3 with both CLIP text encoders,
//! PixArt through peft; the errors a LoRA for another model gets; `txt2img --lora` for each.
//!
//! Tolerances as in tests/lora.rs: f32 on both sides, 1e-4 relative; 8-bit PNGs within 2
//! levels of diffusers' PNG.

mod common;

use std::path::PathBuf;

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, fixtures, model_dir, to_vec, txt2img, Golden, B};
use oxidiff::models::lora::{lora_modules, LoraFormat, LoraLayerKind, LoraModule};
use oxidiff::models::{
    FluxTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel, Weights,
};
use oxidiff::pipelines::{FluxPipeline, LoadOptions, PixArtPipeline, StableDiffusion3Pipeline};

const TOL: f32 = 1e-4;
const GOLDEN: &str = "tiny-dit-lora";

fn lora(name: &str) -> PathBuf {
    fixtures().join("lora").join(name)
}

fn scale(golden: &Golden) -> f32 {
    golden.json["scale"].as_f64().unwrap() as f32
}

fn count(golden: &Golden, key: &str) -> usize {
    golden.json[key].as_u64().unwrap() as usize
}

fn flux() -> FluxPipeline<B> {
    FluxPipeline::<B>::from_dir(
        &model_dir("tiny-flux-dev"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

fn sd3() -> StableDiffusion3Pipeline<B> {
    StableDiffusion3Pipeline::<B>::from_dir(
        &model_dir("tiny-sd3"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

fn pixart() -> PixArtPipeline<B> {
    PixArtPipeline::<B>::from_dir(
        &model_dir("tiny-pixart-alpha"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

/// The transformer call of tests/flux_models.rs (batch 2, 4x6 image tokens, 7 text tokens).
fn flux_out(model: &FluxTransformer2DModel<B>) -> Tensor<B, 3> {
    let inputs = Golden::load("tiny-flux");
    let device = Default::default();
    let (ids, shape) = inputs.host("transformer.img_ids");
    let img_ids: Vec<Vec<f32>> = ids.chunks(shape[1]).map(<[f32]>::to_vec).collect();
    let rope = model.rotary_embedding(&vec![vec![0.0; 3]; 7], &img_ids, &device);
    model
        .forward(
            inputs.tensor("transformer.hidden_states"),
            inputs.tensor("transformer.encoder_hidden_states"),
            inputs.tensor("transformer.pooled_projections"),
            inputs.tensor("transformer.timestep"),
            Some(inputs.tensor("transformer.guidance")),
            &rope,
        )
        .unwrap()
}

fn sd3_out(golden: &Golden, model: &SD3Transformer2DModel<B>) -> Tensor<B, 4> {
    let inputs = Golden::load("tiny-sd3");
    let t = golden.json["sd3.transformer_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::from_data(TensorData::new(vec![t, t], [2]), &Default::default());
    model
        .forward(
            inputs.tensor("transformer.sample"),
            timestep,
            inputs.tensor("transformer.encoder_hidden_states"),
            inputs.tensor("transformer.pooled_projections"),
        )
        .unwrap()
}

fn pixart_out(golden: &Golden, model: &PixArtTransformer2DModel<B>) -> Tensor<B, 4> {
    let inputs = Golden::load("tiny-pixart-alpha");
    let device = Default::default();
    let mask = inputs.token_rows("transformer.encoder_attention_mask");
    let bias = PixArtTransformer2DModel::<B>::caption_mask_bias(&mask, &device);
    let t = golden.json["pixart.transformer_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::from_data(TensorData::new(vec![t, t], [2]), &device);
    model
        .forward(
            inputs.tensor("transformer.sample"),
            timestep,
            inputs.tensor("transformer.encoder_hidden_states"),
            Some(bias),
            None,
        )
        .unwrap()
}

/// Every Linear/Conv2d a LoRA can reach has the checkpoint name and shape its weight was
/// loaded from.
fn layer_names_match(dir: PathBuf, modules: Vec<LoraModule>) {
    let weights = Weights::from_component_dir(&dir, &["diffusion_pytorch_model"], None).unwrap();
    assert!(!modules.is_empty());
    for module in modules {
        let key = format!("{}.weight", module.name);
        let shape = weights
            .shape(&key)
            .unwrap_or_else(|| panic!("{} ({}) is not a checkpoint key", module.name, module.path));
        let expected = match module.kind {
            LoraLayerKind::Linear { d_in, d_out } => vec![d_out, d_in],
            LoraLayerKind::Conv {
                c_in,
                c_out,
                kernel,
            } => vec![c_out, c_in, kernel, kernel],
        };
        assert_eq!(shape, expected.as_slice(), "{key}");
    }
}

#[test]
fn transformer_lora_layer_names_are_the_checkpoint_keys() {
    let device = Default::default();
    let dir = model_dir("tiny-flux-dev").join("transformer");
    let flux = FluxTransformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
    layer_names_match(dir, lora_modules(&flux));
    for name in ["tiny-sd3", "tiny-sd35-transformer"] {
        let dir = match name {
            "tiny-sd3" => model_dir(name).join("transformer"),
            _ => model_dir(name),
        };
        let sd3 = SD3Transformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
        layer_names_match(dir, lora_modules(&sd3));
    }
    for name in ["tiny-pixart-alpha", "tiny-pixart-transformer-1024"] {
        let dir = match name {
            "tiny-pixart-alpha" => model_dir(name).join("transformer"),
            _ => model_dir(name),
        };
        let pixart = PixArtTransformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
        layer_names_match(dir, lora_modules(&pixart));
    }
}

#[test]
fn flux_peft_lora_matches_diffusers_fuse_lora() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = flux();
    let report = pipe
        .load_lora(lora("tiny-flux-peft.safetensors"), scale(&golden))
        .unwrap();
    assert_eq!(report.format, LoraFormat::Diffusers);
    assert_eq!(
        report.layers,
        vec![
            (
                "transformer",
                count(&golden, "flux-peft.transformer_modules")
            ),
            (
                "text_encoder",
                count(&golden, "flux-peft.text_encoder_modules")
            ),
        ]
    );
    assert_close(
        &golden,
        "flux-peft.transformer.out",
        flux_out(&pipe.transformer),
        TOL,
    );
}

#[test]
fn flux_kohya_lora_with_fused_qkv_matches_diffusers_conversion() {
    // double_blocks_* qkv (one dense, one block-sparse of rank 3r), projections, MLPs and
    // modulations; single_blocks_* linear2 and modulation: diffusers splits and renames them.
    let golden = Golden::load(GOLDEN);
    let mut pipe = flux();
    let report = pipe
        .load_lora(lora("tiny-flux-kohya.safetensors"), scale(&golden))
        .unwrap();
    assert_eq!(report.format, LoraFormat::Kohya);
    assert_eq!(
        report.layers,
        vec![(
            "transformer",
            count(&golden, "flux-kohya.transformer_modules")
        )]
    );
    assert_close(
        &golden,
        "flux-kohya.transformer.out",
        flux_out(&pipe.transformer),
        TOL,
    );
}

#[test]
fn sd3_lora_on_transformer_and_both_clip_encoders_matches_diffusers() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = sd3();
    let report = pipe
        .load_lora(lora("tiny-sd3-peft.safetensors"), scale(&golden))
        .unwrap();
    assert_eq!(
        report.layers,
        vec![
            ("transformer", count(&golden, "sd3.transformer_modules")),
            ("text_encoder", count(&golden, "sd3.text_encoder_modules")),
            (
                "text_encoder_2",
                count(&golden, "sd3.text_encoder_2_modules")
            ),
        ]
    );
    assert_close(
        &golden,
        "sd3.transformer.out",
        sd3_out(&golden, &pipe.transformer),
        TOL,
    );
    let run = &golden.json["sd3.run"];
    let text = vec![run["prompt"].as_str().unwrap().to_string()];
    let max_len = run["max_sequence_length"].as_u64().unwrap() as usize;
    let embeds = pipe
        .encode_prompts(&text, &text, &text, 1, max_len)
        .unwrap();
    assert_close(
        &golden,
        "sd3.encode.prompt_embeds",
        embeds.prompt_embeds,
        TOL,
    );
    assert_close(
        &golden,
        "sd3.encode.pooled_prompt_embeds",
        embeds.pooled_prompt_embeds,
        TOL,
    );
}

#[test]
fn pixart_lora_matches_peft() {
    let golden = Golden::load(GOLDEN);
    let mut pipe = pixart();
    let report = pipe
        .load_lora(lora("tiny-pixart-peft.safetensors"), scale(&golden))
        .unwrap();
    assert_eq!(
        report.layers,
        vec![("transformer", count(&golden, "pixart.transformer_modules"))]
    );
    assert_close(
        &golden,
        "pixart.transformer.out",
        pixart_out(&golden, &pipe.transformer),
        TOL,
    );
    // fusing the negated scale takes it out again
    pipe.load_lora(lora("tiny-pixart-peft.safetensors"), -scale(&golden))
        .unwrap();
    let inputs = Golden::load("tiny-pixart-alpha");
    assert_close(
        &inputs,
        "transformer.out",
        pixart_out(&golden, &pipe.transformer),
        TOL,
    );
}

#[test]
fn unet_loras_on_flux_name_the_component_or_the_keys_and_fuse_nothing() {
    let mut pipe = flux();
    let before = to_vec(pipe.transformer.x_embedder.weight.val());
    // PEFT: `unet.` layers, which a Flux pipeline does not have
    let err = pipe
        .load_lora(lora("tiny-sd1-peft.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tiny-sd1-peft.safetensors"), "{err}");
    assert!(
        err.contains("unet") && err.contains("another model family"),
        "{err}"
    );
    // kohya: `lora_unet_down_blocks_...`, which the transformer does not have
    let err = pipe
        .load_lora(lora("tiny-sd1-kohya.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layers the transformer does not have: `lora_unet_down_blocks_"),
        "{err}"
    );
    assert_eq!(before, to_vec(pipe.transformer.x_embedder.weight.val()));
}

#[test]
fn flux_lora_on_sd3_names_the_mismatched_keys_and_shapes() {
    let mut pipe = sd3();
    let before = to_vec(pipe.transformer.context_embedder.weight.val());
    let err = pipe
        .load_lora(lora("tiny-flux-peft.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not match this model"), "{err}");
    assert!(
        err.contains("shapes that do not fit: `transformer."),
        "{err}"
    );
    assert!(
        err.contains(
            "layers the transformer does not have: `transformer.single_transformer_blocks"
        ),
        "{err}"
    );
    assert_eq!(
        before,
        to_vec(pipe.transformer.context_embedder.weight.val()),
        "nothing fused"
    );
    // and a kohya Flux file on PixArt: its layers are not there
    let err = pixart()
        .load_lora(lora("tiny-flux-kohya.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`lora_unet_double_blocks_0_img_attn_qkv`"),
        "{err}"
    );
}

/// Writes an F32 safetensors file of the given names and shapes (values 0.01 each).
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &[usize])]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        let start = data.len();
        for _ in 0..n {
            data.extend_from_slice(&0.01f32.to_le_bytes());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn unknown_keys_and_a_qkv_of_the_wrong_height_are_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dora.safetensors");
    write_safetensors(
        &path,
        &[
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
                &[1, 32],
            ),
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_B.weight",
                &[32, 1],
            ),
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector",
                &[32],
            ),
        ],
    );
    let err = flux().load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(
        err.contains("`transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector`"),
        "{err}"
    );
    // tiny Flux: width 32, so a fused qkv's up has 96 rows; 64 cannot be split
    let path = dir.path().join("qkv.safetensors");
    write_safetensors(
        &path,
        &[
            (
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                &[2, 32],
            ),
            (
                "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
                &[64, 2],
            ),
        ],
    );
    let err = flux().load_lora(&path, 1.0).unwrap_err().to_string();
    assert!(
        err.contains("`lora_unet_double_blocks_0_img_attn_qkv` (up [64, 2]) against")
            && err.contains("transformer_blocks.0.attn.to_v [32, 32]"),
        "{err}"
    );
}

#[test]
fn flux_kohya_single_block_linear1_splits_into_qkv_and_mlp() {
    // diffusers cannot load this layer for a tiny model (it splits with the full-size
    // widths), so the reference is the fused weights themselves: to_q, to_k, to_v and
    // proj_mlp each get their rows of up @ down.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linear1.safetensors");
    // width 32, MLP 128: up has 32 * 3 + 128 rows
    write_safetensors(
        &path,
        &[
            (
                "lora_unet_single_blocks_1_linear1.lora_down.weight",
                &[2, 32],
            ),
            (
                "lora_unet_single_blocks_1_linear1.lora_up.weight",
                &[224, 2],
            ),
            ("lora_unet_single_blocks_1_linear1.alpha", &[]),
            (
                "lora_unet_final_layer_adaLN_modulation_1.lora_down.weight",
                &[2, 32],
            ),
            (
                "lora_unet_final_layer_adaLN_modulation_1.lora_up.weight",
                &[64, 2],
            ),
        ],
    );
    let mut pipe = flux();
    let block = &pipe.transformer.single_transformer_blocks[1];
    let before = [
        to_vec(block.attn.to_q.weight.val()),
        to_vec(block.proj_mlp.weight.val()),
        to_vec(pipe.transformer.norm_out.linear.weight.val()),
    ];
    let report = pipe.load_lora(&path, 1.0).unwrap();
    assert_eq!(report.layers, vec![("transformer", 5)]);
    let block = &pipe.transformer.single_transformer_blocks[1];
    let after = [
        to_vec(block.attn.to_q.weight.val()),
        to_vec(block.proj_mlp.weight.val()),
        to_vec(pipe.transformer.norm_out.linear.weight.val()),
    ];
    // every entry: 2 (rank) * 0.01 * 0.01 = 2e-4, times alpha / rank = 0.01 / 2 for linear1
    for (i, expected) in [1e-6f32, 1e-6, 2e-4].into_iter().enumerate() {
        for (a, b) in after[i].iter().zip(&before[i]) {
            // f32 weights of size ~1: the sum rounds at about 1e-7
            assert!(
                (a - b - expected).abs() < 2e-7,
                "{i}: {} vs {expected}",
                a - b
            );
        }
    }
}

/// `txt2img --lora FILE:0.75` on `model` with the golden run's settings (`flags`, then the
/// prompt): its PNG within 2 levels of diffusers' `png`, the LoRA recorded as A1111 does.
fn check_cli(model: &str, flags: &[String], file: &str, png: &str, prompt: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let mut args: Vec<String> = vec!["--model".into(), model_dir(model).display().to_string()];
    args.extend_from_slice(flags);
    args.extend([
        "--lora".into(),
        format!("{}:0.75", lora(file).display()),
        "--quiet".into(),
        "-o".into(),
        out.display().to_string(),
        prompt.into(),
    ]);
    let result = txt2img(&args);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{stderr}");
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, png, 2);
    let params = oxidiff::pipelines::GenerationParameters::from_png(&out).unwrap();
    let name = file.strip_suffix(".safetensors").unwrap();
    assert_eq!(params.prompt, format!("{prompt} <lora:{name}:0.75>"));
    assert!(
        params
            .extra
            .iter()
            .any(|(k, v)| k == "Lora hashes" && v.starts_with(&format!("{name}: "))),
        "{:?}",
        params.extra
    );
}

fn run_flags(run: &serde_json::Value, flags: &[(&str, &str)]) -> Vec<String> {
    flags
        .iter()
        .flat_map(|(flag, key)| {
            [
                flag.to_string(),
                run[*key].to_string().trim_matches('"').to_string(),
            ]
        })
        .collect()
}

#[test]
fn txt2img_lora_on_sd3_matches_diffusers_png() {
    let golden = Golden::load(GOLDEN);
    let run = &golden.json["sd3.run"];
    let tmp = tempfile::tempdir().unwrap();
    let (values, shape) = Golden::load("tiny-sd3").host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    std::fs::write(&latents, oxidiff::latents::encode_npy(&values, &shape)).unwrap();
    let mut flags = run_flags(
        run,
        &[
            ("--steps", "num_inference_steps"),
            ("--guidance", "guidance_scale"),
            ("--negative-prompt", "negative_prompt"),
            ("--max-sequence-length", "max_sequence_length"),
            ("--width", "width"),
            ("--height", "height"),
        ],
    );
    flags.extend(["--latents".into(), latents.display().to_string()]);
    check_cli(
        "tiny-sd3",
        &flags,
        "tiny-sd3-peft.safetensors",
        "tiny-dit-lora-sd3.png",
        run["prompt"].as_str().unwrap(),
    );
}

#[test]
fn txt2img_lora_on_flux_matches_diffusers_png() {
    let golden = Golden::load(GOLDEN);
    let run = &golden.json["flux.run"];
    let flags = run_flags(
        run,
        &[
            ("--steps", "num_inference_steps"),
            ("--seed", "seed"),
            ("--width", "width"),
            ("--height", "height"),
            ("--max-sequence-length", "max_sequence_length"),
        ],
    );
    check_cli(
        "tiny-flux-dev",
        &flags,
        "tiny-flux-peft.safetensors",
        "tiny-dit-lora-flux.png",
        run["prompt"].as_str().unwrap(),
    );
}

#[test]
fn txt2img_lora_on_pixart_matches_peft_png() {
    let golden = Golden::load(GOLDEN);
    let run = &golden.json["pixart.run"];
    let tmp = tempfile::tempdir().unwrap();
    let (values, shape) = Golden::load("tiny-pixart-alpha").host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    std::fs::write(&latents, oxidiff::latents::encode_npy(&values, &shape)).unwrap();
    let mut flags = run_flags(
        run,
        &[
            ("--steps", "num_inference_steps"),
            ("--width", "width"),
            ("--height", "height"),
        ],
    );
    flags.extend(["--latents".into(), latents.display().to_string()]);
    check_cli(
        "tiny-pixart-alpha",
        &flags,
        "tiny-pixart-peft.safetensors",
        "tiny-dit-lora-pixart.png",
        run["prompt"].as_str().unwrap(),
    );
}

#[test]
fn flux_lora_fused_on_xla_cpu_then_compiled_matches_diffusers_png() {
    use oxidiff::pipelines::{FluxRequest, GenerateRequest};
    use oxidiff::{Oxi, OxiDevice, ToDevice};
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let device: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let golden = Golden::load(GOLDEN);
    let mut pipe = FluxPipeline::<Oxi>::from_dir(
        &model_dir("tiny-flux-dev"),
        &LoadOptions::default(),
        &OxiDevice::Cpu,
    )
    .unwrap()
    .to(&device);
    // fused where the weights live (on the XLA device), before compile()
    pipe.load_lora(lora("tiny-flux-peft.safetensors"), scale(&golden))
        .unwrap();
    pipe.compile().unwrap();
    let run = &golden.json["flux.run"];
    let int = |k: &str| run[k].as_u64().unwrap() as usize;
    let request = FluxRequest::<Oxi> {
        common: GenerateRequest {
            prompts: vec![run["prompt"].as_str().unwrap().into()],
            num_inference_steps: int("num_inference_steps"),
            guidance_scale: run["guidance_scale"].as_f64().unwrap(),
            width: Some(int("width")),
            height: Some(int("height")),
            seed: run["seed"].as_u64().unwrap(),
            ..Default::default()
        },
        max_sequence_length: int("max_sequence_length"),
        ..Default::default()
    };
    let out = pipe.generate(&request).unwrap();
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(1));
    common::assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "tiny-dit-lora-flux.png",
        2,
    );
    let err = pipe
        .load_lora(lora("tiny-flux-kohya.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("before compile()") && err.contains("transformer"),
        "{err}"
    );
}

#[test]
fn flux_kohya_keys_over_diffusers_names_match_diffusers() {
    // `lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight`, ... with alphas:
    // attention layers of both block kinds and the embedders, norm_out and proj_out.
    let golden = Golden::load(GOLDEN);
    let mut pipe = flux();
    let report = pipe
        .load_lora(
            lora("tiny-flux-kohya-transformer.safetensors"),
            scale(&golden),
        )
        .unwrap();
    assert_eq!(report.format, LoraFormat::Kohya);
    assert_eq!(
        report.layers,
        vec![(
            "transformer",
            count(&golden, "flux-kohya-transformer.transformer_modules")
        )]
    );
    assert_close(
        &golden,
        "flux-kohya-transformer.transformer.out",
        flux_out(&pipe.transformer),
        TOL,
    );
}
