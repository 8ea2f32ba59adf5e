//! A Flux transformer under its original (Black Forest Labs) key names, as BFL's checkpoints
//! and city96's GGUF files carry them, renamed to diffusers' as views over the same tensors
//! (diffusers' `convert_flux_transformer_checkpoint_to_diffusers`): fused q/k/v projections are
//! read as row ranges, and only the final modulation, stored `[scale, shift]` where diffusers
//! has `[shift, scale]`, is copied with its halves swapped.

use crate::transformer_flux::FluxTransformer2DConfig;
use crate::weights::{TensorView, Weights};

/// Whether `weights` name a Flux transformer the original way (`double_blocks.0.…`).
pub fn has_original_flux_names(weights: &Weights) -> bool {
    weights.contains("img_in.weight") && !weights.contains("x_embedder.weight")
}

/// `(diffusers name, original name, view)` for every tensor of a Flux transformer of `cfg`.
pub fn flux_names(cfg: &FluxTransformer2DConfig) -> Vec<(String, String, TensorView)> {
    let dim = cfg.inner_dim();
    let mlp = 4 * dim;
    let mut names = Vec::new();
    let rows = |i: usize, count: usize| TensorView::Rows {
        start: i * dim,
        count,
    };
    let mut embedders = vec![
        ("timestep_embedder", "time_in"),
        ("text_embedder", "vector_in"),
    ];
    if cfg.guidance_embeds {
        embedders.push(("guidance_embedder", "guidance_in"));
    }
    for (to, from) in embedders {
        both(
            &mut names,
            &format!("time_text_embed.{to}.linear_1"),
            &format!("{from}.in_layer"),
            TensorView::Whole,
        );
        both(
            &mut names,
            &format!("time_text_embed.{to}.linear_2"),
            &format!("{from}.out_layer"),
            TensorView::Whole,
        );
    }
    both(&mut names, "context_embedder", "txt_in", TensorView::Whole);
    both(&mut names, "x_embedder", "img_in", TensorView::Whole);
    both(
        &mut names,
        "proj_out",
        "final_layer.linear",
        TensorView::Whole,
    );
    both(
        &mut names,
        "norm_out.linear",
        "final_layer.adaLN_modulation.1",
        TensorView::SwapHalves,
    );
    for i in 0..cfg.num_layers {
        let (to, from) = (
            format!("transformer_blocks.{i}"),
            format!("double_blocks.{i}"),
        );
        both(
            &mut names,
            &format!("{to}.norm1.linear"),
            &format!("{from}.img_mod.lin"),
            TensorView::Whole,
        );
        both(
            &mut names,
            &format!("{to}.norm1_context.linear"),
            &format!("{from}.txt_mod.lin"),
            TensorView::Whole,
        );
        for (j, c) in ["q", "k", "v"].into_iter().enumerate() {
            both(
                &mut names,
                &format!("{to}.attn.to_{c}"),
                &format!("{from}.img_attn.qkv"),
                rows(j, dim),
            );
            both(
                &mut names,
                &format!("{to}.attn.add_{c}_proj"),
                &format!("{from}.txt_attn.qkv"),
                rows(j, dim),
            );
        }
        for (to_name, from_name) in [
            ("attn.to_out.0", "img_attn.proj"),
            ("attn.to_add_out", "txt_attn.proj"),
            ("ff.net.0.proj", "img_mlp.0"),
            ("ff.net.2", "img_mlp.2"),
            ("ff_context.net.0.proj", "txt_mlp.0"),
            ("ff_context.net.2", "txt_mlp.2"),
        ] {
            both(
                &mut names,
                &format!("{to}.{to_name}"),
                &format!("{from}.{from_name}"),
                TensorView::Whole,
            );
        }
        for (to_name, from_name) in [
            ("norm_q", "img_attn.norm.query_norm"),
            ("norm_k", "img_attn.norm.key_norm"),
            ("norm_added_q", "txt_attn.norm.query_norm"),
            ("norm_added_k", "txt_attn.norm.key_norm"),
        ] {
            names.push((
                format!("{to}.attn.{to_name}.weight"),
                format!("{from}.{from_name}.scale"),
                TensorView::Whole,
            ));
        }
    }
    for i in 0..cfg.num_single_layers {
        let (to, from) = (
            format!("single_transformer_blocks.{i}"),
            format!("single_blocks.{i}"),
        );
        let at = |name: &str| format!("{to}.{name}");
        let of = |name: &str| format!("{from}.{name}");
        both(
            &mut names,
            &at("norm.linear"),
            &of("modulation.lin"),
            TensorView::Whole,
        );
        for (j, c) in ["q", "k", "v"].into_iter().enumerate() {
            both(
                &mut names,
                &at(&format!("attn.to_{c}")),
                &of("linear1"),
                rows(j, dim),
            );
        }
        both(&mut names, &at("proj_mlp"), &of("linear1"), rows(3, mlp));
        both(
            &mut names,
            &at("proj_out"),
            &of("linear2"),
            TensorView::Whole,
        );
        for (to_name, from_name) in [("norm_q", "query_norm"), ("norm_k", "key_norm")] {
            names.push((
                format!("{to}.attn.{to_name}.weight"),
                format!("{from}.norm.{from_name}.scale"),
                TensorView::Whole,
            ));
        }
    }
    names
}

/// Adds the weight and the bias of layer `to`, read from layer `from` through `view`.
fn both(names: &mut Vec<(String, String, TensorView)>, to: &str, from: &str, view: TensorView) {
    for kind in ["weight", "bias"] {
        names.push((
            format!("{to}.{kind}"),
            format!("{from}.{kind}"),
            view.clone(),
        ));
    }
}
