//! Writing heightmaps: 16-bit grayscale PNGs of the heights, and a shaded relief preview.

use std::path::Path;

use image::{ImageBuffer, Luma, Rgb};

use crate::{Result, TerrainError, HEIGHT_RANGE};

fn image_error(path: &Path, e: impl std::fmt::Display) -> TerrainError {
    TerrainError::Image {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Saves through a temporary file in the same folder, renamed into place when complete.
fn save_atomically(path: &Path, write: impl FnOnce(&Path) -> image::ImageResult<()>) -> Result<()> {
    let tmp = path.with_extension("png.partial");
    write(&tmp).map_err(|e| image_error(path, e))?;
    std::fs::rename(&tmp, path).map_err(|e| image_error(path, e))
}

/// `heights` (row-major, `width * height`, in `[0, HEIGHT_RANGE]`) as a 16-bit grayscale
/// PNG, 65535 being `HEIGHT_RANGE`: the scale is fixed, so maps of different difficulty
/// compare by their gray levels.
pub fn save_gray16_png(path: &Path, heights: &[f32], width: usize, height: usize) -> Result<()> {
    let levels: Vec<u16> = heights
        .iter()
        .map(|&h| ((h / HEIGHT_RANGE).clamp(0.0, 1.0) * 65535.0).round() as u16)
        .collect();
    let img: ImageBuffer<Luma<u16>, Vec<u16>> =
        ImageBuffer::from_raw(width as u32, height as u32, levels)
            .ok_or_else(|| image_error(path, "heights do not match width * height"))?;
    save_atomically(path, |p| img.save_with_format(p, image::ImageFormat::Png))
}

/// An 8-bit RGB PNG.
pub fn save_rgb_png(path: &Path, rgb: Vec<u8>, width: usize, height: usize) -> Result<()> {
    let img: ImageBuffer<Rgb<u8>, Vec<u8>> =
        ImageBuffer::from_raw(width as u32, height as u32, rgb)
            .ok_or_else(|| image_error(path, "pixels do not match width * height"))?;
    save_atomically(path, |p| img.save_with_format(p, image::ImageFormat::Png))
}

/// Shaded relief: Lambertian hillshade (light from the north-west, 45 degrees up) on
/// heights tinted from low (green) to high (pale brown), RGB bytes. `cell` is the
/// horizontal size of a pixel in height units (the package renders with 0.1).
pub fn hillshade_rgb(heights: &[f32], width: usize, height: usize, cell: f32) -> Vec<u8> {
    let at = |x: isize, y: isize| {
        let x = x.clamp(0, width as isize - 1) as usize;
        let y = y.clamp(0, height as isize - 1) as usize;
        heights[y * width + x]
    };
    let (azimuth, altitude) = (315f32.to_radians(), 45f32.to_radians());
    // Light direction (x east, y south, z up).
    let light = [
        altitude.cos() * azimuth.sin(),
        -altitude.cos() * azimuth.cos(),
        altitude.sin(),
    ];
    let (lo, hi) = heights
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &h| {
            (a.min(h), b.max(h))
        });
    let span = (hi - lo).max(1e-6);
    let low = [0.36f32, 0.55, 0.30];
    let high = [0.86f32, 0.80, 0.68];
    let mut rgb = Vec::with_capacity(width * height * 3);
    for y in 0..height as isize {
        for x in 0..width as isize {
            let dzdx = (at(x + 1, y) - at(x - 1, y)) / (2.0 * cell);
            let dzdy = (at(x, y + 1) - at(x, y - 1)) / (2.0 * cell);
            let norm = (dzdx * dzdx + dzdy * dzdy + 1.0).sqrt();
            let normal = [-dzdx / norm, -dzdy / norm, 1.0 / norm];
            let lambert =
                (normal[0] * light[0] + normal[1] * light[1] + normal[2] * light[2]).max(0.0);
            let shade = 0.25 + 0.75 * lambert;
            let f = (at(x, y) - lo) / span;
            for c in 0..3 {
                let tint = low[c] + (high[c] - low[c]) * f;
                rgb.push((tint * shade * 255.0).round().clamp(0.0, 255.0) as u8);
            }
        }
    }
    rgb
}
