//! Finding a model's tensor-parallel layers: the parameters its
//! [`TensorParallelPlan`](oxidiff_parallel::TensorParallelPlan) splits, by checkpoint key, and
//! along which dimension of Burn's layout. The plans themselves sit beside each model
//! (`impl TensorParallel for UNet2DConditionModel`, ...); the backend applies the result.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use oxidiff_parallel::{ShardStyle, TensorParallelPlan};

use crate::attention::{Attention, FeedForward};

/// One parameter a plan splits.
#[derive(Debug, Clone)]
pub struct ShardedParam<B: Backend> {
    /// Its checkpoint key (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight`).
    pub key: String,
    pub style: ShardStyle,
    /// The dimension split over the tensor-parallel devices, in Burn's layout: a `Linear`
    /// weight is `[in, out]`, so column-wise splits dimension 1 and row-wise dimension 0; a
    /// column-wise bias splits its only dimension. (A row-wise bias stays whole and is not
    /// listed.)
    pub split_dim: usize,
    /// Equal segments of the split dimension that are split one by one (2 for GEGLU's
    /// `ff.net.0.proj`, whose output is `[values, gates]`; else 1): device `t` gets slice `t`
    /// of each, which matches [`FeedForward::geglu_groups`] set to the degree.
    pub packed: usize,
    pub dims: Vec<usize>,
    /// The parameter's tensor (its handle: the backend finds its device buffer by it).
    pub tensor: TensorPrimitive<B>,
}

/// The parameters of `module` that `plan` splits, in visiting order.
pub fn sharded_params<B: Backend, M: Module<B>>(
    module: &M,
    plan: &TensorParallelPlan,
) -> Vec<ShardedParam<B>> {
    let mut visitor = PlanVisitor {
        plan,
        path: Vec::new(),
        found: Vec::new(),
    };
    module.visit(&mut visitor);
    let mut found = visitor.found;
    // A feed-forward's first projection is GEGLU's packed one when it is twice as wide as
    // the second projection's input.
    let inner_of: std::collections::HashMap<String, usize> = found
        .iter()
        .filter_map(|p| {
            let ff = p.key.strip_suffix(".net.2.weight")?;
            Some((ff.to_string(), p.dims[0]))
        })
        .collect();
    for param in &mut found {
        let ff = param
            .key
            .strip_suffix(".net.0.proj.weight")
            .or_else(|| param.key.strip_suffix(".net.0.proj.bias"));
        if let Some(inner) = ff.and_then(|ff| inner_of.get(ff)) {
            if param.dims[param.split_dim] == 2 * inner {
                param.packed = 2;
            }
        }
    }
    found
}

/// Groups every GEGLU feed-forward's columns for `tp` devices ([`FeedForward::geglu_groups`]);
/// the weights must be placed to match (tensor parallelism does both).
pub(crate) fn set_geglu_groups<B: Backend>(feed_forwards: &mut [&mut FeedForward<B>], tp: usize) {
    for ff in feed_forwards {
        ff.geglu_groups = tp.max(1);
    }
}

struct PlanVisitor<'a, B: Backend> {
    plan: &'a TensorParallelPlan,
    /// Checkpoint key segments of the enclosing modules (empty for enum variants).
    path: Vec<String>,
    found: Vec<ShardedParam<B>>,
}

/// The checkpoint key of field `name` of a struct of type `container`: where a module's field
/// names differ from diffusers' keys (`to_out` is `to_out.0`, the feed-forward's `proj_in` is
/// `net.0.proj`), as the loaders map them.
fn checkpoint_segment(name: &str, container: &str) -> String {
    match (container, name) {
        ("Struct:Attention", "to_out") => "to_out.0".into(),
        ("Struct:FeedForward", "proj_in") => "net.0.proj".into(),
        ("Struct:FeedForward", "proj_out") => "net.2".into(),
        (c, _) if c.starts_with("Enum:") => String::new(),
        _ => name.into(),
    }
}

impl<B: Backend> ModuleVisitor<B> for PlanVisitor<'_, B> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(checkpoint_segment(name, container_type));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some((leaf, module)) = self.path.split_last() else {
            return;
        };
        let module_path = module
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(".");
        let Some(style) = self.plan.style_of(&module_path) else {
            return;
        };
        let split_dim = match (leaf.as_str(), style, D) {
            ("weight", ShardStyle::ColumnWise, 2) => 1,
            ("weight", ShardStyle::RowWise, 2) => 0,
            ("bias", ShardStyle::ColumnWise, 1) => 0,
            _ => return,
        };
        let tensor = param.val();
        self.found.push(ShardedParam {
            key: format!("{module_path}.{leaf}"),
            style,
            split_dim,
            packed: 1,
            dims: tensor.dims().to_vec(),
            tensor: tensor.into_primitive(),
        });
    }
}

/// The widths of one transformer block's sharded layers, for
/// [`TensorParallel::sharded_widths`](oxidiff_parallel::TensorParallel::sharded_widths).
pub(crate) fn block_widths<B: Backend>(
    block: &str,
    attentions: &[(&str, &Attention<B>)],
    ff: &FeedForward<B>,
) -> Vec<oxidiff_parallel::ShardedWidth> {
    let mut widths: Vec<_> = attentions
        .iter()
        .map(|(name, attn)| {
            oxidiff_parallel::ShardedWidth::heads(format!("{block}.{name}"), attn.heads)
        })
        .collect();
    // `net.2`'s input width is the inner width (GEGLU's `net.0.proj` gives twice that).
    let inner = ff.proj_out.weight.dims()[0];
    widths.push(oxidiff_parallel::ShardedWidth::feed_forward(
        format!("{block}.ff"),
        inner,
    ));
    widths
}
