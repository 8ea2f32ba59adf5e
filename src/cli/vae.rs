//! The VAE flags both binaries take: tiled and sliced encode/decode (diffusers'
//! `vae.enable_tiling()` / `vae.enable_slicing()`).

use burn::tensor::backend::Backend;
use oxidiff_models::vae_tiling::VaeTiling;
use oxidiff_models::AutoencoderKL;

use crate::cli::UsageError;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct VaeArgs {
    /// Decode (and encode) the VAE in overlapping tiles of N pixels, blended as diffusers'
    /// `vae.enable_tiling()` with `tile_sample_min_size = N` (a multiple of the VAE's 8): memory
    /// follows the tile, not the image; the image differs slightly from an untiled one.
    #[arg(long, value_name = "N")]
    pub vae_tile_size: Option<usize>,
    /// Decode (and encode) a batch one image at a time (diffusers' `vae.enable_slicing()`):
    /// less memory for --batch-size above 1, the same images.
    #[arg(long)]
    pub vae_slicing: bool,
}

impl VaeArgs {
    /// Sets the flags on `vae`, whose latents are `scale_factor` times smaller than its images;
    /// a tile size that does not fit is a usage error naming the flag.
    pub fn apply<B: Backend>(
        &self,
        vae: &mut AutoencoderKL<B>,
        scale_factor: usize,
    ) -> Result<(), UsageError> {
        if let Some(size) = self.vae_tile_size {
            let tile = VaeTiling::new(size, scale_factor)
                .map_err(|e| UsageError(format!("--vae-tile-size {size}: {e}")))?;
            vae.enable_tiling(tile);
        }
        if self.vae_slicing {
            vae.enable_slicing();
        }
        Ok(())
    }
}
