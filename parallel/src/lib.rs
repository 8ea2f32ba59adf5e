//! Tensor and data parallelism across chips.
//!
//! Where this sits: models declare their tensor-parallel plans ([`TensorParallelPlan`]) next to
//! their definitions; the PJRT backend applies them as sharding annotations in compiled mode.
//! This crate only describes, so models can depend on it without depending on a backend.

pub mod plan;

pub use plan::{ShardRule, ShardStyle, TensorParallel, TensorParallelPlan};
