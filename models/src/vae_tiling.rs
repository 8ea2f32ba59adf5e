//! Tiled VAE encode and decode, as diffusers' `AutoencoderKL.enable_tiling()`: the input is cut
//! into overlapping square tiles, each tile runs through the encoder or decoder alone, and
//! neighbouring outputs are blended linearly across their overlap, so memory follows the tile
//! size instead of the image size. The result is close to, not equal to, the untiled one.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::dtype::{cast_to, dtype_of};
use crate::error::{ModelError, Result};

/// diffusers' `tile_overlap_factor`: neighbouring tiles share a quarter of a tile.
pub const TILE_OVERLAP_FACTOR: f64 = 0.25;

/// The tile sizes of a tiled VAE: `sample` pixels on the image side (diffusers'
/// `tile_sample_min_size`), `latent` cells on the latent side (`tile_latent_min_size`). An input
/// no larger than one tile runs untiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VaeTiling {
    pub sample: usize,
    pub latent: usize,
}

impl VaeTiling {
    /// Tiles of `sample` pixels for a VAE of `scale_factor` pixels per latent cell (the
    /// latent tile `sample / scale_factor`), as `--vae-tile-size` sets them. Refused: a size
    /// that is not a multiple of the factor, or whose latent tile is too small to overlap.
    pub fn new(sample: usize, scale_factor: usize) -> Result<Self> {
        let latent = sample / scale_factor.max(1);
        // The tiles step by `int(latent * 0.75)` cells, which must be at least one.
        if !sample.is_multiple_of(scale_factor.max(1)) || latent < 2 {
            return Err(ModelError::Input(format!(
                "a VAE tile of {sample} pixels does not fit this VAE: give a multiple of \
                 {scale_factor} pixels, at least {}",
                2 * scale_factor
            )));
        }
        Ok(Self { sample, latent })
    }

    /// Decodes `z` `[n, c, h, w]` tile by tile with `decode` (one tile's latents to its
    /// pixels), blended as diffusers' `tiled_decode`.
    pub fn decode<B: Backend>(
        &self,
        z: Tensor<B, 4>,
        decode: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        tiled(z, self.latent, self.sample, decode)
    }

    /// Encodes `x` `[n, 3, h, w]` tile by tile with `encode` (one tile's pixels to its latent
    /// moments), blended as diffusers' `_tiled_encode`.
    pub fn encode<B: Backend>(
        &self,
        x: Tensor<B, 4>,
        encode: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        tiled(x, self.sample, self.latent, encode)
    }
}

/// Runs `f` on tiles of `input_tile` (stepping by three quarters of a tile), blends each
/// output with the one above and the one to its left over a quarter of `output_tile`, and
/// keeps the first `output_tile - blend` rows and columns of each. As in diffusers, a tile is
/// blended in place before the tiles below and to its right read it.
fn tiled<B: Backend>(
    x: Tensor<B, 4>,
    input_tile: usize,
    output_tile: usize,
    f: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
) -> Tensor<B, 4> {
    let [n, c, h, w] = x.dims();
    let step = ((input_tile as f64 * (1.0 - TILE_OVERLAP_FACTOR)) as usize).max(1);
    let blend = (output_tile as f64 * TILE_OVERLAP_FACTOR) as usize;
    let keep = output_tile - blend;
    let mut rows: Vec<Vec<Tensor<B, 4>>> = (0..h)
        .step_by(step)
        .map(|i| {
            (0..w)
                .step_by(step)
                .map(|j| {
                    let tile = x.clone().slice([
                        0..n,
                        0..c,
                        i..(i + input_tile).min(h),
                        j..(j + input_tile).min(w),
                    ]);
                    f(tile)
                })
                .collect()
        })
        .collect();
    let mut result_rows = Vec::with_capacity(rows.len());
    for i in 0..rows.len() {
        let mut result_row = Vec::with_capacity(rows[i].len());
        for j in 0..rows[i].len() {
            let mut tile = rows[i][j].clone();
            if i > 0 {
                tile = blend_into(&rows[i - 1][j], tile, blend, 2);
            }
            if j > 0 {
                tile = blend_into(&rows[i][j - 1], tile, blend, 3);
            }
            rows[i][j] = tile.clone();
            let [tn, tc, th, tw] = tile.dims();
            result_row.push(tile.slice([0..tn, 0..tc, 0..keep.min(th), 0..keep.min(tw)]));
        }
        result_rows.push(Tensor::cat(result_row, 3));
    }
    Tensor::cat(result_rows, 2)
}

/// diffusers' `blend_v` (`dim` 2) and `blend_h` (`dim` 3): the first `extent` rows (columns)
/// of `b` become `a`'s last ones weighted `1 - k / extent` plus `b`'s weighted `k / extent`.
fn blend_into<B: Backend>(
    a: &Tensor<B, 4>,
    b: Tensor<B, 4>,
    extent: usize,
    dim: usize,
) -> Tensor<B, 4> {
    let (a_len, b_len) = (a.dims()[dim], b.dims()[dim]);
    let extent = extent.min(a_len).min(b_len);
    if extent == 0 {
        return b;
    }
    let weights: Vec<f32> = (0..extent)
        .map(|k| (k as f64 / extent as f64) as f32)
        .collect();
    let mut shape = [1usize; 4];
    shape[dim] = extent;
    let weight = cast_to(
        Tensor::<B, 4>::from_data(TensorData::new(weights, shape), &b.device()),
        dtype_of(&b),
    );
    let a_tail = a.clone().narrow(dim, a_len - extent, extent);
    let b_head = b.clone().narrow(dim, 0, extent);
    let blended = a_tail * weight.clone().neg().add_scalar(1.0) + b_head * weight;
    if extent == b_len {
        blended
    } else {
        Tensor::cat(vec![blended, b.narrow(dim, extent, b_len - extent)], dim)
    }
}
