//! Single-file checkpoints (`from_single_file`) against diffusers, on the tiny SD 1, SD 2 and
//! SDXL pipelines converted to the LDM / A1111 layout by `tools/golden/make_single_file.py`
//! (float16 files, as real single files usually are).
//!
//! - Every weight read through the renaming views equals the diffusers folder's weight rounded
//!   to float16 (bit for bit), so the key mapping, the q/k/v split of OpenCLIP's fused
//!   projection, its transposed `text_projection` and the VAE's 1x1-convolution attention are
//!   exact.
//! - Text embeddings, one UNet call, a VAE decode and the final image of a 4-step run match
//!   diffusers' `from_single_file(config=folder)` on the same file within 1e-4 relative (f32
//!   compute on both sides; 1 vs 2 torch threads differ by about 1e-5), the PNG within 2 levels.
//! - SD 1.x and SDXL inpainting files (9-channel UNets) and an SDXL refiner file, derived from
//!   those (`tools/golden/make_single_file_edit.py`), match diffusers' `from_single_file` in
//!   the inpaint and img2img pipelines step by step within 1e-4, the PNGs within 2 levels,
//!   also through the `img2img` binary; diffusers' inpainting model types are detected.
//! - Pickles, corrupt files and unknown architectures are refused with errors that say why.

mod common;

use std::path::{Path, PathBuf};

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, fixtures, model_dir, relative_error, txt2img, Golden, B};
use oxidiff::models::{
    AddedCondition, ModelError, SingleFile, SingleFileArch, UNet2DConditionConfig, Weights,
};
use oxidiff::pipelines::{
    GenerateRequest, PipelineError, SingleFileOptions, StableDiffusionPipeline,
    StableDiffusionXLPipeline, XlRequest,
};
use oxidiff::schedulers::NoNoise;

const TOL: f32 = 1e-4;

fn checkpoint(name: &str) -> PathBuf {
    fixtures()
        .join("single-file")
        .join(format!("{name}.safetensors"))
}

fn options(name: &str) -> SingleFileOptions {
    SingleFileOptions {
        config: Some(model_dir(name)),
        ..Default::default()
    }
}

fn golden(name: &str) -> Golden {
    Golden::load(&format!("single-file-{name}"))
}

fn timestep(golden: &Golden) -> Tensor<B, 1> {
    let t = golden.json["unet_timestep"].as_f64().unwrap() as f32;
    Tensor::from_data(TensorData::new(vec![t], [1]), &Default::default())
}

fn request(golden: &Golden) -> GenerateRequest<B> {
    let s = &golden.json["pipeline"];
    GenerateRequest {
        prompts: vec![s["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: s["guidance_scale"].as_f64().unwrap(),
        width: Some(s["width"].as_u64().unwrap() as usize),
        height: Some(s["height"].as_u64().unwrap() as usize),
        latents: Some(golden.tensor("pipe.latents")),
        ..Default::default()
    }
}

fn assert_image(golden: &Golden, name: &str, images: &oxidiff::pipelines::Images) {
    let (expected, _) = golden.host("pipe.image");
    let err = relative_error(&images.data, &expected);
    assert!(err <= TOL, "{name}: image relative error {err:e}");
    common::assert_png_close(
        &images.to_rgb8(0).unwrap(),
        &format!("single-file-{name}.png"),
        2,
    );
}

/// SD 1.x/2.x: CLIP embeddings, UNet, VAE decode and the 4-step run with the folder's
/// scheduler.
fn sd_matches_diffusers(name: &str, scheduler_class: &str) {
    let golden = golden(name);
    let mut pipe = StableDiffusionPipeline::<B>::from_single_file(
        &checkpoint(name),
        &options(name),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(golden.json["scheduler"], scheduler_class);
    assert_eq!(pipe.scheduler.kind().class_name(), scheduler_class);
    let ids = golden.token_rows("clip.input_ids");
    let text = pipe.text_encoder.forward(&ids, false).unwrap();
    assert_close(
        &golden,
        "clip.last_hidden_state",
        text.last_hidden_state,
        TOL,
    );
    let out = pipe.unet.forward(
        golden.tensor("unet.sample"),
        timestep(&golden),
        golden.tensor("unet.encoder_hidden_states"),
    );
    assert_close(&golden, "unet.out", out, TOL);
    let decoded = pipe.vae.decode(golden.tensor("vae.decode.in"));
    assert_close(&golden, "vae.decode.out", decoded, TOL);
    let out = pipe
        .generate_with(&request(&golden), &mut NoNoise, |_| {})
        .unwrap();
    assert_image(&golden, name, &out.images.unwrap());
}

#[test]
fn sd1_single_file_matches_diffusers_from_single_file() {
    sd_matches_diffusers("tiny-sd1", "PNDMScheduler");
}

#[test]
fn sd2_single_file_with_open_clip_matches_diffusers_from_single_file() {
    sd_matches_diffusers("tiny-sd2", "DDIMScheduler");
}

#[test]
fn sdxl_single_file_matches_diffusers_from_single_file() {
    let name = "tiny-sdxl";
    let golden = golden(name);
    let mut pipe = StableDiffusionXLPipeline::<B>::from_single_file(
        &checkpoint(name),
        &options(name),
        &Default::default(),
    )
    .unwrap();
    for (key, encoder) in [
        ("te1", pipe.text_encoder.as_ref().unwrap()),
        ("te2", &pipe.text_encoder_2),
    ] {
        let out = encoder
            .forward(&golden.token_rows(&format!("{key}.input_ids")), true)
            .unwrap();
        let n = out.hidden_states.len();
        assert_close(
            &golden,
            &format!("{key}.penultimate"),
            out.hidden_states[n - 2].clone(),
            TOL,
        );
        if key == "te2" {
            assert_close(&golden, "te2.text_embeds", out.text_embeds.unwrap(), TOL);
        }
    }
    let added = AddedCondition {
        text_embeds: golden.tensor("unet.text_embeds"),
        time_ids: golden.tensor("unet.time_ids"),
    };
    let out = pipe
        .unet
        .forward_with_condition(
            golden.tensor("unet.sample"),
            timestep(&golden),
            golden.tensor("unet.encoder_hidden_states"),
            Some(&added),
        )
        .unwrap();
    assert_close(&golden, "unet.out", out, TOL);
    let decoded = pipe.vae.decode(golden.tensor("vae.decode.in"));
    assert_close(&golden, "vae.decode.out", decoded, TOL);
    let out = pipe
        .generate_with(&XlRequest::new(request(&golden)), &mut NoNoise, |_| {})
        .unwrap();
    assert_image(&golden, name, &out.images.unwrap());
}

/// Every tensor of `folder` (a diffusers component) read from `view` is the same tensor
/// rounded to float16; both hold the same names (`text_model.` added where transformers 5
/// leaves it out).
fn assert_same_weights(view: &Weights, folder: &Weights, what: &str) {
    let mut names: Vec<&str> = folder
        .keys()
        .filter(|k| !k.ends_with("position_ids"))
        .collect();
    names.sort_unstable();
    let mut view_names: Vec<String> = view.keys().map(str::to_string).collect();
    view_names.sort();
    let prefixed = |k: &str| {
        if view.contains(k) {
            k.to_string()
        } else {
            format!("text_model.{k}")
        }
    };
    let mut expected: Vec<String> = names.iter().map(|k| prefixed(k)).collect();
    expected.sort();
    assert_eq!(view_names, expected, "{what}: tensor names");
    for name in names {
        let (theirs, their_shape) = folder.read_f32(name).unwrap();
        let (ours, shape) = view.read_f32(&prefixed(name)).unwrap();
        assert_eq!(shape, their_shape, "{what}: {name} shape");
        let rounded: Vec<f32> = theirs
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect();
        assert!(
            ours == rounded,
            "{what}: {name} differs from the folder's weight"
        );
    }
}

fn component(name: &str, part: &str) -> Weights {
    let base = if part.starts_with("text_encoder") {
        "model"
    } else {
        "diffusion_pytorch_model"
    };
    Weights::from_component_dir(&model_dir(name).join(part), &[base], None).unwrap()
}

#[test]
fn every_weight_maps_onto_the_diffusers_folders_weight() {
    for name in ["tiny-sd1", "tiny-sd2", "tiny-sdxl"] {
        let file = SingleFile::open(&checkpoint(name)).unwrap();
        assert_same_weights(
            &file.unet_weights().unwrap(),
            &component(name, "unet"),
            name,
        );
        assert_same_weights(&file.vae_weights().unwrap(), &component(name, "vae"), name);
        assert_same_weights(
            &file.text_encoder_weights(3).unwrap(),
            &component(name, "text_encoder"),
            name,
        );
        if name == "tiny-sdxl" {
            assert_same_weights(
                &file.text_encoder_2_weights(3).unwrap(),
                &component(name, "text_encoder_2"),
                name,
            );
        }
        // Only the DDPM schedule buffer (and SD 2's unused text_projection) is left over.
        assert!(file.unmapped_keys(3, 3).unwrap().is_empty(), "{name}");
    }
}

#[test]
fn architecture_and_tensor_sizes_are_read_from_the_keys() {
    let arch = |name: &str| SingleFile::open(&checkpoint(name)).unwrap().arch;
    assert_eq!(arch("tiny-sd1"), SingleFileArch::Sd1);
    assert_eq!(arch("tiny-sd2"), SingleFileArch::Sd2);
    assert_eq!(arch("tiny-sdxl"), SingleFileArch::SdxlBase);

    for name in ["tiny-sd1", "tiny-sd2", "tiny-sdxl"] {
        let file = SingleFile::open(&checkpoint(name)).unwrap();
        let v = file.predicts_v();
        assert_eq!(v, name == "tiny-sd2", "{name}: v prediction");
        let dir = model_dir(name);
        let want = UNet2DConditionConfig::from_file(&dir.join("unet/config.json")).unwrap();
        let got = file.unet_config(v).unwrap();
        assert_eq!(got.block_out_channels, want.block_out_channels, "{name}");
        assert_eq!(got.layers_per_block, want.layers_per_block, "{name}");
        assert_eq!(got.down_block_types, want.down_block_types, "{name}");
        assert_eq!(got.up_block_types, want.up_block_types, "{name}");
        assert_eq!(got.mid_block_type, want.mid_block_type, "{name}");
        assert_eq!(got.cross_attention_dim, want.cross_attention_dim, "{name}");
        assert_eq!(
            got.use_linear_projection, want.use_linear_projection,
            "{name}"
        );
        let depth = |c: &UNet2DConditionConfig| {
            c.transformer_layers_per_block
                .expand(c.block_out_channels.len(), "", Path::new(""))
                .unwrap()
        };
        assert_eq!(depth(&got), depth(&want), "{name}");
        assert_eq!(
            got.projection_class_embeddings_input_dim, want.projection_class_embeddings_input_dim,
            "{name}"
        );
        let vae_want =
            oxidiff::models::AutoencoderKLConfig::from_file(&dir.join("vae/config.json")).unwrap();
        let vae = file.vae_config(v).unwrap();
        assert_eq!(
            vae.block_out_channels, vae_want.block_out_channels,
            "{name}"
        );
        assert_eq!(vae.layers_per_block, vae_want.layers_per_block, "{name}");
        assert_eq!(vae.latent_channels, vae_want.latent_channels, "{name}");
        // The tiny encoders are narrower than one 64-channel head: their head count cannot
        // be inferred, and the error says to pass the config (the released widths are checked
        // in released_layouts_detect_rename_and_configure_as_the_released_models).
        let err = file.text_encoder_config().unwrap_err().to_string();
        assert!(
            err.contains("64 channels a head") && err.contains("`config`"),
            "{err}"
        );
    }
    let file = SingleFile::open(&checkpoint("tiny-sdxl")).unwrap();
    let err = file.text_encoder_2_config().unwrap_err().to_string();
    assert!(err.contains("8 wide"), "{err}");
}

fn open_err(path: &Path) -> String {
    SingleFile::open(path).unwrap_err().to_string()
}

#[test]
fn pickle_checkpoints_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    for ext in ["ckpt", "pt", "pth", "bin"] {
        let path = dir.path().join(format!("model.{ext}"));
        std::fs::write(&path, b"\x80\x02}q\x00.").unwrap();
        let err = SingleFile::open(&path).unwrap_err();
        assert!(matches!(err, ModelError::Pickle { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("execute arbitrary code"), "{msg}");
        assert!(msg.contains("safetensors"), "{msg}");
    }
    // A PyTorch zip archive renamed to .safetensors is still a pickle.
    let path = dir.path().join("renamed.safetensors");
    std::fs::write(&path, b"PK\x03\x04archive/data.pkl").unwrap();
    let msg = open_err(&path);
    assert!(
        msg.contains("zip archive") && msg.contains("pickle"),
        "{msg}"
    );
    // Through the pipeline too.
    let err = StableDiffusionPipeline::<B>::from_single_file(
        &dir.path().join("model.ckpt"),
        &SingleFileOptions::default(),
        &Default::default(),
    )
    .err()
    .unwrap();
    assert!(
        matches!(err, PipelineError::Model(ModelError::Pickle { .. })),
        "{err}"
    );
}

#[test]
fn corrupt_and_truncated_files_name_the_file_and_the_fault() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(checkpoint("tiny-sd1")).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let msg = open_err(&truncated);
    assert!(msg.contains("truncated.safetensors"), "{msg}");
    assert!(msg.contains("truncated or corrupt"), "{msg}");
    assert!(msg.contains("bytes"), "the fault is said: {msg}");

    let garbage = dir.path().join("garbage.safetensors");
    let mut header = bytes[..64].to_vec();
    header[8..16].copy_from_slice(b"{{{{{{{{");
    std::fs::write(&garbage, &header).unwrap();
    let msg = open_err(&garbage);
    assert!(
        msg.contains("garbage.safetensors") && msg.contains("corrupt"),
        "{msg}"
    );

    let empty = dir.path().join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    let msg = open_err(&empty);
    assert!(
        msg.contains("empty.safetensors") && msg.contains("8-byte"),
        "{msg}"
    );

    let missing = dir.path().join("missing.safetensors");
    assert!(open_err(&missing).contains("missing.safetensors"));
}

fn write_tensors(path: &Path, keys: &[&str]) {
    let data = [0u8; 16];
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = keys
        .iter()
        .map(|k| {
            (
                k.to_string(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &data)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn unknown_architectures_name_the_keys_looked_for() {
    let dir = tempfile::tempdir().unwrap();
    let flux = dir.path().join("flux.safetensors");
    write_tensors(&flux, &["double_blocks.0.img_attn.norm.key_norm.scale"]);
    let err = SingleFile::open(&flux).unwrap_err();
    assert!(
        matches!(err, ModelError::UnknownArchitecture { .. }),
        "{err}"
    );
    let msg = err.to_string();
    for key in [
        "model.diffusion_model.input_blocks.0.0.weight",
        "cond_stage_model.model.token_embedding.weight",
        "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias",
        "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
        "double_blocks.0.img_attn.norm.key_norm.scale",
    ] {
        assert!(msg.contains(key), "{key} missing from: {msg}");
    }

    // A diffusers component file is not a single-file checkpoint, and the error says so.
    let unet = model_dir("tiny-sd1").join("unet/diffusion_pytorch_model.safetensors");
    let msg = open_err(&unet);
    assert!(msg.contains("diffusers' own"), "{msg}");

    // A UNet without any text encoder this loader knows.
    let bare = dir.path().join("bare.safetensors");
    write_tensors(&bare, &["model.diffusion_model.input_blocks.0.0.weight"]);
    let msg = open_err(&bare);
    assert!(msg.contains("no text encoder"), "{msg}");
}

#[test]
fn config_sources_wrong_pipeline_missing_tokenizer_and_mismatched_config() {
    // The Hub cache is read from the environment: this test runs in a process of its own with
    // `HF_HUB_CACHE` set to an empty folder of its own, so no other test sees the variable.
    let hub = tempfile::tempdir().unwrap();
    if !oxidiff_test_support::isolated(
        "config_sources_wrong_pipeline_missing_tokenizer_and_mismatched_config",
        &[("HF_HUB_CACHE", hub.path())],
    ) {
        return;
    }
    let device = Default::default();
    let err = StableDiffusionPipeline::<B>::from_single_file(
        &checkpoint("tiny-sdxl"),
        &options("tiny-sdxl"),
        &device,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("StableDiffusionXLPipeline::from_single_file"),
        "{err}"
    );
    let err = StableDiffusionXLPipeline::<B>::from_single_file(
        &checkpoint("tiny-sd1"),
        &options("tiny-sd1"),
        &device,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("StableDiffusionPipeline::from_single_file"),
        "{err}"
    );

    // No config and no tokenizer folder: the error says a single file has none and where to
    // get one (an empty Hub cache, so the default repository is not found there).
    let cache = PathBuf::from(std::env::var_os("HF_HUB_CACHE").unwrap());
    let err = StableDiffusionPipeline::<B>::from_single_file(
        &checkpoint("tiny-sd1"),
        &SingleFileOptions::default(),
        &device,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("carries no tokenizer"), "{err}");
    assert!(
        err.contains("stable-diffusion-v1-5/stable-diffusion-v1-5"),
        "{err}"
    );

    // The architecture's diffusers repository in the Hub cache gives configs, scheduler and
    // tokenizer, as diffusers takes them (here a hand-made cache holding tiny-sd1's files under
    // SD 1.5's name, configs and tokenizer only).
    let repo = cache.join("models--stable-diffusion-v1-5--stable-diffusion-v1-5");
    let hash = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), hash).unwrap();
    let snapshot = repo.join("snapshots").join(hash);
    let source = model_dir("tiny-sd1");
    for part in ["unet", "vae", "text_encoder", "scheduler", "tokenizer"] {
        std::fs::create_dir_all(snapshot.join(part)).unwrap();
        for entry in std::fs::read_dir(source.join(part)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json" || e == "txt")
                && !path.to_string_lossy().contains("index")
            {
                std::fs::copy(&path, snapshot.join(part).join(path.file_name().unwrap())).unwrap();
            }
        }
    }
    std::fs::copy(
        source.join("model_index.json"),
        snapshot.join("model_index.json"),
    )
    .unwrap();
    let pipe = StableDiffusionPipeline::<B>::from_single_file(
        &checkpoint("tiny-sd1"),
        &SingleFileOptions::default(),
        &device,
    )
    .unwrap();
    let golden = golden("tiny-sd1");
    let text = pipe
        .text_encoder
        .forward(&golden.token_rows("clip.input_ids"), false)
        .unwrap();
    assert_close(
        &golden,
        "clip.last_hidden_state",
        text.last_hidden_state,
        TOL,
    );
    std::fs::remove_dir_all(&repo).unwrap();

    // A tokenizer but no config: the built-in configs assume the released models' sizes that
    // the tensors do not show (64 channels a head, 32 group-norm groups), which the tiny
    // model does not have; the error names the fix.
    let err = StableDiffusionPipeline::<B>::from_single_file(
        &checkpoint("tiny-sd1"),
        &SingleFileOptions {
            tokenizer: Some(model_dir("tiny-sd1").join("tokenizer")),
            ..Default::default()
        },
        &device,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("pass the matching diffusers folder as `config`"),
        "{err}"
    );

    // The SD 2 folder's configs do not fit the SD 1 file.
    let err = StableDiffusionPipeline::<B>::from_single_file(
        &checkpoint("tiny-sd1"),
        &options("tiny-sd2"),
        &device,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("tiny-sd1.safetensors") || err.contains("weight"),
        "{err}"
    );
}

#[test]
fn txt2img_takes_a_single_file_model_and_matches_diffusers_png() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["tiny-sd1", "tiny-sdxl"] {
        let golden = golden(name);
        let (values, shape) = golden.host("pipe.latents");
        let latents = tmp.path().join(format!("{name}.npy"));
        std::fs::write(&latents, oxidiff::latents::encode_npy(&values, &shape)).unwrap();
        let out = tmp.path().join(format!("{name}.png"));
        let s = &golden.json["pipeline"];
        let (model, config) = (checkpoint(name), model_dir(name));
        let guidance = s["guidance_scale"].as_f64().unwrap().to_string();
        let result = txt2img(&[
            "--model",
            model.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--latents",
            latents.to_str().unwrap(),
            "--steps",
            "4",
            "--guidance",
            &guidance,
            "--negative-prompt",
            s["negative_prompt"].as_str().unwrap(),
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            s["prompt"].as_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&result.stderr);
        assert!(result.status.success(), "{name}: {err}");
        let ours = image::open(&out).unwrap().to_rgb8();
        common::assert_png_close(&ours, &format!("single-file-{name}.png"), 2);
        // --dtype f16 casts the single file's components as it does a folder's: the same
        // image within 2 levels (observed: 1).
        let half = tmp.path().join(format!("{name}-f16.png"));
        let mut args = vec![
            "--model",
            model.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--latents",
            latents.to_str().unwrap(),
            "--steps",
            "4",
            "--guidance",
            &guidance,
            "--negative-prompt",
            s["negative_prompt"].as_str().unwrap(),
            "--quiet",
            "--dtype",
            "f16",
            "-o",
            half.to_str().unwrap(),
        ];
        args.push(s["prompt"].as_str().unwrap());
        let result = txt2img(&args);
        let err = String::from_utf8_lossy(&result.stderr);
        assert!(result.status.success(), "{name} f16: {err}");
        let half = image::open(&half).unwrap().to_rgb8();
        common::assert_png_close(&half, &format!("single-file-{name}.png"), 2);
    }

    // A pickle is refused with the reason, exit status 1, nothing written.
    let ckpt = tmp.path().join("model.ckpt");
    std::fs::write(&ckpt, b"\x80\x02}q\x00.").unwrap();
    let out = tmp.path().join("never.png");
    let result = txt2img(&[
        "--model",
        ckpt.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "a prompt",
    ]);
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(1), "{err}");
    assert!(err.contains("execute arbitrary code"), "{err}");
    assert!(!out.exists());

    // --config belongs to single files.
    let folder = model_dir("tiny-sd1");
    let result = txt2img(&[
        "--model",
        folder.to_str().unwrap(),
        "--config",
        folder.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "a prompt",
    ]);
    let err = String::from_utf8_lossy(&result.stderr);
    assert!(err.contains("single-file"), "{err}");
    assert!(!out.exists());
}

/// The released SD 1.5, SD 2.1 and SDXL base layouts (names and shapes only, from diffusers
/// models built on the meta device by `make_single_file.py`, checked there by diffusers' own
/// conversion): the architecture is detected as diffusers' `infer_diffusers_model_type` does,
/// the renaming views give exactly the diffusers names and shapes, and the built-in configs
/// with the sizes read from the tensors are the released models' configs.
#[test]
fn released_layouts_detect_rename_and_configure_as_the_released_models() {
    let text =
        std::fs::read_to_string(fixtures().join("single-file/released-layouts.json")).unwrap();
    let layouts: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shape_list = |v: &serde_json::Value| -> Vec<(String, Vec<usize>)> {
        v.as_object()
            .unwrap()
            .iter()
            .map(|(k, s)| {
                let shape = s
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize);
                (k.clone(), shape.collect())
            })
            .collect()
    };
    // Only the differences, so a failure stays readable.
    let assert_same =
        |ours: Vec<(String, Vec<usize>)>, mut want: Vec<(String, Vec<usize>)>, what: &str| {
            want.sort();
            let extra: Vec<_> = ours.iter().filter(|e| !want.contains(e)).take(5).collect();
            let missing: Vec<_> = want.iter().filter(|e| !ours.contains(e)).take(5).collect();
            assert!(
                extra.is_empty() && missing.is_empty() && ours.len() == want.len(),
                "{what}: {} names against {}; not expected {extra:?}; missing {missing:?}",
                ours.len(),
                want.len()
            );
        };
    let sorted_shapes = |w: &Weights| {
        let mut v: Vec<(String, Vec<usize>)> = w
            .keys()
            .map(|k| (k.to_string(), w.shape(k).unwrap().to_vec()))
            .collect();
        v.sort();
        v
    };
    for (name, arch, model_type) in [
        ("sd15", SingleFileArch::Sd1, "v1"),
        ("sd21", SingleFileArch::Sd2, "v2"),
        ("sdxl_base", SingleFileArch::SdxlBase, "xl_base"),
    ] {
        let layout = &layouts[name];
        assert_eq!(layout["diffusers_model_type"], model_type);
        let label = PathBuf::from(format!("{name}.safetensors"));
        let weights = Weights::shapes_only(&label, shape_list(&layout["shapes"])).unwrap();
        let file = SingleFile::from_weights(&label, weights).unwrap();
        assert_eq!(file.arch, arch, "{name}");
        let v = file.predicts_v();
        assert_eq!(v, arch == SingleFileArch::Sd2, "{name}");

        // Configs.
        let configs = &layout["configs"];
        let path = Path::new(name);
        let want: UNet2DConditionConfig = serde_json::from_value(configs["unet"].clone()).unwrap();
        let got = file.unet_config(v).unwrap();
        let n = want.block_out_channels.len();
        let per_block = |c: &UNet2DConditionConfig| {
            (
                c.layers_per_block.expand(n, "", path).unwrap(),
                c.transformer_layers_per_block.expand(n, "", path).unwrap(),
                c.cross_attention_dim.expand(n, "", path).unwrap(),
                c.heads(path).unwrap(),
                c.only_cross_attention.expand(n, "", path).unwrap(),
            )
        };
        assert_eq!(
            per_block(&got),
            per_block(&want),
            "{name}: per-block UNet fields"
        );
        let unet_fields = |c: &UNet2DConditionConfig| {
            format!(
                "{:?}",
                (
                    (
                        &c.sample_size,
                        c.in_channels,
                        c.out_channels,
                        &c.down_block_types,
                        &c.mid_block_type,
                        &c.up_block_types,
                        &c.block_out_channels,
                    ),
                    (
                        c.norm_num_groups,
                        c.norm_eps,
                        c.use_linear_projection,
                        c.upcast_attention,
                        &c.addition_embed_type,
                        c.addition_time_embed_dim,
                        c.projection_class_embeddings_input_dim,
                        (
                            c.flip_sin_to_cos,
                            c.freq_shift,
                            &c.act_fn,
                            c.downsample_padding
                        ),
                    ),
                )
            )
        };
        // `sample_size` is written as a plain number in both.
        assert_eq!(unet_fields(&got), unet_fields(&want), "{name}: UNet config");

        let want: oxidiff::models::AutoencoderKLConfig =
            serde_json::from_value(configs["vae"].clone()).unwrap();
        let got = file.vae_config(v).unwrap();
        let vae_fields = |c: &oxidiff::models::AutoencoderKLConfig| {
            format!(
                "{:?}",
                (
                    c.in_channels,
                    c.out_channels,
                    &c.down_block_types,
                    &c.up_block_types,
                    &c.block_out_channels,
                    c.layers_per_block,
                    c.latent_channels,
                    c.norm_num_groups,
                    c.sample_size,
                    c.scaling_factor,
                    &c.act_fn,
                )
            )
        };
        assert_eq!(vae_fields(&got), vae_fields(&want), "{name}: VAE config");

        let clip_fields = |c: &oxidiff::models::ClipTextConfig| {
            format!(
                "{:?}",
                (
                    c.vocab_size,
                    c.hidden_size,
                    c.intermediate_size,
                    c.projection_dim,
                    c.num_hidden_layers,
                    c.num_attention_heads,
                    c.max_position_embeddings,
                    &c.hidden_act,
                    c.eos_token_id,
                )
            )
        };
        let want: oxidiff::models::ClipTextConfig =
            serde_json::from_value(configs["text_encoder"].clone()).unwrap();
        let te = file.text_encoder_config().unwrap();
        assert_eq!(
            clip_fields(&te),
            clip_fields(&want),
            "{name}: text encoder config"
        );
        let mut te2_layers = 0;
        if arch == SingleFileArch::SdxlBase {
            let want: oxidiff::models::ClipTextConfig =
                serde_json::from_value(configs["text_encoder_2"].clone()).unwrap();
            let te2 = file.text_encoder_2_config().unwrap();
            assert_eq!(
                clip_fields(&te2),
                clip_fields(&want),
                "{name}: text encoder 2 config"
            );
            te2_layers = te2.num_hidden_layers;
        }

        // Names and shapes through the views.
        let expected = &layout["diffusers_shapes"];
        let unet = sorted_shapes(&file.unet_weights().unwrap());
        assert_same(
            unet,
            shape_list(&expected["unet"]),
            &format!("{name}: UNet"),
        );
        let vae = sorted_shapes(&file.vae_weights().unwrap());
        assert_same(vae, shape_list(&expected["vae"]), &format!("{name}: VAE"));
        let view = file.text_encoder_weights(te.num_hidden_layers).unwrap();
        let want = shape_list(&expected["text_encoder"]);
        assert_same(sorted_shapes(&view), want, &format!("{name}: text encoder"));
        if arch == SingleFileArch::SdxlBase {
            let view = file.text_encoder_2_weights(te2_layers).unwrap();
            let want = shape_list(&expected["text_encoder_2"]);
            assert_same(
                sorted_shapes(&view),
                want,
                &format!("{name}: text encoder 2"),
            );
        }
        // Every tensor is taken or one every LDM file carries (position ids, logit_scale,
        // SD 2's 24th block and text_projection, EMA and schedule buffers).
        let unmapped = file
            .unmapped_keys(te.num_hidden_layers, te2_layers)
            .unwrap();
        assert!(unmapped.is_empty(), "{name}: {unmapped:?}");
    }
}

/// Writes zero-filled F32 tensors of the given shapes.
fn write_shaped(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, s)| vec![0u8; 4 * s.iter().product::<usize>()])
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .map(|((k, s), d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (k.to_string(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn hostile_layouts_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let conv_in = (
        "model.diffusion_model.input_blocks.0.0.weight",
        vec![4, 4, 3, 3],
    );
    let open_clip = (
        "cond_stage_model.model.token_embedding.weight",
        vec![10, 100],
    );
    let cases: Vec<Vec<(&str, Vec<usize>)>> = vec![
        // A scalar fused projection, a 0-row one, a gap in the input blocks.
        vec![
            conv_in.clone(),
            open_clip.clone(),
            ("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight", vec![]),
            ("model.diffusion_model.input_blocks.5.0.op.weight", vec![1]),
        ],
        vec![
            conv_in.clone(),
            open_clip.clone(),
            ("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight", vec![0, 3]),
            ("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias", vec![2]),
        ],
        // SDXL keys with an added embedding that is not pooled width plus 6 time ids.
        vec![
            conv_in.clone(),
            ("conditioner.embedders.1.model.positional_embedding", vec![77, 64]),
            (
                "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight",
                vec![77, 64],
            ),
            ("conditioner.embedders.1.model.text_projection", vec![64, 64]),
            ("model.diffusion_model.label_emb.0.0.weight", vec![8, 65]),
            ("model.diffusion_model.input_blocks.1.0.out_layers.3.weight", vec![8, 8, 3, 3]),
            ("model.diffusion_model.out.2.weight", vec![4, 8, 3, 3]),
        ],
    ];
    for (i, tensors) in cases.iter().enumerate() {
        let path = dir.path().join(format!("hostile{i}.safetensors"));
        write_shaped(&path, tensors);
        let file = SingleFile::open(&path).unwrap();
        // Each either works on what is there or says what is wrong; none panics.
        let results = [
            file.unet_weights().err().map(|e| e.to_string()),
            file.vae_weights().err().map(|e| e.to_string()),
            file.text_encoder_weights(4).err().map(|e| e.to_string()),
            file.text_encoder_2_weights(4).err().map(|e| e.to_string()),
            file.unet_config(false).err().map(|e| e.to_string()),
            file.vae_config(false).err().map(|e| e.to_string()),
            file.text_encoder_config().err().map(|e| e.to_string()),
            file.unmapped_keys(4, 4).err().map(|e| e.to_string()),
        ];
        assert!(
            results[4].is_some(),
            "case {i}: a broken UNet layout gave a config"
        );
        for r in results.into_iter().flatten() {
            assert!(
                r.contains(&format!("hostile{i}.safetensors")) || r.contains("weight"),
                "{r}"
            );
        }
        let err = StableDiffusionPipeline::<B>::from_single_file(
            &path,
            &SingleFileOptions {
                tokenizer: Some(model_dir("tiny-sd1").join("tokenizer")),
                ..Default::default()
            },
            &Default::default(),
        );
        assert!(err.is_err(), "case {i}");
    }
}

// ---- Inpainting and SDXL refiner single files (`tools/golden/make_single_file_edit.py`) -------

fn edit_golden() -> Golden {
    Golden::load("single-file-edit")
}

/// The checkpoint of `recipe` in single-file-edit.json, written into `dir` as the golden script
/// wrote it: the base single file without the dropped prefixes, renamed, plus the stored UNet
/// part (the same tensors, bit for bit; only the header's order may differ).
fn compose(golden: &Golden, recipe: &str, dir: &Path) -> PathBuf {
    let r = &golden.json["recipes"][recipe];
    let read = |key: &str| {
        std::fs::read(
            fixtures()
                .join("single-file")
                .join(r[key].as_str().unwrap()),
        )
        .unwrap()
    };
    let strings = |key: &str| -> Vec<String> {
        r[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let (drop, rename) = (strings("drop"), r["rename"].as_array().unwrap());
    let (base, unet) = (read("base"), read("unet"));
    let base = safetensors::SafeTensors::deserialize(&base).unwrap();
    let unet = safetensors::SafeTensors::deserialize(&unet).unwrap();
    let mut tensors = Vec::new();
    for (mut name, view) in base.tensors() {
        if drop.iter().any(|p| name.starts_with(p.as_str())) {
            continue;
        }
        for pair in rename {
            let (old, new) = (pair[0].as_str().unwrap(), pair[1].as_str().unwrap());
            if let Some(rest) = name.strip_prefix(old) {
                name = format!("{new}{rest}");
            }
        }
        tensors.push((name, view));
    }
    tensors.extend(unet.tensors());
    assert_eq!(
        tensors.len() as u64,
        r["tensors"].as_u64().unwrap(),
        "{recipe}"
    );
    let path = dir.join(format!("{recipe}.safetensors"));
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    path
}

fn edit_options(golden: &Golden, recipe: &str) -> SingleFileOptions {
    SingleFileOptions {
        config: Some(model_dir(
            golden.json["recipes"][recipe]["config"].as_str().unwrap(),
        )),
        ..Default::default()
    }
}

fn edit_request(golden: &Golden, guidance: &str) -> GenerateRequest<B> {
    let s = &golden.json["settings"];
    GenerateRequest {
        prompts: vec![s["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: s[guidance].as_f64().unwrap(),
        seed: s["seed"].as_u64().unwrap(),
        width: Some(64),
        height: Some(64),
        ..Default::default()
    }
}

fn edit_inputs() -> (image::DynamicImage, image::DynamicImage) {
    use oxidiff::pipelines::image::{load_image, load_mask};
    (
        load_image(&fixtures().join("golden/img2img-input.png")).unwrap(),
        load_mask(&fixtures().join("golden/inpaint-mask.png")).unwrap(),
    )
}

type Steps = std::cell::RefCell<Vec<(f64, Tensor<B, 4>)>>;

fn recorder(steps: &Steps) -> impl FnMut(oxidiff::pipelines::StepInfo<'_, B>) + '_ {
    |info| {
        steps
            .borrow_mut()
            .push((info.timestep, info.latents.clone()))
    }
}

#[test]
fn inpainting_single_file_matches_diffusers_from_single_file() {
    let golden = edit_golden();
    let tmp = tempfile::tempdir().unwrap();
    let path = compose(&golden, "inpaint", tmp.path());
    let file = SingleFile::open(&path).unwrap();
    assert_eq!(file.arch, SingleFileArch::Sd1);
    assert!(file.inpainting);
    assert_eq!(file.model_type(), "inpainting");
    assert_eq!(
        oxidiff::pipelines::single_file_pipeline_class(&path).unwrap(),
        "StableDiffusionInpaintPipeline"
    );
    // The built-in config reads the 9 input channels from the tensors.
    let want =
        UNet2DConditionConfig::from_file(&model_dir("tiny-sd1-inpaint-unet").join("config.json"))
            .unwrap();
    let got = file.unet_config(false).unwrap();
    assert_eq!(got.in_channels, 9);
    assert_eq!(got.block_out_channels, want.block_out_channels);
    assert_eq!(got.down_block_types, want.down_block_types);

    let mut pipe = oxidiff::pipelines::StableDiffusionInpaintPipeline::<B>::from_single_file(
        &path,
        &edit_options(&golden, "inpaint"),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(pipe.unet_in_channels(), 9);
    let (image, mask) = edit_inputs();
    let req = edit_request(&golden, "sd_guidance_scale");
    let strength = golden.json["settings"]["inpaint_strength"]
        .as_f64()
        .unwrap();
    let steps = Steps::default();
    let mut generator = oxidiff::schedulers::TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(
            &req,
            &image,
            &mask,
            strength,
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    common::golden_run::check_run(
        &golden,
        "sd9-inpaint",
        steps.into_inner(),
        out.images.unwrap(),
    );
}

#[test]
fn sdxl_refiner_single_file_matches_diffusers_from_single_file() {
    use oxidiff::pipelines::{StableDiffusionXLImg2ImgPipeline, XlEditOptions, XlInitImage};
    let golden = edit_golden();
    let tmp = tempfile::tempdir().unwrap();
    let path = compose(&golden, "refiner", tmp.path());
    let file = SingleFile::open(&path).unwrap();
    assert_eq!(file.arch, SingleFileArch::SdxlRefiner);
    assert!(!file.inpainting);
    assert_eq!(file.model_type(), "xl_refiner");
    assert_eq!(file.time_ids(), Some(5));
    assert_eq!(
        oxidiff::pipelines::single_file_pipeline_class(&path).unwrap(),
        "StableDiffusionXLImg2ImgPipeline"
    );
    // Built-in configs: the refiner's one encoder under `conditioner.embedders.0.model.`, and
    // its UNet's added condition of 5 time ids (pooled width + 5 x 4 = 28).
    let want =
        UNet2DConditionConfig::from_file(&model_dir("tiny-sdxl-refiner").join("unet/config.json"))
            .unwrap();
    let got = file.unet_config(false).unwrap();
    assert_eq!(got.addition_time_embed_dim, want.addition_time_embed_dim);
    assert_eq!(
        got.projection_class_embeddings_input_dim,
        want.projection_class_embeddings_input_dim
    );
    assert_eq!(got.cross_attention_dim, want.cross_attention_dim);
    let err = file.text_encoder_2_config().unwrap_err().to_string();
    assert!(err.contains("8 wide"), "{err}");

    let mut pipe = StableDiffusionXLImg2ImgPipeline::<B>::from_single_file(
        &path,
        &edit_options(&golden, "refiner"),
        &Default::default(),
    )
    .unwrap();
    assert!(pipe.pipe.text_encoder.is_none() && pipe.pipe.tokenizer.is_none());
    assert!(pipe.pipe.requires_aesthetics_score);
    assert!(!pipe.pipe.force_zeros_for_empty_prompt);
    let s = &golden.json["settings"];
    let edit = XlEditOptions {
        strength: s["refiner_strength"].as_f64().unwrap(),
        aesthetic_score: s["aesthetic_score"].as_f64().unwrap(),
        negative_aesthetic_score: s["negative_aesthetic_score"].as_f64().unwrap(),
        ..Default::default()
    };
    let (image, _) = edit_inputs();
    let mut req = edit_request(&golden, "xl_guidance_scale");
    (req.width, req.height) = (None, None);
    let steps = Steps::default();
    let mut generator = oxidiff::schedulers::TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(
            &XlRequest::new(req.clone()),
            &edit,
            XlInitImage::Image(&image),
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    common::golden_run::check_run(
        &golden,
        "refiner-image",
        steps.into_inner(),
        out.images.unwrap(),
    );

    // The refiner is not a text-to-image checkpoint for the SD loader.
    let err = StableDiffusionPipeline::<B>::from_single_file(
        &path,
        &edit_options(&golden, "refiner"),
        &Default::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("SDXL refiner"), "{err}");
}

#[test]
fn img2img_takes_single_file_inpainting_and_refiner_checkpoints() {
    let golden = edit_golden();
    let tmp = tempfile::tempdir().unwrap();
    let s = &golden.json["settings"];
    let input = fixtures().join("golden/img2img-input.png");
    let mask = fixtures().join("golden/inpaint-mask.png");
    let (steps, seed) = (s["num_inference_steps"].to_string(), s["seed"].to_string());
    for (recipe, case, guidance, strength) in [
        (
            "inpaint",
            "sd9-inpaint",
            "sd_guidance_scale",
            "inpaint_strength",
        ),
        (
            "refiner",
            "refiner-image",
            "xl_guidance_scale",
            "refiner_strength",
        ),
    ] {
        let path = compose(&golden, recipe, tmp.path());
        let config = model_dir(golden.json["recipes"][recipe]["config"].as_str().unwrap());
        let out = tmp.path().join(format!("{case}.png"));
        let (guidance, strength) = (s[guidance].to_string(), s[strength].to_string());
        let mut args = vec![
            "--model",
            path.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--image",
            input.to_str().unwrap(),
            "--steps",
            &steps,
            "--seed",
            &seed,
            "--guidance",
            &guidance,
            "--strength",
            &strength,
            "--negative-prompt",
            s["negative_prompt"].as_str().unwrap(),
            "--aesthetic-score",
            "7",
            "--negative-aesthetic-score",
            "2",
            "-o",
            out.to_str().unwrap(),
        ];
        if recipe == "inpaint" {
            args.extend(["--mask", mask.to_str().unwrap()]);
        }
        args.push(s["prompt"].as_str().unwrap());
        let result = std::process::Command::new(env!("CARGO_BIN_EXE_img2img"))
            .args(&args)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&result.stderr);
        assert!(result.status.success(), "{recipe}: {err}");
        let ours = image::open(&out).unwrap().to_rgb8();
        common::assert_png_close(&ours, &format!("single-file-edit-{case}.png"), 2);

        // txt2img sends edit-only checkpoints to img2img.
        let never = tmp.path().join("never.png");
        let result = txt2img(&[
            "--model",
            path.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "-o",
            never.to_str().unwrap(),
            "a prompt",
        ]);
        let err = String::from_utf8_lossy(&result.stderr);
        assert_eq!(result.status.code(), Some(1), "{err}");
        assert!(err.contains("use the img2img binary"), "{err}");
        assert!(!never.exists());
    }

    // --config belongs to single files in img2img too.
    let folder = model_dir("tiny-sd1-inpaint");
    let never = tmp.path().join("never.png");
    let result = std::process::Command::new(env!("CARGO_BIN_EXE_img2img"))
        .args([
            "--model",
            folder.to_str().unwrap(),
            "--config",
            folder.to_str().unwrap(),
            "--image",
            input.to_str().unwrap(),
            "-o",
            never.to_str().unwrap(),
            "a prompt",
        ])
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(1), "{err}");
    assert!(err.contains("single-file"), "{err}");
    assert!(!never.exists());
}

#[test]
fn instruct_pix2pix_and_inpainting_refiner_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, conv_in: Vec<usize>, extra: &str| {
        let path = dir.path().join(name);
        write_shaped(
            &path,
            &[
                ("model.diffusion_model.input_blocks.0.0.weight", conv_in),
                (extra, vec![4, 4]),
            ],
        );
        path
    };
    let p2p = write(
        "p2p.safetensors",
        vec![8, 8, 3, 3],
        "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
    );
    let msg = open_err(&p2p);
    assert!(msg.contains("InstructPix2Pix"), "{msg}");
    let refiner9 = write(
        "refiner9.safetensors",
        vec![8, 9, 3, 3],
        "conditioner.embedders.0.model.text_projection",
    );
    let msg = open_err(&refiner9);
    assert!(msg.contains("refiner with a 9-channel"), "{msg}");
    let sd9 = write(
        "sd9.safetensors",
        vec![8, 9, 3, 3],
        "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
    );
    let file = SingleFile::open(&sd9).unwrap();
    assert!(file.inpainting && file.arch == SingleFileArch::Sd1);
}

#[test]
fn inpainting_model_types_follow_diffusers() {
    // diffusers' infer_diffusers_model_type: a 9-channel `input_blocks.0.0` makes `inpainting`,
    // `inpainting_v2` (with SD 2's 1024-wide context) or `xl_inpaint` (with SDXL's keys), whose
    // default repositories give configs and tokenizers; SD 2 inpainting predicts noise.
    let dir = tempfile::tempdir().unwrap();
    let conv_in = (
        "model.diffusion_model.input_blocks.0.0.weight",
        vec![8, 9, 3, 3],
    );
    type Case<'a> = (
        &'a str,
        Vec<(&'a str, Vec<usize>)>,
        SingleFileArch,
        &'a str,
        &'a str,
    );
    let cases: [Case; 3] = [
        (
            "sd1",
            vec![
                conv_in.clone(),
                (
                    "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
                    vec![77, 8],
                ),
            ],
            SingleFileArch::Sd1,
            "inpainting",
            "stable-diffusion-v1-5/stable-diffusion-inpainting",
        ),
        (
            "sd2",
            vec![
                conv_in.clone(),
                (oxidiff::models::single_file::KEY_V2, vec![320, 1024]),
            ],
            SingleFileArch::Sd2,
            "inpainting_v2",
            "stabilityai/stable-diffusion-2-inpainting",
        ),
        (
            "sdxl",
            vec![
                conv_in.clone(),
                (oxidiff::models::single_file::KEY_XL_BASE, vec![1280]),
                (
                    "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight",
                    vec![77, 8],
                ),
            ],
            SingleFileArch::SdxlBase,
            "xl_inpaint",
            "diffusers/stable-diffusion-xl-1.0-inpainting-0.1",
        ),
    ];
    for (name, tensors, arch, model_type, repo) in cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        write_shaped(&path, &tensors);
        let file = SingleFile::open(&path).unwrap();
        assert_eq!(file.arch, arch, "{name}");
        assert!(file.inpainting, "{name}");
        assert_eq!(file.model_type(), model_type, "{name}");
        assert_eq!(file.default_repo(), repo, "{name}");
        assert!(!file.predicts_v(), "{name}: inpainting predicts noise");
        let class = oxidiff::pipelines::single_file_pipeline_class(&path).unwrap();
        let want = if arch == SingleFileArch::SdxlBase {
            "StableDiffusionXLInpaintPipeline"
        } else {
            "StableDiffusionInpaintPipeline"
        };
        assert_eq!(class, want, "{name}");
    }
}

#[test]
fn sdxl_inpainting_single_file_matches_diffusers_from_single_file() {
    use oxidiff::pipelines::{StableDiffusionXLInpaintPipeline, XlEditOptions};
    let golden = edit_golden();
    let tmp = tempfile::tempdir().unwrap();
    let path = compose(&golden, "xl-inpaint", tmp.path());
    let file = SingleFile::open(&path).unwrap();
    assert_eq!(file.model_type(), "xl_inpaint");
    assert_eq!(
        oxidiff::pipelines::single_file_pipeline_class(&path).unwrap(),
        "StableDiffusionXLInpaintPipeline"
    );
    let mut pipe = StableDiffusionXLInpaintPipeline::<B>::from_single_file(
        &path,
        &edit_options(&golden, "xl-inpaint"),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(pipe.unet_in_channels(), 9);
    let edit = XlEditOptions {
        strength: golden.json["settings"]["xl_inpaint_strength"]
            .as_f64()
            .unwrap(),
        ..Default::default()
    };
    let (image, mask) = edit_inputs();
    let req = edit_request(&golden, "xl_guidance_scale");
    let steps = Steps::default();
    let mut generator = oxidiff::schedulers::TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(
            &XlRequest::new(req.clone()),
            &edit,
            &image,
            &mask,
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    common::golden_run::check_run(
        &golden,
        "xl9-inpaint",
        steps.into_inner(),
        out.images.unwrap(),
    );
}

// --- single-file ControlNets (tools/golden/make_controlnet_single_file.py) ---------------------

/// tiny-controlnet-sd1 in lllyasviel's layout (`control_model.zero_convs.0.0.weight`, ...).
fn controlnet_file() -> PathBuf {
    fixtures().join("single-file/tiny-controlnet-sd1.safetensors")
}

/// The file in lllyasviel's layout, with the folder's config (diffusers'
/// `from_single_file(config=folder)`), gives diffusers' residuals (the folder's golden), and
/// the pipeline with it diffusers' image; without a config, the built-in one (32 norm groups)
/// does not fit the tiny model and the error says what to pass.
#[test]
fn an_original_layout_controlnet_file_matches_diffusers() {
    use oxidiff::models::{ControlNetFile, ControlNetLayout, ControlNetModel};
    use oxidiff::pipelines::{Control, ControlRequest, StableDiffusionControlNetPipeline};
    let device = Default::default();
    let file = ControlNetFile::open(&controlnet_file()).unwrap();
    assert_eq!(
        file.layout,
        ControlNetLayout::Original {
            prefix: "control_model."
        }
    );
    let folder = model_dir("tiny-controlnet-sd1");
    let net = ControlNetModel::<B>::from_single_file(
        &controlnet_file(),
        Some(&folder),
        burn::tensor::FloatDType::F32,
        &device,
    )
    .unwrap();
    let golden = Golden::load("controlnet");
    let residuals = net
        .forward(
            golden.tensor("sample"),
            golden.tensor("timestep"),
            golden.tensor("context"),
            golden.tensor("cond"),
            0.7,
            false,
            None,
        )
        .unwrap();
    for (i, r) in residuals.down.iter().enumerate() {
        assert_close(&golden, &format!("down.{i}"), r.clone(), TOL);
    }
    assert_close(&golden, "mid", residuals.mid, TOL);

    let pipe = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &Default::default(),
        &device,
    )
    .unwrap();
    let mut pipe = StableDiffusionControlNetPipeline::new(pipe, vec![net]).unwrap();
    let control = ControlRequest {
        controls: vec![Control::new(
            image::open(fixtures().join("golden/controlnet-input.png")).unwrap(),
        )],
        guess_mode: false,
    };
    let request = GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 7.5,
        seed: 42,
        ..Default::default()
    };
    let out = pipe.generate(&request, &control).unwrap();
    common::assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "controlnet-sd1-single.png",
        2,
    );

    let Err(err) = ControlNetModel::<B>::from_single_file(
        &controlnet_file(),
        None,
        burn::tensor::FloatDType::F32,
        &device,
    ) else {
        panic!("the built-in config does not fit the tiny ControlNet");
    };
    let err = err.to_string();
    assert!(
        err.contains("tiny-controlnet-sd1.safetensors") && err.contains("config"),
        "{err}"
    );
}

/// The released ControlNets' layouts (shapes only): lllyasviel's SD 1.5 and an SD 2.1 one in
/// the original layout, diffusers' SDXL one under its own names: the renaming gives exactly
/// diffusers' names and shapes, and the config read from the tensors is the released one.
#[test]
fn released_controlnet_layouts_rename_and_configure_as_diffusers() {
    use oxidiff::models::{ControlNetConfig, ControlNetFile, ControlNetLayout};
    let text =
        std::fs::read_to_string(fixtures().join("single-file/released-controlnet-layouts.json"))
            .unwrap();
    let layouts: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shapes = |v: &serde_json::Value| -> Vec<(String, Vec<usize>)> {
        let mut out: Vec<(String, Vec<usize>)> = v
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, s)| {
                let dims = s
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize);
                (k.clone(), dims.collect())
            })
            .collect();
        out.sort();
        out
    };
    for name in ["sd15", "sd21", "sdxl"] {
        let layout = &layouts[name];
        let label = PathBuf::from(format!("controlnet-{name}.safetensors"));
        let weights = Weights::shapes_only(&label, shapes(&layout["shapes"])).unwrap();
        let file = ControlNetFile::from_weights(&label, weights).unwrap();
        let original = layout["layout"] == "original";
        assert_eq!(
            matches!(file.layout, ControlNetLayout::Original { .. }),
            original,
            "{name}"
        );
        let renamed = file.weights().unwrap();
        let mut ours: Vec<(String, Vec<usize>)> = renamed
            .keys()
            .map(|k| (k.to_string(), renamed.shape(k).unwrap().to_vec()))
            .collect();
        ours.sort();
        assert_eq!(
            ours,
            shapes(&layout["diffusers_shapes"]),
            "{name}: names and shapes"
        );

        let want: ControlNetConfig = serde_json::from_value(layout["config"].clone()).unwrap();
        let want = want.completed(Path::new(name)).unwrap();
        let got = file.config().unwrap();
        let path = Path::new(name);
        let fields = |c: &ControlNetConfig| {
            let u = &c.unet;
            let n = u.block_out_channels.len();
            format!(
                "{:?}",
                (
                    (
                        u.in_channels,
                        &u.down_block_types,
                        &u.mid_block_type,
                        &u.block_out_channels,
                        u.layers_per_block.expand(n, "", path).unwrap(),
                        u.transformer_layers_per_block.expand(n, "", path).unwrap(),
                        u.cross_attention_dim.expand(n, "", path).unwrap(),
                        u.heads(path).unwrap(),
                    ),
                    (
                        u.norm_num_groups,
                        u.use_linear_projection,
                        u.upcast_attention,
                        &u.addition_embed_type,
                        u.addition_time_embed_dim,
                        u.projection_class_embeddings_input_dim,
                    ),
                    (
                        c.conditioning_channels,
                        &c.conditioning_embedding_out_channels,
                        &c.controlnet_conditioning_channel_order,
                        c.global_pool_conditions,
                    ),
                )
            )
        };
        assert_eq!(fields(&got), fields(&want), "{name}: config");
    }
}

/// Files that are not a ControlNet oxidiff reads are one clear error naming the file: a
/// pickle, a whole SD checkpoint, a Control-LoRA, an SD3 ControlNet's weights, a tensor
/// outside lllyasviel's layout.
#[test]
fn files_that_are_not_controlnets_are_refused_with_the_reason() {
    use oxidiff::models::ControlNetFile;
    let tmp = tempfile::tempdir().unwrap();
    let pth = tmp.path().join("control_v11p_sd15_canny.pth");
    std::fs::write(&pth, b"PK\x03\x04").unwrap();
    let lora = tmp.path().join("control-lora-canny.safetensors");
    write_tensors(
        &lora,
        &["lora_controlnet", "input_blocks.1.0.in_layers.0.weight"],
    );
    let stray = tmp.path().join("stray.safetensors");
    write_tensors(
        &stray,
        &[
            "control_model.input_hint_block.0.weight",
            "control_model.input_blocks.1.0.in_layers.0.weight",
            "control_model.output_blocks.0.0.in_layers.0.weight",
        ],
    );
    let sd3 = model_dir("tiny-controlnet-sd3").join("diffusion_pytorch_model.safetensors");
    let cases = [
        (pth, "pickle"),
        (
            checkpoint("tiny-sd1"),
            "a whole Stable Diffusion checkpoint",
        ),
        (lora, "Control-LoRA"),
        (sd3, "SD3 or Flux ControlNet"),
        (
            stray,
            "`control_model.output_blocks.0.0.in_layers.0.weight` is not part of a ControlNet",
        ),
    ];
    for (path, want) in cases {
        let err = ControlNetFile::open(&path)
            .and_then(|f| f.names().map(|_| f))
            .err()
            .unwrap_or_else(|| panic!("{} was read", path.display()))
            .to_string();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(err.contains(want) && err.contains(&file), "{file}: {err}");
    }
}
