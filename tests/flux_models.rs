//! The Flux models against diffusers and transformers: the rotary tables, the CLIP pooled and
//! T5 prompt embeddings, and one call of the dev (guidance-embedding) and schnell transformers,
//! on the fixtures of `tools/golden/make_tiny_flux.py`.
//!
//! Tolerance 1e-4 relative (to the tensor's largest magnitude): f32 on both sides, but PyTorch
//! and burn-flex sum in different orders.

mod common;

use burn::tensor::Tensor;
use common::{assert_close, model_dir, Golden, B};
use oxidiff::models::embeddings::FluxPosEmbed;
use oxidiff::models::{
    ClipTextModel, FluxTransformer2DConfig, FluxTransformer2DModel, T5EncoderModel,
};
use oxidiff_parallel::{ShardStyle, TensorParallel};

const TOL: f32 = 1e-4;
const NAME: &str = "tiny-flux";

/// `[rows, 3]` position ids from the golden tensor `key`.
fn id_rows(golden: &Golden, key: &str) -> Vec<Vec<f32>> {
    let (values, shape) = golden.host(key);
    values.chunks(shape[1]).map(<[f32]>::to_vec).collect()
}

#[test]
fn rotary_tables_match_flux_pos_embed() {
    let golden = Golden::load(NAME);
    let pos = FluxPosEmbed {
        theta: 10000.0,
        axes_dim: vec![4, 6, 6],
    };
    let rope = pos.forward::<B>(&id_rows(&golden, "rope.ids"), &Default::default());
    // Computed on the host in f64 and rounded, as diffusers: exact up to libm's last bit.
    assert_close(&golden, "rope.cos", rope.cos, 1e-6);
    assert_close(&golden, "rope.sin", rope.sin, 1e-6);
}

#[test]
fn clip_pooled_and_t5_embeddings_match_transformers() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let dir = model_dir("tiny-flux-dev");
    let clip =
        ClipTextModel::<B>::from_dir(&dir.join("text_encoder"), false, None, &device).unwrap();
    let out = clip
        .forward(&golden.token_rows("clip.input_ids"), false)
        .unwrap();
    assert_close(&golden, "pooled_prompt_embeds", out.pooler_output, TOL);
    let t5 = T5EncoderModel::<B>::from_dir(&dir.join("text_encoder_2"), None, &device).unwrap();
    let out = t5
        .forward(&golden.token_rows("t5.input_ids"), None)
        .unwrap();
    assert_close(&golden, "prompt_embeds", out, TOL);
}

fn transformer_call(variant: &str) -> (Golden, Tensor<B, 3>) {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let dir = model_dir(&format!("tiny-flux-{variant}")).join("transformer");
    let model = FluxTransformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
    assert_eq!(model.guidance_embeds(), variant == "dev");
    let txt_ids = vec![vec![0.0; 3]; 7];
    let rope = model.rotary_embedding(&txt_ids, &id_rows(&golden, "transformer.img_ids"), &device);
    let out = model
        .forward(
            golden.tensor("transformer.hidden_states"),
            golden.tensor("transformer.encoder_hidden_states"),
            golden.tensor("transformer.pooled_projections"),
            golden.tensor("transformer.timestep"),
            Some(golden.tensor("transformer.guidance")),
            &rope,
        )
        .unwrap();
    (golden, out)
}

#[test]
fn dev_transformer_with_guidance_embedding_matches_diffusers() {
    let (golden, out) = transformer_call("dev");
    assert_close(&golden, "transformer.dev.out", out, TOL);
}

#[test]
fn schnell_transformer_without_guidance_embedding_matches_diffusers() {
    // schnell has no guidance embedder: a guidance value is ignored, as diffusers passes none.
    let (golden, out) = transformer_call("schnell");
    assert_close(&golden, "transformer.schnell.out", out, TOL);
}

#[test]
fn dev_transformer_without_guidance_is_an_error() {
    let golden = Golden::load(NAME);
    let device = Default::default();
    let dir = model_dir("tiny-flux-dev").join("transformer");
    let model = FluxTransformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
    let rope = model.rotary_embedding(
        &vec![vec![0.0; 3]; 7],
        &id_rows(&golden, "transformer.img_ids"),
        &device,
    );
    let err = model
        .forward(
            golden.tensor("transformer.hidden_states"),
            golden.tensor("transformer.encoder_hidden_states"),
            golden.tensor("transformer.pooled_projections"),
            golden.tensor("transformer.timestep"),
            None,
            &rope,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("guidance"), "{err}");
    // Rotary tables for the wrong number of positions.
    let short = model.rotary_embedding(&[], &id_rows(&golden, "transformer.img_ids"), &device);
    let err = model
        .forward(
            golden.tensor("transformer.hidden_states"),
            golden.tensor("transformer.encoder_hidden_states"),
            golden.tensor("transformer.pooled_projections"),
            golden.tensor("transformer.timestep"),
            Some(golden.tensor("transformer.guidance")),
            &short,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("rotary"), "{err}");
}

#[test]
fn config_with_rope_axes_not_matching_head_dim_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(model_dir("tiny-flux-dev").join("transformer/config.json"))
        .unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["axes_dims_rope"] = serde_json::json!([4, 6, 4]);
    std::fs::write(&path, config.to_string()).unwrap();
    let err = FluxTransformer2DConfig::from_file(&path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("axes_dims_rope") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn tensor_parallel_plan_splits_attention_and_mlp_but_not_packed_proj_out() {
    let plan = FluxTransformer2DModel::<B>::tensor_parallel_plan();
    let style = |path: &str| plan.style_of(path);
    assert_eq!(
        style("transformer_blocks.0.attn.to_q"),
        Some(ShardStyle::ColumnWise)
    );
    assert_eq!(
        style("transformer_blocks.18.attn.add_v_proj"),
        Some(ShardStyle::ColumnWise)
    );
    assert_eq!(
        style("transformer_blocks.3.attn.to_out.0"),
        Some(ShardStyle::RowWise)
    );
    assert_eq!(
        style("transformer_blocks.3.ff_context.net.2"),
        Some(ShardStyle::RowWise)
    );
    assert_eq!(
        style("single_transformer_blocks.37.proj_mlp"),
        Some(ShardStyle::ColumnWise)
    );
    assert_eq!(style("single_transformer_blocks.37.proj_out"), None);
    assert_eq!(style("transformer_blocks.0.norm1.linear"), None);
    assert_eq!(style("proj_out"), None);
}

#[test]
fn sharded_widths_name_every_split_attention_and_mlp_for_validation() {
    use oxidiff_parallel::{ParallelConfig, ParallelError, ParallelTarget, TensorParallelConfig};
    let device = Default::default();
    let dir = model_dir("tiny-flux-dev").join("transformer");
    let model = FluxTransformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
    let widths = model.sharded_widths();
    // 2 double blocks (attn, ff, ff_context) and 2 single blocks (attn, proj_mlp).
    assert_eq!(widths.len(), 2 * 3 + 2 * 2, "{widths:?}");
    let target = ParallelTarget {
        model: "FluxTransformer2DModel",
        widths: &widths,
        device: "xla:cpu:0",
        devices_available: 8,
        compiled_pjrt: true,
    };
    // The tiny model has 2 heads: tp 2 fits, tp 4 does not and names the layer.
    ParallelConfig::from(TensorParallelConfig::new(2))
        .validate(&target)
        .unwrap();
    let err = ParallelConfig::from(TensorParallelConfig::new(4))
        .validate(&target)
        .unwrap_err();
    assert!(
        matches!(&err, ParallelError::Indivisible { layer, size: 2, .. } if layer == "transformer_blocks.0.attn"),
        "{err}"
    );
}

/// XLabs' `controlnet_blocks_repeat` against diffusers (tools/golden/
/// make_controlnet_flux_variants.py): two ControlNet samples over three double blocks go 0, 1, 0
/// when repeated and 0, 0, 1 when spread, on a transformer where the two differ.
#[test]
fn repeated_and_spread_control_samples_match_diffusers() {
    use oxidiff::models::transformer_flux::FluxControlSamples;
    let golden = Golden::load("controlnet-flux-variants");
    let device = Default::default();
    let dir = model_dir("tiny-flux-transformer-3");
    let model = FluxTransformer2DModel::<B>::from_dir(&dir, None, &device).unwrap();
    let txt_ids = vec![vec![0.0; 3]; 4];
    let rope = model.rotary_embedding(&txt_ids, &id_rows(&golden, "repeat.img_ids"), &device);
    let call = |repeat| {
        let samples = FluxControlSamples {
            blocks: vec![
                golden.tensor("repeat.block_0"),
                golden.tensor("repeat.block_1"),
            ],
            single_blocks: vec![golden.tensor("repeat.single_0")],
            repeat,
        };
        model.forward_controlled(
            golden.tensor("repeat.hidden_states"),
            golden.tensor("repeat.encoder_hidden_states"),
            golden.tensor("repeat.pooled_projections"),
            golden.tensor("repeat.timestep"),
            Some(golden.tensor("repeat.guidance")),
            &rope,
            Some(&samples),
        )
    };
    let (repeated, spread) = (call(true), call(false));
    let apart = (repeated.clone() - spread.clone())
        .abs()
        .max()
        .into_scalar();
    assert!(apart > 1e-2, "{apart}");
    assert_close(&golden, "repeat.out_repeat", repeated, TOL);
    assert_close(&golden, "repeat.out_spread", spread, TOL);
}

/// Flux ControlNet configs that cannot work are refused naming the field: an XLabs
/// conditioning embedding whose patches do not fill `in_channels`, a Union without modes.
#[test]
fn flux_controlnet_configs_with_bad_variant_fields_are_rejected() {
    use oxidiff::models::FluxControlNetModel;
    let refused = |net: &str, field: &str, value: serde_json::Value| {
        let dir = tempfile::tempdir().unwrap();
        let text = std::fs::read_to_string(model_dir(net).join("config.json")).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
        config[field] = value;
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        FluxControlNetModel::<B>::from_dir(dir.path(), None, &Default::default())
            .err()
            .unwrap_or_else(|| panic!("{net} with {field} loaded"))
            .to_string()
    };
    let err = refused(
        "tiny-controlnet-flux-xlabs",
        "conditioning_embedding_channels",
        serde_json::json!(8),
    );
    assert!(err.contains("`conditioning_embedding_channels` 8"), "{err}");
    let err = refused(
        "tiny-controlnet-flux-union",
        "num_mode",
        serde_json::json!(0),
    );
    assert!(err.contains("`num_mode`"), "{err}");
}
