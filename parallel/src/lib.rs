//! Tensor and data parallelism across chips (`TensorParallelConfig`): not started yet.
//!
//! Where this will sit: models declare their tensor-parallel plans next to their definitions,
//! and the PJRT backend applies them as GSPMD/Shardy annotations in compiled mode. Nothing here
//! is implemented today; the crate exists so the workspace has the agreed layout.
