//! oxidiff: diffusion image generation in Rust, in the style of Hugging Face diffusers, where a
//! TPU is "just another device".
//!
//! This facade re-exports the workspace's crates: [`models`] (UNet, VAE, text encoders),
//! [`schedulers`] (the diffusers scheduler family) and [`pipelines`] (Stable Diffusion and
//! friends), the PJRT backend ([`backend`]: [`Oxi`], whose [`OxiDevice`] is the CPU or any PJRT
//! device: `"cpu"`, `"xla:cpu"`, `"tpu:0"`, `"cuda"`), and names the pure CPU backend [`Cpu`].
//!
//! # Text to image
//!
//! A diffusers-format folder (or a Hub id in the local cache) in, PNG out. This runs the tiny
//! random-weight test pipeline on the CPU in about a second:
//!
//! ```
//! use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
//! use oxidiff::Cpu;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-sd1");
//! let options = LoadOptions { scheduler: Some("Euler a".into()), ..Default::default() };
//! let mut pipe = StableDiffusionPipeline::<Cpu>::from_pretrained(model, &options, &Default::default())?;
//! let out = pipe.generate(&GenerateRequest {
//!     prompts: vec!["a photo of an astronaut riding a horse".into()],
//!     num_inference_steps: 4,
//!     seed: 42, // PyTorch's CPU generator: the same latents as diffusers with this seed
//!     ..Default::default()
//! })?;
//! let images = out.images.expect("images were asked for");
//! assert_eq!((images.count, images.width, images.height), (1, 64, 64));
//! images.save_png(0, &std::env::temp_dir().join("oxidiff-doc.png"))?;
//! # Ok(())
//! # }
//! ```
//!
//! # On an accelerator
//!
//! The [`Oxi`] backend runs the same pipeline on the CPU or on any PJRT device; move it with
//! [`ToDevice::to`], optionally in bf16 and compiled (one XLA program per denoising step):
//!
//! ```no_run
//! use burn::tensor::FloatDType;
//! use oxidiff::pipelines::{LoadOptions, StableDiffusionPipeline};
//! use oxidiff::{Oxi, OxiDevice, ToDevice};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let options = LoadOptions { dtype: Some(FloatDType::BF16), ..Default::default() };
//! let pipe = StableDiffusionPipeline::<Oxi>::from_pretrained(
//!     "stabilityai/stable-diffusion-2-1-base", &options, &OxiDevice::Cpu)?;
//! let mut pipe = pipe.to(&"tpu:0".parse()?); // or "xla:cpu", "cuda:1"
//! pipe.compile()?;
//! # Ok(())
//! # }
//! ```

pub use oxidiff_backend_tpu as backend;
pub use oxidiff_models as models;
pub use oxidiff_pipelines as pipelines;
pub use oxidiff_schedulers as schedulers;

pub use oxidiff_backend_tpu::{Oxi, OxiDevice};
pub use oxidiff_models::ToDevice;

/// The default CPU backend: burn-flex, chosen by measurement against burn-ndarray
/// (`docs/benchmarks.md`).
pub type Cpu = burn_flex::Flex;

pub mod cli;
pub mod execution;
pub mod files;
pub mod latents;

/// Keeps freed tensor memory in the process instead of handing it back to the kernel after
/// every op (glibc's `mallopt`: no `mmap`ed blocks, a 32 MiB mmap threshold, a 2 GiB trim
/// threshold, and one arena for every thread). By default glibc serves each large op output or
/// im2col buffer with a fresh `mmap` and unmaps it on `free`, so every op faults and zeroes its
/// pages again. The single arena matters for threads other than the main one (XLA's CPU
/// plugin runs programs on its own threads): each would get an arena of its own, whose heaps
/// are at most 64 MiB, so glibc `mmap`s larger blocks there whatever the settings above, and
/// deletes a heap once it is empty; a compiled program's working memory was then faulted in
/// again at every run. The effects are measured in `docs/benchmarks.md`. Returns whether the
/// allocator took the settings (false off glibc). The binaries call it first thing, before
/// any thread allocates; library users may too.
pub fn tune_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is called before any threads
        // allocate concurrently with it in the binaries, and is thread-safe in glibc anyway.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
                && libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_ARENA_MAX, 1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
