//! Attention and the transformer blocks of the UNet (diffusers' `attention_processor.Attention`,
//! `BasicTransformerBlock`, `Transformer2DModel`), plus the multi-head helper the text encoders
//! share.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::Tensor;

use crate::cpu::attention as cpu_attention;
use crate::error::Result;
use crate::nn::{residual_add, Activation, Conv2d, ConvSpec, GroupNorm, LayerNorm, Linear};
use crate::var_builder::VarBuilder;

/// Multi-head scaled dot-product attention over `[batch, seq, heads * head_dim]` inputs.
///
/// Heads are split, attended with Burn's fused `attention` op (one op in the backend, so the
/// PJRT lowering and CPU kernels can fuse it), and merged back; on burn-flex in f32,
/// [`crate::cpu::attention`] reads the heads in place instead.
pub fn multi_head_attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
    causal: bool,
) -> Tensor<B, 3> {
    attend(q, k, v, heads, causal, None)
}

/// [`multi_head_attention`] with an additive bias on the logits, broadcast from
/// `[batch, 1, 1, seq_kv]` (a padding mask) or given per head and query.
pub fn multi_head_attention_with_bias<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
    bias: Tensor<B, 4>,
) -> Tensor<B, 3> {
    attend(q, k, v, heads, false, Some(bias))
}

/// `[b, c, seq]` to `[b, seq, c]` and back: a contiguous copy on the CPU backend (so the
/// norms, products and residual sums that follow read it in order), Burn's `swap_dims` view
/// elsewhere.
fn swap_seq<B: Backend>(t: Tensor<B, 3>) -> Tensor<B, 3> {
    crate::cpu::elementwise::transpose(t).unwrap_or_else(|t| t.swap_dims(1, 2))
}

fn attend<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
    causal: bool,
    bias: Option<Tensor<B, 4>>,
) -> Tensor<B, 3> {
    // On burn-flex without bias: heads read in place, gemm-based blocks.
    let (q, k, v) = if bias.is_none() {
        let masking = if causal {
            cpu_attention::Masking::Causal
        } else {
            cpu_attention::Masking::None
        };
        match cpu_attention::masked_attention(q, k, v, heads, masking) {
            Ok(out) => return out,
            Err(inputs) => inputs,
        }
    } else {
        (q, k, v)
    };
    let [b, s_q, inner] = q.dims();
    let s_kv = k.dims()[1];
    let head_dim = inner / heads;
    let split = |t: Tensor<B, 3>, s: usize| t.reshape([b, s, heads, head_dim]).swap_dims(1, 2);
    // Backends take the bias in the full `[batch, heads, seq_q, seq_kv]` shape.
    let bias = bias.map(|bias| bias.expand([b, heads, s_q, s_kv]));
    let out = attention(
        split(q, s_q),
        split(k, s_kv),
        split(v, s_kv),
        None,
        bias,
        AttentionModuleOptions {
            scale: Some(1.0 / (head_dim as f64).sqrt()),
            softcap: None,
            is_causal: causal,
        },
    );
    out.swap_dims(1, 2).reshape([b, s_q, inner])
}

/// diffusers' `Attention`: `to_q`, `to_k`, `to_v`, `to_out.0`, with an optional `group_norm` and
/// residual connection (the VAE's spatial self-attention).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub to_q: Linear<B>,
    pub to_k: Linear<B>,
    pub to_v: Linear<B>,
    pub to_out: Linear<B>,
    pub group_norm: Option<GroupNorm<B>>,
    pub heads: usize,
}

/// How an [`Attention`] layer is shaped.
#[derive(Debug, Clone, Copy)]
pub struct AttentionSpec {
    pub query_dim: usize,
    /// Width of the context for keys and values (`cross_attention_dim`), or `query_dim`.
    pub context_dim: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Bias on q/k/v (`attention_bias`); the output projection always has one.
    pub qkv_bias: bool,
}

impl<B: Backend> Attention<B> {
    pub fn load(vb: &VarBuilder<B>, spec: AttentionSpec) -> Result<Self> {
        let inner = spec.heads * spec.head_dim;
        // Checkpoints converted from the original VAE use `query/key/value/proj_attn`.
        let legacy = !vb.contains("to_q.weight") && vb.contains("query.weight");
        let (q, k, v, out) = if legacy {
            ("query", "key", "value", vb.pp("proj_attn"))
        } else {
            ("to_q", "to_k", "to_v", vb.pp("to_out").pp(0))
        };
        Ok(Self {
            to_q: Linear::load(&vb.pp(q), spec.query_dim, inner, spec.qkv_bias)?,
            to_k: Linear::load(&vb.pp(k), spec.context_dim, inner, spec.qkv_bias)?,
            to_v: Linear::load(&vb.pp(v), spec.context_dim, inner, spec.qkv_bias)?,
            to_out: Linear::load(&out, inner, spec.query_dim, true)?,
            group_norm: None,
            heads: spec.heads,
        })
    }

    /// Attention over a sequence `[batch, seq, dim]`; `context` is the cross-attention input.
    pub fn forward(&self, x: Tensor<B, 3>, context: Option<Tensor<B, 3>>) -> Tensor<B, 3> {
        self.forward_with_bias(x, context, None)
    }

    /// [`forward`](Self::forward) with an additive logit bias, e.g. diffusers'
    /// `encoder_attention_mask` as `(1 - mask) * -10000` of shape `[batch, 1, 1, seq_kv]`.
    pub fn forward_with_bias(
        &self,
        x: Tensor<B, 3>,
        context: Option<Tensor<B, 3>>,
        bias: Option<Tensor<B, 4>>,
    ) -> Tensor<B, 3> {
        let context = context.unwrap_or_else(|| x.clone());
        let q = self.to_q.forward(x);
        let k = self.to_k.forward(context.clone());
        let v = self.to_v.forward(context);
        self.to_out
            .forward(attend(q, k, v, self.heads, false, bias))
    }

    /// Cross-attention with an IP-Adapter, as diffusers' `IPAdapterAttnProcessor2_0`:
    /// `to_out(attn(q, k, v) + scale * attn(q, to_k_ip(image), to_v_ip(image)))`, the image
    /// branch skipped at scale 0 as diffusers does.
    pub fn forward_with_image(
        &self,
        x: Tensor<B, 3>,
        text: Tensor<B, 3>,
        image: Tensor<B, 3>,
        ip: &IpAdapterAttention<B>,
    ) -> Tensor<B, 3> {
        let q = self.to_q.forward(x);
        let k = self.to_k.forward(text.clone());
        let v = self.to_v.forward(text);
        let mut out = attend(q.clone(), k, v, self.heads, false, None);
        if ip.scale != 0.0 {
            let k = ip.to_k_ip.forward(image.clone());
            let v = ip.to_v_ip.forward(image);
            out = out + attend(q, k, v, self.heads, false, None).mul_scalar(ip.scale);
        }
        self.to_out.forward(out)
    }

    /// Spatial self-attention over `[batch, channels, h, w]` with group norm and residual, as the
    /// VAE's mid block uses it.
    pub fn forward_spatial(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, c, h, w] = x.dims();
        let residual = x.clone();
        let normed = match &self.group_norm {
            Some(norm) => norm.forward(x),
            None => x,
        };
        let seq = swap_seq(normed.reshape([b, c, h * w]));
        let out = self.forward(seq, None);
        residual_add(swap_seq(out).reshape([b, c, h, w]), residual)
    }
}

/// The image branch an IP-Adapter adds to one cross-attention (diffusers'
/// `IPAdapterAttnProcessor2_0` with one adapter): key and value projections of the image
/// tokens, which the UNet receives appended to the text context (the last `num_tokens` rows).
#[derive(Module, Debug)]
pub struct IpAdapterAttention<B: Backend> {
    pub to_k_ip: Linear<B>,
    pub to_v_ip: Linear<B>,
    #[module(skip)]
    pub num_tokens: usize,
    /// `set_ip_adapter_scale`'s weight of the image branch.
    #[module(skip)]
    pub scale: f64,
}

/// The activation of a [`FeedForward`] (`activation_fn` in diffusers' configs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedForwardActivation {
    /// `geglu`: `net.0.proj` gives value and gate, `value * gelu(gate)`.
    Geglu,
    /// `gelu`: exact GELU after `net.0.proj`.
    Gelu,
    /// `gelu-approximate`: tanh GELU after `net.0.proj` (PixArt, SD3, Flux).
    GeluTanh,
}

impl FeedForwardActivation {
    /// Parses diffusers' `activation_fn`.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "geglu" => Self::Geglu,
            "gelu" => Self::Gelu,
            "gelu-approximate" => Self::GeluTanh,
            _ => return None,
        })
    }
}

/// diffusers' `FeedForward` (`ff.net.0.proj`, `ff.net.2`).
#[derive(Module, Debug)]
pub struct FeedForward<B: Backend> {
    pub proj_in: Linear<B>,
    pub proj_out: Linear<B>,
    #[module(skip)]
    pub act: FeedForwardActivation,
    /// GEGLU: how `net.0.proj`'s output columns are grouped. 1, the checkpoint's order: all
    /// values, then all gates. `n` (tensor parallelism over `n` devices, which places the
    /// columns so): `n` groups of `[values, gates]`, one per device, so that each device's
    /// column block holds its values with their gates and the split needs no transfer.
    #[module(skip)]
    pub geglu_groups: usize,
}

impl<B: Backend> FeedForward<B> {
    /// The UNet's GEGLU feed-forward with inner width `dim * mult`.
    pub fn load(vb: &VarBuilder<B>, dim: usize, mult: usize) -> Result<Self> {
        Self::load_with(vb, dim, dim * mult, FeedForwardActivation::Geglu)
    }

    /// A feed-forward of inner width `inner` with the given activation.
    pub fn load_with(
        vb: &VarBuilder<B>,
        dim: usize,
        inner: usize,
        act: FeedForwardActivation,
    ) -> Result<Self> {
        let proj_width = match act {
            FeedForwardActivation::Geglu => inner * 2,
            _ => inner,
        };
        Ok(Self {
            proj_in: Linear::load(&vb.pp("net.0.proj"), dim, proj_width, true)?,
            proj_out: Linear::load(&vb.pp("net.2"), inner, dim, true)?,
            act,
            geglu_groups: 1,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let projected = self.proj_in.forward(x);
        let hidden = match self.act {
            FeedForwardActivation::Geglu if self.geglu_groups > 1 => {
                let [b, s, width] = projected.dims();
                let (groups, inner) = (self.geglu_groups, width / 2);
                let grouped = projected.reshape([b, s, groups, 2, inner / groups]);
                let hidden = grouped.clone().narrow(3, 0, 1).reshape([b, s, inner]);
                let gate = grouped.narrow(3, 1, 1).reshape([b, s, inner]);
                hidden * burn::tensor::activation::gelu(gate)
            }
            FeedForwardActivation::Geglu => {
                let projected = match crate::cpu::elementwise::geglu(projected) {
                    Ok(hidden) => return self.proj_out.forward(hidden),
                    Err(projected) => projected,
                };
                let inner = projected.dims()[2] / 2;
                let hidden = projected.clone().narrow(2, 0, inner);
                let gate = projected.narrow(2, inner, inner);
                hidden * burn::tensor::activation::gelu(gate)
            }
            FeedForwardActivation::Gelu => Activation::Gelu.forward(projected),
            FeedForwardActivation::GeluTanh => Activation::GeluTanh.forward(projected),
        };
        self.proj_out.forward(hidden)
    }
}

/// diffusers' `BasicTransformerBlock`: self-attention, cross-attention, feed-forward, each after
/// a layer norm and with a residual.
#[derive(Module, Debug)]
pub struct BasicTransformerBlock<B: Backend> {
    pub norm1: LayerNorm<B>,
    pub attn1: Attention<B>,
    pub norm2: LayerNorm<B>,
    pub attn2: Attention<B>,
    pub norm3: LayerNorm<B>,
    pub ff: FeedForward<B>,
    pub only_cross_attention: bool,
    /// An attached IP-Adapter's branch of `attn2`: the context then ends with its image tokens.
    pub ip_adapter: Option<IpAdapterAttention<B>>,
}

impl<B: Backend> BasicTransformerBlock<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        dim: usize,
        heads: usize,
        head_dim: usize,
        context_dim: usize,
        only_cross_attention: bool,
    ) -> Result<Self> {
        let spec = |context_dim| AttentionSpec {
            query_dim: dim,
            context_dim,
            heads,
            head_dim,
            qkv_bias: false,
        };
        let attn1_context = if only_cross_attention {
            context_dim
        } else {
            dim
        };
        Ok(Self {
            norm1: LayerNorm::load(&vb.pp("norm1"), dim, 1e-5)?,
            attn1: Attention::load(&vb.pp("attn1"), spec(attn1_context))?,
            norm2: LayerNorm::load(&vb.pp("norm2"), dim, 1e-5)?,
            attn2: Attention::load(&vb.pp("attn2"), spec(context_dim))?,
            norm3: LayerNorm::load(&vb.pp("norm3"), dim, 1e-5)?,
            ff: FeedForward::load(&vb.pp("ff"), dim, 4)?,
            only_cross_attention,
            ip_adapter: None,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>, context: Tensor<B, 3>) -> Tensor<B, 3> {
        // With an IP-Adapter, the context's last `num_tokens` rows are the image tokens.
        let (context, image) = match &self.ip_adapter {
            Some(ip) => {
                let seq = context.dims()[1];
                let text = seq.saturating_sub(ip.num_tokens);
                let image = context.clone().narrow(1, text, seq - text);
                (context.narrow(1, 0, text), Some((image, ip)))
            }
            None => (context, None),
        };
        let self_context = self.only_cross_attention.then(|| context.clone());
        let x = residual_add(
            self.attn1
                .forward(self.norm1.forward(x.clone()), self_context),
            x,
        );
        let h = self.norm2.forward(x.clone());
        let attended = match image {
            Some((image, ip)) => self.attn2.forward_with_image(h, context, image, ip),
            None => self.attn2.forward(h, Some(context)),
        };
        let x = residual_add(attended, x);
        residual_add(self.ff.forward(self.norm3.forward(x.clone())), x)
    }
}

/// The projection in and out of a [`Transformer2DModel`]: a 1x1 convolution, or a linear layer
/// when the config says `use_linear_projection` (SD 2.x).
// A Linear is larger than a Conv2d (its optional quantized forms); a model holds a few dozen
// projections, and Burn's Module derive cannot see through a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Projection<B: Backend> {
    Conv(Conv2d<B>),
    Linear(Linear<B>),
}

/// diffusers' `Transformer2DModel` for continuous (latent image) inputs.
#[derive(Module, Debug)]
pub struct Transformer2DModel<B: Backend> {
    pub norm: GroupNorm<B>,
    pub proj_in: Projection<B>,
    pub transformer_blocks: Vec<BasicTransformerBlock<B>>,
    pub proj_out: Projection<B>,
}

/// Shape of a [`Transformer2DModel`].
#[derive(Debug, Clone, Copy)]
pub struct Transformer2DSpec {
    pub channels: usize,
    pub heads: usize,
    pub context_dim: usize,
    pub layers: usize,
    pub norm_num_groups: usize,
    pub use_linear_projection: bool,
    pub only_cross_attention: bool,
}

impl<B: Backend> Transformer2DModel<B> {
    pub fn load(vb: &VarBuilder<B>, spec: Transformer2DSpec) -> Result<Self> {
        let c = spec.channels;
        let head_dim = c / spec.heads.max(1);
        let projection = |name: &str| -> Result<Projection<B>> {
            Ok(if spec.use_linear_projection {
                Projection::Linear(Linear::load(&vb.pp(name), c, c, true)?)
            } else {
                Projection::Conv(Conv2d::load(&vb.pp(name), ConvSpec::same(c, c, 1))?)
            })
        };
        let transformer_blocks = (0..spec.layers)
            .map(|i| {
                BasicTransformerBlock::load(
                    &vb.pp("transformer_blocks").pp(i),
                    c,
                    spec.heads,
                    head_dim,
                    spec.context_dim,
                    spec.only_cross_attention,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            norm: GroupNorm::load(&vb.pp("norm"), spec.norm_num_groups, c, 1e-6)?,
            proj_in: projection("proj_in")?,
            transformer_blocks,
            proj_out: projection("proj_out")?,
        })
    }

    pub fn forward(&self, x: Tensor<B, 4>, context: Tensor<B, 3>) -> Tensor<B, 4> {
        let [b, c, h, w] = x.dims();
        let residual = x.clone();
        let x = self.norm.forward(x);
        let to_seq = |t: Tensor<B, 4>| swap_seq(t.reshape([b, c, h * w]));
        let mut seq = match &self.proj_in {
            Projection::Conv(conv) => to_seq(conv.forward(x)),
            Projection::Linear(lin) => lin.forward(to_seq(x)),
        };
        for block in &self.transformer_blocks {
            seq = block.forward(seq, context.clone());
        }
        let from_seq = |t: Tensor<B, 3>| swap_seq(t).reshape([b, c, h, w]);
        let out = match &self.proj_out {
            Projection::Conv(conv) => conv.forward(from_seq(seq)),
            Projection::Linear(lin) => from_seq(lin.forward(seq)),
        };
        residual_add(out, residual)
    }
}

/// Scaled dot-product attention on heads already split, `[batch, heads, seq, head_dim]`
/// (Burn's fused op, scale `1 / sqrt(head_dim)`), for models that normalise or rotate q and k
/// per head before attending (Flux, SD3.5).
pub fn scaled_dot_product_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let head_dim = q.dims()[3];
    attention(
        q,
        k,
        v,
        None,
        None,
        AttentionModuleOptions {
            scale: Some(1.0 / (head_dim as f64).sqrt()),
            softcap: None,
            is_causal: false,
        },
    )
}
