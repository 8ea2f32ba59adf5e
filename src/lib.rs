//! oxidiff: diffusion image generation in Rust, in the style of Hugging Face diffusers, where a
//! TPU is "just another device".
//!
//! This facade re-exports the workspace's crates: [`models`] (UNet, VAE, text encoders),
//! [`schedulers`] (the diffusers scheduler family) and [`pipelines`] (Stable Diffusion and
//! friends), and names the default CPU backend.

pub use oxidiff_models as models;
pub use oxidiff_pipelines as pipelines;
pub use oxidiff_schedulers as schedulers;

/// The default CPU backend: burn-flex, chosen by measurement (a 3x3 convolution ran about 8x
/// faster than burn-ndarray's on this project's machines).
pub type Cpu = burn_flex::Flex;

pub mod latents;
