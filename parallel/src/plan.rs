//! Tensor-parallel plans: which linear layers of a model are split across devices, and how.
//!
//! A model declares its plan next to its definition (as diffusers' `_tp_plan` does), by module
//! path pattern over the checkpoint's key paths. The plan only describes; the PJRT backend turns
//! it into sharding annotations and XLA's partitioner inserts the collectives.

/// How one linear layer is split across the devices of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardStyle {
    /// Split the output features: each device computes a slice of the outputs (attention
    /// q/k/v, the first feed-forward projection). The bias is split the same way.
    ColumnWise,
    /// Split the input features: each device holds a slice of the inputs and the partial
    /// results are summed by an all-reduce (attention output, second feed-forward
    /// projection). The bias is kept whole.
    RowWise,
}

/// One rule of a plan: a module path pattern and how the linear layers it matches are split.
///
/// Patterns are dot-separated like checkpoint keys; a `*` segment matches any one segment
/// (`down_blocks.*.attentions.*.transformer_blocks.*.attn1.to_q`). The pattern names the module
/// (the `Linear`), not its `.weight` or `.bias`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRule {
    pub pattern: &'static str,
    pub style: ShardStyle,
}

impl ShardRule {
    pub const fn column(pattern: &'static str) -> Self {
        Self {
            pattern,
            style: ShardStyle::ColumnWise,
        }
    }

    pub const fn row(pattern: &'static str) -> Self {
        Self {
            pattern,
            style: ShardStyle::RowWise,
        }
    }

    /// Whether this rule's pattern matches a module path such as
    /// `transformer_blocks.3.attn1.to_q`.
    pub fn matches(&self, module_path: &str) -> bool {
        path_matches(self.pattern, module_path)
    }
}

/// A model's tensor-parallel plan: its rules, in the order they are tried (first match wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallelPlan {
    /// The model's diffusers class name, for messages (`UNet2DConditionModel`).
    pub model: &'static str,
    pub rules: &'static [ShardRule],
}

impl TensorParallelPlan {
    /// How the linear layer at `module_path` is split, or `None` when it stays replicated.
    pub fn style_of(&self, module_path: &str) -> Option<ShardStyle> {
        self.rules
            .iter()
            .find(|rule| rule.matches(module_path))
            .map(|rule| rule.style)
    }
}

/// Implemented by models that can be split across devices; the plan sits beside the model.
pub trait TensorParallel {
    fn tensor_parallel_plan() -> TensorParallelPlan;

    /// The sizes the tensor-parallel degree must divide (each sharded attention's heads, each
    /// sharded feed-forward's inner width), checked by
    /// [`ParallelConfig::validate`](crate::ParallelConfig::validate).
    fn sharded_widths(&self) -> Vec<crate::ShardedWidth>;

    /// Readies the forward pass for weights split over `tp` devices where the split changes
    /// how a layer reads its outputs (GEGLU's packed value and gate columns, grouped per
    /// device); 1 restores the checkpoint's layout. Nothing by default.
    fn set_tensor_parallel_degree(&mut self, tp: usize) {
        let _ = tp;
    }
}

fn path_matches(pattern: &str, path: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut path = path.split('.');
    loop {
        match (pattern.next(), path.next()) {
            (None, None) => return true,
            (Some("*"), Some(_)) => {}
            (Some(want), Some(got)) if want == got => {}
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAN: TensorParallelPlan = TensorParallelPlan {
        model: "Test",
        rules: &[
            ShardRule::column("blocks.*.attn.to_q"),
            ShardRule::row("blocks.*.attn.to_out.0"),
        ],
    };

    #[test]
    fn star_matches_exactly_one_segment() {
        assert_eq!(
            PLAN.style_of("blocks.3.attn.to_q"),
            Some(ShardStyle::ColumnWise)
        );
        assert_eq!(
            PLAN.style_of("blocks.3.attn.to_out.0"),
            Some(ShardStyle::RowWise)
        );
        assert_eq!(PLAN.style_of("blocks.3.4.attn.to_q"), None);
        assert_eq!(PLAN.style_of("blocks.attn.to_q"), None);
        assert_eq!(PLAN.style_of("blocks.3.attn.to_q.weight"), None);
        assert_eq!(PLAN.style_of("blocks.3.attn.to_k"), None);
    }
}
