//! The PixArt models against transformers and diffusers: the T5 tokenizer and encoder, and the
//! PixArt transformer, on the fixtures of `tools/golden/make_tiny_pixart.py`.
//!
//! Tolerance 1e-4 relative (to the tensor's largest magnitude): f32 on both sides (the T5
//! weights are stored as bf16 and widened on load, the reference used the same values), but
//! PyTorch and burn-flex sum in different orders.

mod common;

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, fixtures, model_dir, Golden, B};
use oxidiff::models::embeddings::MicroConditions;
use oxidiff::models::{PixArtTransformer2DModel, T5EncoderModel, T5Tokenizer};

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-pixart-alpha";

fn ids(value: &serde_json::Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn t5_tokenizer_ids_and_masks_match_transformers() {
    let golden = Golden::load(NAME);
    let tokenizer = T5Tokenizer::from_dir(&model_dir(NAME).join("tokenizer")).unwrap();
    let max_length = golden.json["pipeline"]["max_sequence_length"]
        .as_u64()
        .unwrap() as usize;
    let cases = golden.json["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 8);
    let mut truncated = 0;
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let encoded = tokenizer.encode(text, max_length).unwrap();
        assert_eq!(encoded.ids, ids(&case["ids"]), "token ids of {text:?}");
        assert_eq!(
            encoded.attention_mask,
            ids(&case["attention_mask"]),
            "mask of {text:?}"
        );
        assert_eq!(
            encoded.untruncated_len,
            case["untruncated_len"].as_u64().unwrap() as usize,
            "untruncated length of {text:?}"
        );
        truncated += usize::from(encoded.truncated());
    }
    assert_eq!(truncated, 1, "exactly the long case is cut");
}

fn rows(golden: &Golden, key: &str) -> Vec<Vec<u32>> {
    golden.token_rows(key)
}

#[test]
fn t5_encoder_matches_transformers_with_and_without_mask() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let model = T5EncoderModel::<B>::from_dir(&model_dir(NAME).join("text_encoder"), None, &device)
        .unwrap();
    let ids = rows(&golden, "t5.input_ids");
    let mask = rows(&golden, "t5.attention_mask");
    let out = model.forward(&ids, Some(&mask)).unwrap();
    assert_close(&golden, "t5.last_hidden_state", out, TOL);
    let out = model.forward(&ids, None).unwrap();
    assert_close(&golden, "t5.unmasked.last_hidden_state", out, TOL);
}

fn caption_inputs(golden: &Golden) -> (Tensor<B, 3>, Tensor<B, 4>, Tensor<B, 1>) {
    let device = Default::default();
    let mask = rows(golden, "transformer.encoder_attention_mask");
    let bias = PixArtTransformer2DModel::<B>::caption_mask_bias(&mask, &device);
    let t = golden.json["transformer_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::from_data(TensorData::new(vec![t, t], [2]), &device);
    (
        golden.tensor("transformer.encoder_hidden_states"),
        bias,
        timestep,
    )
}

#[test]
fn pixart_transformer_matches_diffusers_at_a_non_native_size() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let model = PixArtTransformer2DModel::<B>::from_dir(
        &model_dir(NAME).join("transformer"),
        None,
        &device,
    )
    .unwrap();
    assert!(!model.uses_micro_conditions());
    let (caption, bias, timestep) = caption_inputs(&golden);
    let out = model
        .forward(
            golden.tensor("transformer.sample"),
            timestep,
            caption,
            Some(bias),
            None,
        )
        .unwrap();
    assert_close(&golden, "transformer.out", out, TOL);
}

#[test]
fn pixart_1024_transformer_with_micro_conditions_matches_diffusers() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let model = PixArtTransformer2DModel::<B>::from_dir(
        &fixtures().join("tiny-pixart-transformer-1024"),
        None,
        &device,
    )
    .unwrap();
    assert!(model.uses_micro_conditions());
    let (caption, bias, timestep) = caption_inputs(&golden);
    let conditions = MicroConditions {
        resolution: golden.tensor("transformer_1024.resolution"),
        aspect_ratio: golden.tensor("transformer_1024.aspect_ratio"),
    };
    let missing = model.forward(
        golden.tensor("transformer_1024.sample"),
        timestep.clone(),
        caption.clone(),
        Some(bias.clone()),
        None,
    );
    assert!(
        missing
            .unwrap_err()
            .to_string()
            .contains("micro-conditions"),
        "a 1024 model without conditions is an error"
    );
    let out = model
        .forward(
            golden.tensor("transformer_1024.sample"),
            timestep,
            caption,
            Some(bias),
            Some(&conditions),
        )
        .unwrap();
    assert_close(&golden, "transformer_1024.out", out, TOL);
}
