//! Tensor and data parallelism across chips.
//!
//! Where this sits: models declare their tensor-parallel plans ([`TensorParallelPlan`]) next to
//! their definitions; a [`ParallelConfig`] (tensor and data parallel degrees over a device
//! mesh) says how far to spread them, and is checked here; the PJRT backend applies both as
//! sharding annotations in compiled mode. This crate only describes, so models can depend on it
//! without depending on a backend.

pub mod config;
pub mod plan;

pub use config::{
    DataParallelConfig, ParallelConfig, ParallelError, ParallelTarget, ShardedWidth,
    TensorParallelConfig,
};
pub use plan::{ShardRule, ShardStyle, TensorParallel, TensorParallelPlan};
