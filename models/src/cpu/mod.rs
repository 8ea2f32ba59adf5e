//! Kernels for the burn-flex CPU backend in f32, used by the layers in [`crate::nn`] and
//! [`crate::attention`]. Each applies only when the backend's float tensor is burn-flex's and
//! the tensors are f32; otherwise it hands its inputs back and the caller uses Burn's own
//! operation, so other backends (PJRT, compiled traces) never reach this code.

pub mod attention;
pub mod common;
pub mod conv;
pub mod elementwise;
