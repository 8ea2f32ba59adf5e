//! Kernels for the burn-flex CPU backend, used by the layers in [`crate::nn`] and
//! [`crate::attention`]: f32 throughout, bf16 products on AMX or AVX512-BF16 ([`half_gemm`]), and
//! half precision elsewhere computed in f32. Each applies only when the backend's float tensor
//! is burn-flex's and the dtypes are ones it takes; otherwise it hands its inputs back and the
//! caller uses Burn's own operation, so other backends (PJRT, compiled traces) never reach it.

pub mod aligned;
pub mod amx;
pub mod attention;
pub mod attention_f32;
pub mod attention_f32_flash;
pub mod attention_flash;
pub mod attention_half;
pub mod avx512_bf16;
pub mod common;
pub mod conv;
pub mod conv_f32;
pub mod conv_half;
pub mod elementwise;
pub mod half_gemm;
pub mod linear;
pub mod quantized_linear;
pub mod simd;
pub(crate) mod weight_cache;
pub(crate) mod winograd;
