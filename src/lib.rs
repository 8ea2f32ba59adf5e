//! oxidiff: diffusion image generation in Rust, in the style of Hugging Face diffusers, where a
//! TPU is "just another device".
//!
//! This facade re-exports the workspace's crates: [`models`] (UNet, VAE, text encoders),
//! [`schedulers`] (the diffusers scheduler family) and [`pipelines`] (Stable Diffusion and
//! friends), the PJRT backend ([`backend`]: [`Oxi`], whose [`OxiDevice`] is the CPU or any PJRT
//! device: `"cpu"`, `"xla:cpu"`, `"tpu:0"`, `"cuda"`), and names the pure CPU backend [`Cpu`].

pub use oxidiff_backend_tpu as backend;
pub use oxidiff_models as models;
pub use oxidiff_pipelines as pipelines;
pub use oxidiff_schedulers as schedulers;

pub use oxidiff_backend_tpu::{Oxi, OxiDevice};
pub use oxidiff_models::ToDevice;

/// The default CPU backend: burn-flex, chosen by measurement (a 3x3 convolution ran about 8x
/// faster than burn-ndarray's on this project's machines).
pub type Cpu = burn_flex::Flex;

pub mod latents;
