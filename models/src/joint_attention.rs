//! SD3's attention (diffusers' `Attention` with `JointAttnProcessor2_0`), one type for each
//! form an MMDiT block gives it: [`JointAttention`] in blocks that update both streams,
//! [`ContextPreOnlyAttention`] in the last block, [`ImageSelfAttention`] as SD3.5 Medium's
//! `attn2`. Field names are the checkpoint's, so LoRA and tensor-parallel rules name the same
//! paths whichever form a block holds.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::attention::multi_head_attention;
use crate::error::Result;
use crate::nn::Linear;
use crate::normalization::RMSNorm;
use crate::var_builder::VarBuilder;

/// The shape of an SD3 attention.
#[derive(Debug, Clone, Copy)]
pub struct JointAttentionSpec {
    pub dim: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// `qk_norm: rms_norm` (SD3.5; eps 1e-6): queries and keys RMS-normed per head.
    pub qk_rms_norm: bool,
}

impl JointAttentionSpec {
    fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    fn linear<B: Backend>(&self, vb: &VarBuilder<B>, name: &str) -> Result<Linear<B>> {
        Linear::load(&vb.pp(name), self.dim, self.inner(), true)
    }

    fn out<B: Backend>(&self, vb: &VarBuilder<B>) -> Result<Linear<B>> {
        Linear::load(vb, self.inner(), self.dim, true)
    }

    fn norm<B: Backend>(&self, vb: &VarBuilder<B>, name: &str) -> Result<Option<RMSNorm<B>>> {
        self.qk_rms_norm
            .then(|| RMSNorm::load(&vb.pp(name), self.head_dim, 1e-6, true))
            .transpose()
    }

    /// One stream's projections, loaded under `[q, k, v, norm_q, norm_k]`.
    fn stream<B: Backend>(&self, vb: &VarBuilder<B>, names: [&str; 5]) -> Result<Stream<B>> {
        let [q, k, v, norm_q, norm_k] = names;
        Ok(Stream {
            q: self.linear(vb, q)?,
            k: self.linear(vb, k)?,
            v: self.linear(vb, v)?,
            norm_q: self.norm(vb, norm_q)?,
            norm_k: self.norm(vb, norm_k)?,
        })
    }
}

const IMAGE: [&str; 5] = ["to_q", "to_k", "to_v", "norm_q", "norm_k"];
const CONTEXT: [&str; 5] = [
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "norm_added_q",
    "norm_added_k",
];

/// One stream's q/k/v projections as loaded, before they move into an attention's fields.
struct Stream<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    norm_q: Option<RMSNorm<B>>,
    norm_k: Option<RMSNorm<B>>,
}

/// `proj(x)` `[batch, seq, inner]`, RMS-normed per head when `norm` is set.
fn project<B: Backend>(
    proj: &Linear<B>,
    norm: Option<&RMSNorm<B>>,
    x: Tensor<B, 3>,
    heads: usize,
) -> Tensor<B, 3> {
    let y = proj.forward(x);
    match norm {
        Some(norm) => {
            let [b, s, inner] = y.dims();
            let per_head: Tensor<B, 4> = y.reshape([b, s, heads, inner / heads]);
            norm.forward(per_head).reshape([b, s, inner])
        }
        None => y,
    }
}

/// q, k and v of one stream, `[batch, seq, inner]` each.
fn qkv<B: Backend>(
    x: Tensor<B, 3>,
    (q, k, v): (&Linear<B>, &Linear<B>, &Linear<B>),
    (norm_q, norm_k): (Option<&RMSNorm<B>>, Option<&RMSNorm<B>>),
    heads: usize,
) -> [Tensor<B, 3>; 3] {
    [
        project(q, norm_q, x.clone(), heads),
        project(k, norm_k, x.clone(), heads),
        v.forward(x),
    ]
}

/// Attends the image stream and the context stream jointly over `[image; context]`; returns
/// the two halves of the output, before their projections out.
fn attend_jointly<B: Backend>(
    [q, k, v]: [Tensor<B, 3>; 3],
    [cq, ck, cv]: [Tensor<B, 3>; 3],
    heads: usize,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let n = q.dims()[1];
    let m = cq.dims()[1];
    let out = multi_head_attention(
        Tensor::cat(vec![q, cq], 1),
        Tensor::cat(vec![k, ck], 1),
        Tensor::cat(vec![v, cv], 1),
        heads,
        false,
    );
    (out.clone().narrow(1, 0, n), out.narrow(1, n, m))
}

/// The attention of a block that updates both streams: the image stream's `to_q/to_k/to_v`
/// and the context's `add_q_proj/add_k_proj/add_v_proj` attended jointly, each projected back
/// (`to_out.0`, `to_add_out`).
#[derive(Module, Debug)]
pub struct JointAttention<B: Backend> {
    pub to_q: Linear<B>,
    pub to_k: Linear<B>,
    pub to_v: Linear<B>,
    pub norm_q: Option<RMSNorm<B>>,
    pub norm_k: Option<RMSNorm<B>>,
    pub to_out: Linear<B>,
    pub add_q_proj: Linear<B>,
    pub add_k_proj: Linear<B>,
    pub add_v_proj: Linear<B>,
    pub norm_added_q: Option<RMSNorm<B>>,
    pub norm_added_k: Option<RMSNorm<B>>,
    pub to_add_out: Linear<B>,
    pub heads: usize,
}

impl<B: Backend> JointAttention<B> {
    pub fn load(vb: &VarBuilder<B>, spec: JointAttentionSpec) -> Result<Self> {
        let image = spec.stream(vb, IMAGE)?;
        let context = spec.stream(vb, CONTEXT)?;
        Ok(Self {
            to_q: image.q,
            to_k: image.k,
            to_v: image.v,
            norm_q: image.norm_q,
            norm_k: image.norm_k,
            to_out: spec.out(&vb.pp("to_out").pp(0))?,
            add_q_proj: context.q,
            add_k_proj: context.k,
            add_v_proj: context.v,
            norm_added_q: context.norm_q,
            norm_added_k: context.norm_k,
            to_add_out: spec.out(&vb.pp("to_add_out"))?,
            heads: spec.heads,
        })
    }

    /// `x` `[batch, n, dim]` and `context` `[batch, m, dim]` in; their outputs out.
    pub fn forward(&self, x: Tensor<B, 3>, context: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let image = qkv(
            x,
            (&self.to_q, &self.to_k, &self.to_v),
            (self.norm_q.as_ref(), self.norm_k.as_ref()),
            self.heads,
        );
        let context = qkv(
            context,
            (&self.add_q_proj, &self.add_k_proj, &self.add_v_proj),
            (self.norm_added_q.as_ref(), self.norm_added_k.as_ref()),
            self.heads,
        );
        let (image, context) = attend_jointly(image, context, self.heads);
        (self.to_out.forward(image), self.to_add_out.forward(context))
    }
}

/// The attention of the last block (`context_pre_only`): the context is attended to but not
/// projected back, so there is no `to_add_out`.
#[derive(Module, Debug)]
pub struct ContextPreOnlyAttention<B: Backend> {
    pub to_q: Linear<B>,
    pub to_k: Linear<B>,
    pub to_v: Linear<B>,
    pub norm_q: Option<RMSNorm<B>>,
    pub norm_k: Option<RMSNorm<B>>,
    pub to_out: Linear<B>,
    pub add_q_proj: Linear<B>,
    pub add_k_proj: Linear<B>,
    pub add_v_proj: Linear<B>,
    pub norm_added_q: Option<RMSNorm<B>>,
    pub norm_added_k: Option<RMSNorm<B>>,
    pub heads: usize,
}

impl<B: Backend> ContextPreOnlyAttention<B> {
    pub fn load(vb: &VarBuilder<B>, spec: JointAttentionSpec) -> Result<Self> {
        let image = spec.stream(vb, IMAGE)?;
        let context = spec.stream(vb, CONTEXT)?;
        Ok(Self {
            to_q: image.q,
            to_k: image.k,
            to_v: image.v,
            norm_q: image.norm_q,
            norm_k: image.norm_k,
            to_out: spec.out(&vb.pp("to_out").pp(0))?,
            add_q_proj: context.q,
            add_k_proj: context.k,
            add_v_proj: context.v,
            norm_added_q: context.norm_q,
            norm_added_k: context.norm_k,
            heads: spec.heads,
        })
    }

    /// The image stream's output of the joint attention of `x` and `context`.
    pub fn forward(&self, x: Tensor<B, 3>, context: Tensor<B, 3>) -> Tensor<B, 3> {
        let image = qkv(
            x,
            (&self.to_q, &self.to_k, &self.to_v),
            (self.norm_q.as_ref(), self.norm_k.as_ref()),
            self.heads,
        );
        let context = qkv(
            context,
            (&self.add_q_proj, &self.add_k_proj, &self.add_v_proj),
            (self.norm_added_q.as_ref(), self.norm_added_k.as_ref()),
            self.heads,
        );
        let (image, _) = attend_jointly(image, context, self.heads);
        self.to_out.forward(image)
    }
}

/// SD3.5 Medium's second attention (`attn2`): the image stream attending to itself.
#[derive(Module, Debug)]
pub struct ImageSelfAttention<B: Backend> {
    pub to_q: Linear<B>,
    pub to_k: Linear<B>,
    pub to_v: Linear<B>,
    pub norm_q: Option<RMSNorm<B>>,
    pub norm_k: Option<RMSNorm<B>>,
    pub to_out: Linear<B>,
    pub heads: usize,
}

impl<B: Backend> ImageSelfAttention<B> {
    pub fn load(vb: &VarBuilder<B>, spec: JointAttentionSpec) -> Result<Self> {
        let image = spec.stream(vb, IMAGE)?;
        Ok(Self {
            to_q: image.q,
            to_k: image.k,
            to_v: image.v,
            norm_q: image.norm_q,
            norm_k: image.norm_k,
            to_out: spec.out(&vb.pp("to_out").pp(0))?,
            heads: spec.heads,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [q, k, v] = qkv(
            x,
            (&self.to_q, &self.to_k, &self.to_v),
            (self.norm_q.as_ref(), self.norm_k.as_ref()),
            self.heads,
        );
        self.to_out
            .forward(multi_head_attention(q, k, v, self.heads, false))
    }
}
