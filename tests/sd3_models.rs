//! The SD3 transformer against diffusers' `SD3Transformer2DModel`, on the fixtures of
//! `tools/golden/make_tiny_sd3.py`: SD3 (two joint blocks, the last `context_pre_only`) and an
//! SD3.5-style transformer (QK RMS norm, dual attention in block 0), at a latent size whose
//! patch grid is cropped from the position table.
//!
//! Tolerance 1e-4 relative (to the tensor's largest magnitude): f32 on both sides, but PyTorch
//! and burn-flex sum in different orders.

mod common;

use burn::tensor::{Tensor, TensorData};
use common::{assert_close, fixtures, model_dir, Golden, B};
use oxidiff::models::transformer_sd3::JointTransformerBlock;
use oxidiff::models::{SD3Transformer2DConfig, SD3Transformer2DModel};
use oxidiff_parallel::{ShardStyle, TensorParallel};

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-sd3";

fn call(golden: &Golden, model: &SD3Transformer2DModel<B>) -> Tensor<B, 4> {
    let device = Default::default();
    let t = golden.json["transformer_timestep"].as_f64().unwrap() as f32;
    let timestep = Tensor::from_data(TensorData::new(vec![t, t], [2]), &device);
    model
        .forward(
            golden.tensor("transformer.sample"),
            timestep,
            golden.tensor("transformer.encoder_hidden_states"),
            golden.tensor("transformer.pooled_projections"),
        )
        .unwrap()
}

#[test]
fn sd3_transformer_matches_diffusers() {
    let golden = Golden::load(NAME);
    let model = SD3Transformer2DModel::<B>::from_dir(
        &model_dir(NAME).join("transformer"),
        None,
        &Default::default(),
    )
    .unwrap();
    assert!(matches!(
        model.transformer_blocks[1],
        JointTransformerBlock::ContextPreOnly(_)
    ));
    assert_close(&golden, "transformer.out", call(&golden, &model), TOL);
}

#[test]
fn sd35_transformer_with_qk_norm_and_dual_attention_matches_diffusers() {
    let golden = Golden::load(NAME);
    let dir = fixtures().join("tiny-sd35-transformer");
    let config = SD3Transformer2DConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(config.qk_norm.as_deref(), Some("rms_norm"));
    assert_eq!(config.dual_attention_layers, vec![0]);
    let model = SD3Transformer2DModel::<B>::from_dir(&dir, None, &Default::default()).unwrap();
    let JointTransformerBlock::DualAttention(first) = &model.transformer_blocks[0] else {
        panic!("block 0 of dual_attention_layers [0] is not a dual-attention block");
    };
    assert!(first.attn.norm_added_q.is_some() && first.attn2.norm_q.is_some());
    assert!(!matches!(
        model.transformer_blocks[1],
        JointTransformerBlock::DualAttention(_)
    ));
    assert_close(&golden, "transformer_sd35.out", call(&golden, &model), TOL);
}

#[test]
fn sd3_transformer_refuses_a_grid_beyond_pos_embed_max_size() {
    let model = SD3Transformer2DModel::<B>::from_dir(
        &model_dir(NAME).join("transformer"),
        None,
        &Default::default(),
    )
    .unwrap();
    // pos_embed_max_size 12 patches of 2: 26 latent rows are 13 patches.
    let err = model.check_inputs([1, 16, 26, 8], 1, [1, 10, 32], [1, 16]);
    let message = err.unwrap_err().to_string();
    assert!(message.contains("pos_embed_max_size"), "{message}");
    assert!(model
        .check_inputs([1, 16, 24, 8], 1, [1, 10, 32], [1, 16])
        .is_ok());
    let message = model
        .check_inputs([1, 16, 8, 8], 1, [1, 10, 16], [1, 16])
        .unwrap_err()
        .to_string();
    assert!(message.contains("[batch, seq, 32]"), "{message}");
}

#[test]
fn sd3_config_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir(NAME).join("transformer/config.json")).unwrap(),
    )
    .unwrap();
    for (field, value, expect) in [
        ("qk_norm", serde_json::json!("l2"), "qk_norm"),
        (
            "dual_attention_layers",
            serde_json::json!([5]),
            "dual_attention_layers",
        ),
        (
            "caption_projection_dim",
            serde_json::json!(24),
            "caption_projection_dim",
        ),
    ] {
        let mut config = base.clone();
        config[field] = value;
        std::fs::write(&path, config.to_string()).unwrap();
        let message = SD3Transformer2DConfig::from_file(&path)
            .unwrap_err()
            .to_string();
        assert!(message.contains(expect), "{field}: {message}");
    }
}

#[test]
fn sd3_tensor_parallel_plan_splits_attention_and_feed_forward() {
    let plan = SD3Transformer2DModel::<B>::tensor_parallel_plan();
    let col = Some(ShardStyle::ColumnWise);
    let row = Some(ShardStyle::RowWise);
    for (path, style) in [
        ("transformer_blocks.0.attn.to_q", col),
        ("transformer_blocks.17.attn.add_v_proj", col),
        ("transformer_blocks.3.attn.to_out.0", row),
        ("transformer_blocks.3.attn.to_add_out", row),
        ("transformer_blocks.0.attn2.to_k", col),
        ("transformer_blocks.0.attn2.to_out.0", row),
        ("transformer_blocks.2.ff.net.0.proj", col),
        ("transformer_blocks.2.ff_context.net.2", row),
        ("transformer_blocks.2.norm1.linear", None),
        ("context_embedder", None),
        ("proj_out", None),
    ] {
        assert_eq!(plan.style_of(path), style, "{path}");
    }
    // Every rule names a linear layer the checkpoint has.
    let weights = oxidiff::models::Weights::from_component_dir(
        &fixtures().join("tiny-sd35-transformer"),
        &["diffusion_pytorch_model"],
        None,
    )
    .unwrap();
    let modules: Vec<String> = weights
        .keys()
        .filter_map(|k| k.strip_suffix(".weight").map(str::to_string))
        .collect();
    for rule in plan.rules {
        assert!(
            modules.iter().any(|m| rule.matches(m)),
            "rule {} matches no module",
            rule.pattern
        );
    }
}
