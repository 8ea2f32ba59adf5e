//! PIL's `Image.resize(size, Image.LANCZOS)` for 8-bit images, pixel for pixel: the resampling
//! diffusers' `VaeImageProcessor` applies to input images and masks whose size differs from
//! the requested one (most photos: sizes are rounded down to a multiple of 8 by resizing, not
//! cropping).
//!
//! The algorithm as Pillow's `libImaging/Resample.c` defines it: a Lanczos-3 kernel widened by
//! the scale when shrinking, per output pixel a window of source pixels whose weights are
//! normalized to sum to 1 and then quantized to 22-bit fixed point; a horizontal pass, then a
//! vertical pass, each rounding to 8 bits.

use std::f64::consts::PI;

/// Fractional bits of the fixed-point weights (32 bits less 8 for the pixel, 2 for overshoot).
const PRECISION_BITS: u32 = 22;

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        1.0
    } else {
        let x = x * PI;
        x.sin() / x
    }
}

/// The Lanczos kernel with a = 3 (support [-3, 3)).
fn lanczos(x: f64) -> f64 {
    if (-3.0..3.0).contains(&x) {
        sinc(x) * sinc(x / 3.0)
    } else {
        0.0
    }
}

/// Pillow's bicubic kernel (`a = -0.5`, support [-2, 2]): `Image.resize`'s default filter.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// A resampling filter of Pillow's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// `Image.LANCZOS` (a = 3), what diffusers' image processor asks for.
    Lanczos,
    /// `Image.BICUBIC`, `Image.resize`'s default.
    Bicubic,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Self::Lanczos => 3.0,
            Self::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Self::Lanczos => lanczos(x),
            Self::Bicubic => bicubic(x),
        }
    }
}

/// For each output pixel along one axis: the first source pixel and the fixed-point weights
/// of the source pixels from there on.
struct Taps {
    windows: Vec<(usize, Vec<i32>)>,
}

impl Taps {
    /// Taps sampling the source span `[start, end)` (Pillow's resize `box` along this axis)
    /// of `in_size` pixels into `out_size`.
    fn new(filter: Filter, in_size: usize, (start, end): (f64, f64), out_size: usize) -> Self {
        let scale = (end - start) / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = filter.support() * filter_scale;
        // Multiplied by the reciprocal, as Pillow does (not divided: the roundings differ).
        let inverse = 1.0 / filter_scale;
        let windows = (0..out_size)
            .map(|out| {
                let center = start + (out as f64 + 0.5) * scale;
                // C's `(int)` truncates toward zero, as `as i64` does.
                let first = ((center - support + 0.5) as i64).max(0) as usize;
                let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
                let weights: Vec<f64> = (first..end)
                    .map(|x| filter.weight((x as f64 - center + 0.5) * inverse))
                    .collect();
                let mut total = 0.0;
                for w in &weights {
                    total += w;
                }
                let one = f64::from(1u32 << PRECISION_BITS);
                let fixed = weights
                    .iter()
                    .map(|&w| {
                        let w = if total != 0.0 { w / total } else { w };
                        if w < 0.0 {
                            (-0.5 + w * one) as i32
                        } else {
                            (0.5 + w * one) as i32
                        }
                    })
                    .collect();
                (first, fixed)
            })
            .collect();
        Self { windows }
    }
}

/// One weighted sum, rounded and clipped to 8 bits as Pillow's `clip8`.
fn convolve(pixels: impl Iterator<Item = u8>, weights: &[i32]) -> u8 {
    let mut sum: i32 = 1 << (PRECISION_BITS - 1);
    for (p, &w) in pixels.zip(weights) {
        sum += i32::from(p) * w;
    }
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes interleaved 8-bit pixels (`channels` per pixel, rows of `width`) to
/// `new_width x new_height` as PIL's Lanczos resize: the horizontal pass only when the width
/// changes, the vertical only when the height does.
pub fn resize_lanczos(
    pixels: &[u8],
    channels: usize,
    (width, height): (usize, usize),
    (new_width, new_height): (usize, usize),
) -> Vec<u8> {
    let whole = [0.0, 0.0, width as f64, height as f64];
    resize_box(
        Filter::Lanczos,
        pixels,
        channels,
        (width, height),
        (new_width, new_height),
        whole,
    )
}

/// PIL's `resize(size, filter, box=region)` (`region` = `[x0, y0, x1, y1]` of the source): a
/// pass runs when its size changes or the box does not span the source along it, as Pillow
/// decides. A box of zero height (or width) samples the rows next to its edge, which is how
/// diffusers' `resize_mode="fill"` extends an image's first and last rows.
pub fn resize_box(
    filter: Filter,
    pixels: &[u8],
    channels: usize,
    (width, height): (usize, usize),
    (new_width, new_height): (usize, usize),
    region: [f64; 4],
) -> Vec<u8> {
    let [x0, y0, x1, y1] = region;
    let mut data = pixels.to_vec();
    let mut w = width;
    if new_width != width || x0 != 0.0 || x1 != new_width as f64 {
        let taps = Taps::new(filter, width, (x0, x1), new_width);
        let mut out = Vec::with_capacity(new_width * height * channels);
        for row in data.chunks_exact(width * channels) {
            for (first, weights) in &taps.windows {
                for c in 0..channels {
                    let source = (*first..first + weights.len()).map(|x| row[x * channels + c]);
                    out.push(convolve(source, weights));
                }
            }
        }
        data = out;
        w = new_width;
    }
    if new_height != height || y0 != 0.0 || y1 != new_height as f64 {
        let taps = Taps::new(filter, height, (y0, y1), new_height);
        let stride = w * channels;
        let mut out = Vec::with_capacity(stride * new_height);
        for (first, weights) in &taps.windows {
            for i in 0..stride {
                let source = (*first..first + weights.len()).map(|y| data[y * stride + i]);
                out.push(convolve(source, weights));
            }
        }
        data = out;
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_a_copy_and_flat_images_stay_flat() {
        let pixels: Vec<u8> = (0..4 * 3 * 3).map(|v| v as u8).collect();
        assert_eq!(resize_lanczos(&pixels, 3, (4, 3), (4, 3)), pixels);
        let flat = vec![77u8; 10 * 7];
        for size in [(3, 2), (10, 3), (23, 17)] {
            let out = resize_lanczos(&flat, 1, (10, 7), size);
            assert_eq!(out.len(), size.0 * size.1);
            assert!(out.iter().all(|&v| v == 77), "{size:?}: {out:?}");
        }
    }
}
