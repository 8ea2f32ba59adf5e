//! Each model against diffusers on the tiny SD 1.x and 2.x pipelines.
//!
//! Tolerance 1e-4 relative (to the tensor's largest magnitude): f32 on both sides, but PyTorch and
//! burn-flex sum in different orders; 1 vs 2 torch threads already differ by about 1e-5.

mod common;

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, model_dir, Golden, B};
use oxidiff::models::vae_tiling::VaeTiling;
use oxidiff::models::{AutoencoderKL, ClipTextModel, ClipTokenizer, UNet2DConditionModel};

const TOL: f32 = 1e-4;

fn tokenizer_matches(name: &str) {
    let golden = Golden::load(name);
    let tokenizer = ClipTokenizer::from_dir(&model_dir(name).join("tokenizer")).unwrap();
    let cases = golden.json["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let encoded = tokenizer.encode(text).unwrap();
        assert_eq!(encoded.ids, expected, "token ids of {text:?}");
    }
}

#[test]
fn clip_tokenizer_ids_match_transformers_sd1() {
    tokenizer_matches("tiny-sd1");
}

#[test]
fn clip_tokenizer_ids_match_transformers_sd2_with_bang_padding() {
    tokenizer_matches("tiny-sd2");
}

#[test]
fn long_prompt_is_truncated_and_flagged() {
    let tokenizer = ClipTokenizer::from_dir(&model_dir("tiny-sd1").join("tokenizer")).unwrap();
    let long = "a red apple on a table ".repeat(30);
    let encoded = tokenizer.encode(&long).unwrap();
    assert!(encoded.truncated);
    assert_eq!(encoded.ids.len(), 77);
    assert_eq!(encoded.ids[76], tokenizer.eos_id());
    assert!(!tokenizer.encode("a red apple").unwrap().truncated);
}

fn clip_matches(name: &str) {
    let golden = Golden::load(name);
    let device = Default::default();
    let model =
        ClipTextModel::<B>::from_dir(&model_dir(name).join("text_encoder"), false, None, &device)
            .unwrap();
    let rows = golden.token_rows("clip.input_ids");
    let out = model.forward(&rows, false).unwrap();
    assert_close(
        &golden,
        "clip.last_hidden_state",
        out.last_hidden_state,
        TOL,
    );
    assert_close(&golden, "clip.pooler_output", out.pooler_output, TOL);
}

#[test]
fn clip_text_model_matches_diffusers_sd1_sharded() {
    clip_matches("tiny-sd1");
}

#[test]
fn clip_text_model_matches_diffusers_sd2() {
    clip_matches("tiny-sd2");
}

fn unet_matches(name: &str, variant: Option<&str>, tol: f32) {
    let golden = Golden::load(name);
    let device = Default::default();
    let unet = UNet2DConditionModel::<B>::from_dir(&model_dir(name).join("unet"), variant, &device)
        .unwrap();
    let t = golden.json["unet_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::<B, 1>::from_data(TensorData::new(vec![t], [1]), &device);
    let out = unet.forward(
        golden.tensor("unet.sample"),
        timestep,
        golden.tensor("unet.encoder_hidden_states"),
    );
    assert_close(&golden, "unet.out", out, tol);
}

#[test]
fn unet_matches_diffusers_on_tiny_sd1() {
    unet_matches("tiny-sd1", None, TOL);
}

#[test]
fn unet_matches_diffusers_on_tiny_sd2_linear_projection_per_block_heads() {
    unet_matches("tiny-sd2", None, TOL);
}

/// The fp16 variant file holds the same weights rounded to half precision; computing in f32 from
/// them moves the output by about the f16 rounding of the weights (2^-11 relative), hence 1e-2.
#[test]
fn unet_loads_fp16_variant() {
    unet_matches("tiny-sd2", Some("fp16"), 1e-2);
}

fn vae_matches(name: &str) {
    let golden = Golden::load(name);
    let device = Default::default();
    let vae = AutoencoderKL::<B>::from_dir(&model_dir(name).join("vae"), None, &device).unwrap();
    assert_close(
        &golden,
        "vae.decode.out",
        vae.decode(golden.tensor("vae.decode.in")),
        TOL,
    );
    let dist = vae.encode(golden.tensor("vae.encode.in"));
    assert_close(&golden, "vae.encode.mean", dist.mean, TOL);
    assert_close(&golden, "vae.encode.logvar", dist.logvar, TOL);
}

#[test]
fn vae_decode_and_encode_match_diffusers_sd1() {
    vae_matches("tiny-sd1");
}

#[test]
fn vae_decode_and_encode_match_diffusers_sd2() {
    vae_matches("tiny-sd2");
}

/// tools/golden/make_vae_tiling.py: 64-pixel tiles (8 latent cells) over inputs that leave
/// partial tiles at the right and bottom edges.
#[test]
fn tiled_vae_decode_and_encode_match_diffusers_and_slicing_changes_nothing() {
    let golden = Golden::load("vae-tiling");
    let device = Default::default();
    let mut vae =
        AutoencoderKL::<B>::from_dir(&model_dir("tiny-sd1").join("vae"), None, &device).unwrap();
    // diffusers' default tiles are the config's sample_size (64 here).
    assert_eq!(vae.default_tiling, VaeTiling::new(64, 8).unwrap());
    let latents: Tensor<B, 4> = golden.tensor("latents");
    let untiled = vae.decode(latents.clone());
    vae.enable_tiling(VaeTiling::new(64, 8).unwrap());
    let tiled = vae.decode(latents.clone());
    // Tiling really changes the result (diffusers' own difference is in the json).
    let recorded = golden.json["tiled_vs_untiled_max_abs"].as_f64().unwrap() as f32;
    let ours = (tiled.clone() - untiled.clone()).abs().max().into_scalar();
    assert!(
        recorded > 1.0 && (ours - recorded).abs() < 1e-2,
        "{ours} vs {recorded}"
    );
    assert_close(&golden, "decode.tiled", tiled.clone(), TOL);
    let dist = vae.encode(golden.tensor("image"));
    assert_close(&golden, "encode.mean", dist.mean, TOL);
    assert_close(&golden, "encode.logvar", dist.logvar, TOL);

    // Slicing decodes one image at a time: the same values as the batch.
    vae.enable_slicing();
    let sliced = vae.decode(latents.clone());
    vae.disable_tiling();
    let sliced_untiled = vae.decode(latents);
    let diff = |a: Tensor<B, 4>, b: Tensor<B, 4>| (a - b).abs().max().into_scalar();
    assert!(diff(sliced, tiled) < 1e-5);
    assert!(diff(sliced_untiled, untiled) < 1e-5);
}

#[test]
fn vae_tiles_that_do_not_fit_are_refused() {
    for (size, factor) in [(60, 8), (8, 8), (0, 8)] {
        let err = VaeTiling::new(size, factor).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{size} pixels")) && err.contains("multiple of 8"),
            "{err}"
        );
    }
    assert_eq!(
        VaeTiling::new(64, 8).unwrap(),
        VaeTiling {
            sample: 64,
            latent: 8
        }
    );
}

/// Hub checkpoints (and transformers < 5) store CLIP weights under `text_model.`; transformers 5
/// drops the prefix. Both layouts must load to the same model.
#[test]
fn clip_loads_keys_with_text_model_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let src = model_dir("tiny-sd1").join("text_encoder");
    let weights = oxidiff::models::Weights::from_component_dir(&src, &["model"], None).unwrap();
    let mut tensors = Vec::new();
    for key in weights.keys().map(str::to_string).collect::<Vec<_>>() {
        let (values, shape) = weights.read_f32(&key).unwrap();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((format!("text_model.{key}"), shape, bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (k.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();

    let device = Default::default();
    let golden = Golden::load("tiny-sd1");
    let rows = golden.token_rows("clip.input_ids");
    let prefixed = ClipTextModel::<B>::from_dir(tmp.path(), false, None, &device).unwrap();
    let out = prefixed.forward(&rows, false).unwrap();
    assert_close(
        &golden,
        "clip.last_hidden_state",
        out.last_hidden_state,
        TOL,
    );
}

/// tools/golden/make_controlnet.py: the ControlNet's residuals at a conditioning scale and in
/// guess mode, and the UNet's prediction with them added.
#[test]
fn controlnet_residuals_and_controlled_unet_match_diffusers() {
    use oxidiff::models::ControlNetModel;
    let golden = Golden::load("controlnet");
    let device = Default::default();
    let net =
        ControlNetModel::<B>::from_dir(&model_dir("tiny-controlnet-sd1"), None, &device).unwrap();
    let unet =
        UNet2DConditionModel::<B>::from_dir(&model_dir("tiny-sd1").join("unet"), None, &device)
            .unwrap();
    net.check_fits(&unet).unwrap();
    let n = golden.json["residuals"].as_u64().unwrap() as usize;
    let run = |scale, guess| {
        net.forward(
            golden.tensor("sample"),
            golden.tensor("timestep"),
            golden.tensor("context"),
            golden.tensor("cond"),
            scale,
            guess,
            None,
        )
        .unwrap()
    };
    let residuals = run(0.7, false);
    assert_eq!(residuals.down.len(), n);
    for (i, r) in residuals.down.iter().enumerate() {
        assert_close(&golden, &format!("down.{i}"), r.clone(), TOL);
    }
    assert_close(&golden, "mid", residuals.mid.clone(), TOL);
    let guess = run(1.0, true);
    for (i, r) in guess.down.iter().enumerate() {
        assert_close(&golden, &format!("guess.down.{i}"), r.clone(), TOL);
    }
    assert_close(&golden, "guess.mid", guess.mid, TOL);
    let noise = unet
        .forward_controlled(
            golden.tensor("sample"),
            golden.tensor("timestep"),
            golden.tensor("context"),
            None,
            Some(&residuals),
        )
        .unwrap();
    assert_close(&golden, "unet.out", noise, TOL);
}
