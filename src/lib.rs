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

/// Keeps freed tensor memory in the process instead of handing it back to the kernel after
/// every op (glibc's `mallopt`: no `mmap`ed blocks, a 32 MiB mmap threshold and a 2 GiB trim
/// threshold). By default glibc serves large blocks (an op's output, a convolution's im2col
/// buffer of hundreds of MB in the VAE) with fresh `mmap`s and unmaps them on `free`, so each
/// op's memory is faulted in and zeroed page by page again. On the SD 1.5 UNet step on the CPU
/// backend (1 thread, 256x256) this cut CPU time per step by about 8% (threshold and trim),
/// then 10% more for the step and 12% for the VAE decode (no mmap), with the same peak RSS
/// (measured with `tools/bench`). Returns whether the allocator took the settings (false off
/// glibc). The binaries call it first thing; library users may too.
pub fn tune_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is called before any threads
        // allocate concurrently with it in the binaries, and is thread-safe in glibc anyway.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
                && libc::mallopt(libc::M_MMAP_MAX, 0) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
