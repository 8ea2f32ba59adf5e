//! The file's tensors under diffusers' names, without copying: each component gets a
//! [`Weights::view`] renamed as diffusers' `convert_ldm_unet_checkpoint`,
//! `convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint` and `convert_open_clip_checkpoint`.

use std::collections::HashSet;

use super::detect::{SingleFileArch, UNET_PREFIX};
use super::file::SingleFile;
use crate::error::Result;
use crate::weights::{TensorView, Weights};

impl SingleFile {
    /// `(name, source, view)` of every UNet tensor.
    pub fn unet_names(&self) -> Result<Vec<(String, String, TensorView)>> {
        let layers = self.unet_layers_per_block()?;
        let mut names = Vec::new();
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(UNET_PREFIX) else {
                continue;
            };
            if let Some(name) = unet_name(rest, layers) {
                names.push((name, key.to_string(), TensorView::Whole));
            }
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(names)
    }

    /// The UNet's tensors under diffusers' names (`down_blocks.0.resnets.0.conv1.weight`).
    pub fn unet_weights(&self) -> Result<Weights> {
        self.weights.view(self.unet_names()?)
    }

    /// `(name, source, view)` of every VAE tensor.
    pub fn vae_names(&self) -> Vec<(String, String, TensorView)> {
        let prefix = self.vae_prefix();
        let up_blocks = self.count_indices(&format!("{prefix}decoder.up."));
        let mut names = Vec::new();
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(prefix) else {
                continue;
            };
            if rest.starts_with("loss.") {
                continue;
            }
            let Some(name) = vae_name(rest, up_blocks) else {
                continue;
            };
            // The mid-block attention's q/k/v/proj_out are 1x1 convolutions in the LDM VAE,
            // linear layers in diffusers' (`conv_attn_to_linear`).
            let view = match self.shape(key) {
                Some(s) if name.contains("mid_block.attentions.") && s.len() > 2 => {
                    TensorView::Reshape(s[..2].to_vec())
                }
                _ => TensorView::Whole,
            };
            names.push((name, key.to_string(), view));
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        names
    }

    /// The VAE's tensors under diffusers' names.
    pub fn vae_weights(&self) -> Result<Weights> {
        self.weights.view(self.vae_names())
    }

    /// `(name, source, view)` of SD 1's / SDXL's first CLIP encoder: the keys are transformers'
    /// own under a prefix (diffusers' `convert_ldm_clip_checkpoint`).
    pub fn clip_names(&self) -> Vec<(String, String, TensorView)> {
        let Some(prefix) = self.clip_prefix() else {
            return Vec::new();
        };
        let mut names: Vec<_> = self
            .weights
            .keys()
            .filter_map(|key| {
                let rest = key.strip_prefix(prefix)?;
                (!rest.ends_with("position_ids"))
                    .then(|| (rest.to_string(), key.to_string(), TensorView::Whole))
            })
            .collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        names
    }

    /// `(name, source, view)` of the OpenCLIP encoder as a transformers CLIP text model of
    /// `layers` layers (diffusers' `convert_open_clip_checkpoint`): the fused `in_proj` split
    /// into q/k/v, `text_projection` transposed (kept only `with_projection`), the blocks past
    /// `layers` left out (SD 2 uses the penultimate layer: diffusers drops block 23 of 24).
    pub fn open_clip_names(
        &self,
        layers: usize,
        with_projection: bool,
    ) -> Result<Vec<(String, String, TensorView)>> {
        let Some(prefix) = self.open_clip_prefix() else {
            return Ok(Vec::new());
        };
        let mut names = Vec::new();
        let fixed = [
            (
                "positional_embedding",
                "text_model.embeddings.position_embedding.weight",
            ),
            (
                "token_embedding.weight",
                "text_model.embeddings.token_embedding.weight",
            ),
            ("ln_final.weight", "text_model.final_layer_norm.weight"),
            ("ln_final.bias", "text_model.final_layer_norm.bias"),
        ];
        for (ldm, diffusers) in fixed {
            names.push((
                diffusers.to_string(),
                format!("{prefix}{ldm}"),
                TensorView::Whole,
            ));
        }
        if with_projection {
            names.push((
                "text_projection.weight".into(),
                format!("{prefix}text_projection"),
                TensorView::Transpose,
            ));
        }
        let blocks = format!("{prefix}transformer.resblocks.");
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(&blocks) else {
                continue;
            };
            let Some((index, tail)) = rest.split_once('.') else {
                continue;
            };
            let Ok(i) = index.parse::<usize>() else {
                continue;
            };
            if i >= layers {
                continue;
            }
            let layer = format!("text_model.encoder.layers.{i}");
            if let Some(kind) = tail.strip_prefix("attn.in_proj_") {
                let width = self.dim(key, 0)? / 3;
                for (j, part) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                    names.push((
                        format!("{layer}.self_attn.{part}.{kind}"),
                        key.to_string(),
                        TensorView::Rows {
                            start: j * width,
                            count: width,
                        },
                    ));
                }
                continue;
            }
            let renamed = tail
                .replace("ln_1", "layer_norm1")
                .replace("ln_2", "layer_norm2")
                .replace("mlp.c_fc", "mlp.fc1")
                .replace("mlp.c_proj", "mlp.fc2")
                .replace("attn.out_proj", "self_attn.out_proj");
            names.push((
                format!("{layer}.{renamed}"),
                key.to_string(),
                TensorView::Whole,
            ));
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(names)
    }

    /// The first text encoder's tensors (SD 1's CLIP, SD 2's OpenCLIP with `layers` layers,
    /// SDXL's `text_encoder`) under transformers' names.
    pub fn text_encoder_weights(&self, layers: usize) -> Result<Weights> {
        match self.arch {
            SingleFileArch::Sd2 => self.weights.view(self.open_clip_names(layers, false)?),
            _ => self.weights.view(self.clip_names()),
        }
    }

    /// SDXL's `text_encoder_2` (OpenCLIP bigG with projection; the refiner's only encoder) of
    /// `layers` layers.
    pub fn text_encoder_2_weights(&self, layers: usize) -> Result<Weights> {
        self.weights.view(self.open_clip_names(layers, true)?)
    }

    /// The file's tensors that no component takes, other than the ones every LDM checkpoint
    /// carries and diffusers ignores too (EMA copies, the DDPM schedule buffers, position ids,
    /// `logit_scale`, SD 2's unused last text block): worth a warning, since diffusers drops
    /// them silently.
    pub fn unmapped_keys(&self, text_layers: usize, text_2_layers: usize) -> Result<Vec<String>> {
        let mut used: HashSet<String> = HashSet::new();
        let mut all = self.unet_names()?;
        all.extend(self.vae_names());
        all.extend(self.clip_names());
        match self.arch {
            SingleFileArch::Sd2 => all.extend(self.open_clip_names(text_layers, false)?),
            SingleFileArch::SdxlBase | SingleFileArch::SdxlRefiner => {
                all.extend(self.open_clip_names(text_2_layers, true)?)
            }
            SingleFileArch::Sd1 => {}
        }
        used.extend(all.into_iter().map(|(_, source, _)| source));
        let open_clip_blocks = self
            .open_clip_prefix()
            .map(|p| format!("{p}transformer.resblocks."));
        let mut unmapped: Vec<String> = self
            .weights
            .keys()
            .filter(|k| !used.contains(*k) && !ignorable(k, self.arch))
            .filter(|k| {
                // SD 2's blocks past the penultimate one are unused by design.
                !(self.arch == SingleFileArch::Sd2
                    && open_clip_blocks
                        .as_deref()
                        .is_some_and(|p| k.starts_with(p)))
            })
            .map(str::to_string)
            .collect();
        unmapped.sort();
        Ok(unmapped)
    }
}

/// diffusers' name of UNet tensor `rest` (the key after `model.diffusion_model.`), as
/// `convert_ldm_unet_checkpoint` renames it; `None` for keys it does not take.
pub(super) fn unet_name(rest: &str, layers: usize) -> Option<String> {
    const FIXED: [(&str, &str); 7] = [
        ("time_embed.0.", "time_embedding.linear_1."),
        ("time_embed.2.", "time_embedding.linear_2."),
        ("input_blocks.0.0.", "conv_in."),
        ("out.0.", "conv_norm_out."),
        ("out.2.", "conv_out."),
        ("label_emb.0.0.", "add_embedding.linear_1."),
        ("label_emb.0.2.", "add_embedding.linear_2."),
    ];
    for (ldm, diffusers) in FIXED {
        if let Some(param) = rest.strip_prefix(ldm) {
            return Some(format!("{diffusers}{param}"));
        }
    }
    let (section, rest) = rest.split_once('.')?;
    let (index, rest) = rest.split_once('.')?;
    let i: usize = index.parse().ok()?;
    let (part, tail) = rest.split_once('.')?;
    let resnet = |tail: &str| {
        tail.replace("in_layers.0", "norm1")
            .replace("in_layers.2", "conv1")
            .replace("out_layers.0", "norm2")
            .replace("out_layers.3", "conv2")
            .replace("emb_layers.1", "time_emb_proj")
            .replace("skip_connection", "conv_shortcut")
    };
    match section {
        "input_blocks" if i > 0 => {
            let (block, layer) = ((i - 1) / (layers + 1), (i - 1) % (layers + 1));
            match part {
                "0" => match tail.strip_prefix("op.") {
                    Some(param) => Some(format!("down_blocks.{block}.downsamplers.0.conv.{param}")),
                    None => Some(format!(
                        "down_blocks.{block}.resnets.{layer}.{}",
                        resnet(tail)
                    )),
                },
                "1" => Some(format!("down_blocks.{block}.attentions.{layer}.{tail}")),
                _ => None,
            }
        }
        "middle_block" => match i {
            0 | 2 => Some(format!(
                "mid_block.resnets.{}.{}",
                i / 2,
                resnet(&format!("{part}.{tail}"))
            )),
            1 => Some(format!("mid_block.attentions.0.{part}.{tail}")),
            _ => None,
        },
        "output_blocks" => {
            let (block, layer) = (i / (layers + 1), i % (layers + 1));
            match (part, tail.strip_prefix("conv.")) {
                ("0", _) => Some(format!(
                    "up_blocks.{block}.resnets.{layer}.{}",
                    resnet(tail)
                )),
                ("1" | "2", Some(param)) => {
                    Some(format!("up_blocks.{block}.upsamplers.0.conv.{param}"))
                }
                ("1", None) => Some(format!("up_blocks.{block}.attentions.{layer}.{tail}")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// diffusers' name of VAE tensor `rest` (the key after `first_stage_model.`), as
/// `convert_ldm_vae_checkpoint` renames it; the decoder's `up.N` count backwards.
fn vae_name(rest: &str, up_blocks: usize) -> Option<String> {
    let (coder, tail) = rest.split_once('.')?;
    if coder == "quant_conv" || coder == "post_quant_conv" {
        return Some(rest.to_string());
    }
    if coder != "encoder" && coder != "decoder" {
        return None;
    }
    if let Some(param) = tail.strip_prefix("norm_out.") {
        return Some(format!("{coder}.conv_norm_out.{param}"));
    }
    if tail.starts_with("conv_in.") || tail.starts_with("conv_out.") {
        return Some(rest.to_string());
    }
    let resnet = |t: &str| t.replace("nin_shortcut", "conv_shortcut");
    if let Some(mid) = tail.strip_prefix("mid.") {
        let (part, param) = mid.split_once('.')?;
        return match part {
            "block_1" => Some(format!("{coder}.mid_block.resnets.0.{}", resnet(param))),
            "block_2" => Some(format!("{coder}.mid_block.resnets.1.{}", resnet(param))),
            "attn_1" => {
                let (layer, p) = param.split_once('.')?;
                let layer = match layer {
                    "norm" => "group_norm",
                    "q" => "to_q",
                    "k" => "to_k",
                    "v" => "to_v",
                    "proj_out" => "to_out.0",
                    _ => return None,
                };
                Some(format!("{coder}.mid_block.attentions.0.{layer}.{p}"))
            }
            _ => None,
        };
    }
    let (kind, tail) = tail.split_once('.')?;
    let (index, tail) = tail.split_once('.')?;
    let i: usize = index.parse().ok()?;
    let (blocks, sampler, block) = match (coder, kind) {
        ("encoder", "down") => ("down_blocks", "downsample", i),
        ("decoder", "up") if i < up_blocks => ("up_blocks", "upsample", up_blocks - 1 - i),
        _ => return None,
    };
    if let Some(param) = tail.strip_prefix(&format!("{sampler}.conv.")) {
        let samplers = if sampler == "downsample" {
            "downsamplers"
        } else {
            "upsamplers"
        };
        return Some(format!(
            "{coder}.{blocks}.{block}.{samplers}.0.conv.{param}"
        ));
    }
    let rest = tail.strip_prefix("block.")?;
    Some(format!("{coder}.{blocks}.{block}.resnets.{}", resnet(rest)))
}

/// Keys every LDM checkpoint may carry that no diffusers component takes.
fn ignorable(key: &str, arch: SingleFileArch) -> bool {
    const SCHEDULE: [&str; 13] = [
        "betas",
        "alphas_cumprod",
        "alphas_cumprod_prev",
        "sqrt_alphas_cumprod",
        "sqrt_one_minus_alphas_cumprod",
        "log_one_minus_alphas_cumprod",
        "sqrt_recip_alphas_cumprod",
        "sqrt_recipm1_alphas_cumprod",
        "posterior_variance",
        "posterior_log_variance_clipped",
        "posterior_mean_coef1",
        "posterior_mean_coef2",
        "logvar",
    ];
    SCHEDULE.contains(&key)
        || key == "global_step"
        || key.starts_with("model_ema.")
        || key.ends_with("position_ids")
        || key.ends_with("logit_scale")
        || key.starts_with("first_stage_model.loss.")
        || (arch == SingleFileArch::Sd2 && key == "cond_stage_model.model.text_projection")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unet_keys_are_renamed_as_diffusers_does() {
        let cases = [
            ("time_embed.0.weight", "time_embedding.linear_1.weight"),
            ("input_blocks.0.0.bias", "conv_in.bias"),
            (
                "input_blocks.1.0.in_layers.0.weight",
                "down_blocks.0.resnets.0.norm1.weight",
            ),
            (
                "input_blocks.2.0.emb_layers.1.bias",
                "down_blocks.0.resnets.1.time_emb_proj.bias",
            ),
            (
                "input_blocks.3.0.op.weight",
                "down_blocks.0.downsamplers.0.conv.weight",
            ),
            (
                "input_blocks.4.0.skip_connection.weight",
                "down_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "input_blocks.5.1.transformer_blocks.0.attn1.to_q.weight",
                "down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_q.weight",
            ),
            (
                "middle_block.0.out_layers.3.weight",
                "mid_block.resnets.0.conv2.weight",
            ),
            (
                "middle_block.1.proj_in.weight",
                "mid_block.attentions.0.proj_in.weight",
            ),
            (
                "middle_block.2.in_layers.2.bias",
                "mid_block.resnets.1.conv1.bias",
            ),
            (
                "output_blocks.2.1.conv.weight",
                "up_blocks.0.upsamplers.0.conv.weight",
            ),
            (
                "output_blocks.5.2.conv.bias",
                "up_blocks.1.upsamplers.0.conv.bias",
            ),
            (
                "output_blocks.5.1.norm.weight",
                "up_blocks.1.attentions.2.norm.weight",
            ),
            (
                "output_blocks.11.0.skip_connection.weight",
                "up_blocks.3.resnets.2.conv_shortcut.weight",
            ),
            ("out.2.weight", "conv_out.weight"),
            ("label_emb.0.2.bias", "add_embedding.linear_2.bias"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(unet_name(ldm, 2).as_deref(), Some(diffusers), "{ldm}");
        }
    }

    #[test]
    fn vae_keys_are_renamed_as_diffusers_does() {
        let cases = [
            ("encoder.norm_out.weight", "encoder.conv_norm_out.weight"),
            (
                "encoder.down.1.block.0.nin_shortcut.weight",
                "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "encoder.down.0.downsample.conv.bias",
                "encoder.down_blocks.0.downsamplers.0.conv.bias",
            ),
            (
                "decoder.up.3.block.2.conv1.weight",
                "decoder.up_blocks.0.resnets.2.conv1.weight",
            ),
            (
                "decoder.up.1.upsample.conv.weight",
                "decoder.up_blocks.2.upsamplers.0.conv.weight",
            ),
            (
                "decoder.mid.attn_1.proj_out.bias",
                "decoder.mid_block.attentions.0.to_out.0.bias",
            ),
            (
                "decoder.mid.attn_1.norm.weight",
                "decoder.mid_block.attentions.0.group_norm.weight",
            ),
            (
                "encoder.mid.block_2.norm2.bias",
                "encoder.mid_block.resnets.1.norm2.bias",
            ),
            ("post_quant_conv.weight", "post_quant_conv.weight"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(vae_name(ldm, 4).as_deref(), Some(diffusers), "{ldm}");
        }
    }
}
