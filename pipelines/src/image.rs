//! Decoded images: diffusers' image post-processing, and PNG files written atomically.

use std::io::Write;
use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::{PipelineError, Result};
use crate::metadata::{encode_png, GenerationParameters, PARAMETERS_KEYWORD};

/// A batch of RGB images as float values in `[0, 1]`, laid out `[n, h, w, 3]` like diffusers'
/// `output_type="np"`.
#[derive(Debug, Clone, PartialEq)]
pub struct Images {
    pub count: usize,
    pub height: usize,
    pub width: usize,
    pub data: Vec<f32>,
}

/// `(x / 2 + 0.5).clamp(0, 1)` and NCHW to NHWC, as diffusers' `VaeImageProcessor.postprocess`.
pub fn postprocess<B: Backend>(decoded: Tensor<B, 4>) -> Result<Images> {
    let [count, channels, height, width] = decoded.dims();
    if channels != 3 {
        return Err(PipelineError::InvalidInput(format!(
            "the VAE produced {channels} channels; images need 3"
        )));
    }
    let nhwc = decoded
        .div_scalar(2.0)
        .add_scalar(0.5)
        .clamp(0.0, 1.0)
        .permute([0, 2, 3, 1]);
    let data = crate::host::read_f32(nhwc)?;
    Ok(Images {
        count,
        height,
        width,
        data,
    })
}

impl Images {
    /// Image `i` as 8-bit RGB, rounding as diffusers' `numpy_to_pil` (`(x * 255).round()`).
    pub fn to_rgb8(&self, i: usize) -> Option<image::RgbImage> {
        if i >= self.count {
            return None;
        }
        let size = self.height * self.width * 3;
        let bytes: Vec<u8> = self.data[i * size..(i + 1) * size]
            .iter()
            .map(|v| (v * 255.0).round().clamp(0.0, 255.0) as u8)
            .collect();
        image::RgbImage::from_raw(self.width as u32, self.height as u32, bytes)
    }

    /// Writes image `i` as PNG; the file appears only once complete (temporary file, then
    /// rename), so an interrupted run never leaves a broken or half-overwritten image.
    pub fn save_png(&self, i: usize, path: &Path) -> Result<()> {
        self.save_png_with_parameters(i, path, None)
    }

    /// [`save_png`](Self::save_png) with the generation parameters in the PNG's `parameters`
    /// text chunk, where A1111-compatible tools (and `txt2img --from-png`) read them.
    pub fn save_png_with_parameters(
        &self,
        i: usize,
        path: &Path,
        parameters: Option<&GenerationParameters>,
    ) -> Result<()> {
        let rgb = self
            .to_rgb8(i)
            .ok_or_else(|| PipelineError::InvalidInput(format!("no image {i}")))?;
        let text: Vec<(&str, String)> = parameters
            .map(|p| vec![(PARAMETERS_KEYWORD, p.to_text())])
            .unwrap_or_default();
        let encoded = encode_png(&rgb, &text)?;
        write_atomic(path, &encoded)
    }

    /// Image `i` encoded as PNG bytes (no metadata).
    pub fn to_png(&self, i: usize) -> Result<Vec<u8>> {
        let rgb = self
            .to_rgb8(i)
            .ok_or_else(|| PipelineError::InvalidInput(format!("no image {i}")))?;
        encode_png(&rgb, &[])
    }

    /// The images of several batches as one batch, in order; all must have the same size.
    pub fn concat(batches: &[Images]) -> Result<Images> {
        let first = batches
            .first()
            .ok_or_else(|| PipelineError::InvalidInput("no images to concatenate".into()))?;
        let mut out = Images {
            count: 0,
            height: first.height,
            width: first.width,
            data: Vec::new(),
        };
        for (i, batch) in batches.iter().enumerate() {
            if (batch.height, batch.width) != (first.height, first.width) {
                return Err(PipelineError::InvalidInput(format!(
                    "batch {i} is {}x{}, batch 0 is {}x{}: concatenated images need one size",
                    batch.width, batch.height, first.width, first.height
                )));
            }
            out.count += batch.count;
            out.data.extend_from_slice(&batch.data);
        }
        Ok(out)
    }

    /// All images tiled row by row into one image, `columns` wide (at least 1); cells left
    /// over in the last row are black.
    pub fn grid(&self, columns: usize) -> Images {
        let columns = columns.clamp(1, self.count.max(1));
        let rows = self.count.div_ceil(columns);
        let (h, w) = (self.height, self.width);
        let grid_width = columns * w;
        let mut data = vec![0.0; rows * h * grid_width * 3];
        let size = h * w * 3;
        for i in 0..self.count {
            let (row, col) = (i / columns, i % columns);
            let image = &self.data[i * size..(i + 1) * size];
            for y in 0..h {
                let from = y * w * 3;
                let to = ((row * h + y) * grid_width + col * w) * 3;
                data[to..to + w * 3].copy_from_slice(&image[from..from + w * 3]);
            }
        }
        Images {
            count: 1,
            height: rows * h,
            width: grid_width,
            data,
        }
    }

    /// Shows the images inline in a Jupyter notebook run by the evcxr kernel: evcxr calls this
    /// method on a cell's final value and reads each `EVCXR_BEGIN_CONTENT image/png` block it
    /// prints (base64 PNG) as an image. Elsewhere it just prints those blocks to stdout.
    pub fn evcxr_display(&self) {
        for i in 0..self.count {
            match self.to_png(i) {
                Ok(png) => println!(
                    "EVCXR_BEGIN_CONTENT image/png\n{}\nEVCXR_END_CONTENT",
                    base64(&png)
                ),
                Err(e) => println!("image {i}: {e}"),
            }
        }
    }
}

/// Standard base64 (RFC 4648, with `=` padding), as evcxr's image content expects.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * k)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let err = |source| PipelineError::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(err)
}

/// diffusers' `resize_and_crop_tensor`: scales `[n, c, h, w]` images so they cover
/// `width x height` (bilinear, `align_corners=False`, no antialiasing, as
/// `F.interpolate`), then crops the centre. Runs on the host; PixArt's resolution binning uses
/// it to return the requested size.
pub fn resize_and_crop<B: Backend>(
    images: Tensor<B, 4>,
    width: usize,
    height: usize,
) -> Result<Tensor<B, 4>> {
    let [n, c, in_h, in_w] = images.dims();
    if (in_h, in_w) == (height, width) {
        return Ok(images);
    }
    let device = images.device();
    let data = crate::host::read_f32(images)?;
    let ratio = (height as f64 / in_h as f64).max(width as f64 / in_w as f64);
    let (out_w, out_h) = (
        (in_w as f64 * ratio) as usize,
        (in_h as f64 * ratio) as usize,
    );
    // PyTorch's source index for `size=`: (dst + 0.5) * in / out - 0.5, clamped at 0, in f32.
    let taps = |out: usize, inp: usize| -> Vec<(usize, usize, f32)> {
        let scale = inp as f32 / out as f32;
        (0..out)
            .map(|d| {
                let src = ((d as f32 + 0.5) * scale - 0.5).max(0.0);
                let i0 = (src as usize).min(inp - 1);
                let i1 = (i0 + 1).min(inp - 1);
                (i0, i1, src - i0 as f32)
            })
            .collect()
    };
    let (rows, cols) = (taps(out_h, in_h), taps(out_w, in_w));
    let (top, left) = ((out_h - height) / 2, (out_w - width) / 2);
    let mut out = Vec::with_capacity(n * c * height * width);
    for plane in data.chunks_exact(in_h * in_w) {
        for &(y0, y1, ly) in &rows[top..top + height] {
            for &(x0, x1, lx) in &cols[left..left + width] {
                let at = |y: usize, x: usize| plane[y * in_w + x];
                let upper = (1.0 - lx) * at(y0, x0) + lx * at(y0, x1);
                let lower = (1.0 - lx) * at(y1, x0) + lx * at(y1, x1);
                out.push((1.0 - ly) * upper + ly * lower);
            }
        }
    }
    Ok(Tensor::from_data(
        burn::tensor::TensorData::new(out, [n, c, height, width]),
        &device,
    ))
}

/// Reads an input image (PNG, JPEG, WebP) for img2img, naming the file on failure.
pub fn load_image(path: &Path) -> Result<image::DynamicImage> {
    load_image_as(path, "input image")
}

/// Reads an inpainting mask (PNG, JPEG, WebP; white repaints, black keeps), naming the file
/// on failure.
pub fn load_mask(path: &Path) -> Result<image::DynamicImage> {
    load_image_as(path, "mask")
}

/// Reads an image (PNG, JPEG, WebP), naming it as `what` and the file on failure.
pub fn load_image_as(path: &Path, what: &str) -> Result<image::DynamicImage> {
    image::open(path).map_err(|e| {
        PipelineError::InvalidInput(format!(
            "cannot read the {what} {}: {e} (PNG, JPEG and WebP are supported)",
            path.display()
        ))
    })
}

/// diffusers' `VaeImageProcessor.preprocess` for one image: RGB, the size rounded down to a
/// multiple of `multiple` (the VAE factor) unless `width`/`height` are given, resized when it
/// differs (PIL's Lanczos, pixel for pixel: [`crate::resample`]; images with transparency are
/// flattened first, where PIL resizes them premultiplied), scaled to `[-1, 1]`, `[1, 3, h, w]`.
pub fn preprocess<B: Backend>(
    image: &image::DynamicImage,
    width: Option<usize>,
    height: Option<usize>,
    multiple: usize,
    device: &B::Device,
) -> Result<Tensor<B, 4>> {
    // diffusers: `np.array(image).astype(np.float32) / 255.0`, then `2 * x - 1`.
    pixels(image, (width, height), multiple, device, |v| {
        2.0 * (f32::from(v) / 255.0) - 1.0
    })
}

/// A ControlNet's conditioning image as diffusers' `control_image_processor` makes it: RGB,
/// resized as [`preprocess`] does, values in `[0, 1]` (no normalisation), `[1, 3, h, w]`.
pub fn preprocess_control<B: Backend>(
    image: &image::DynamicImage,
    width: Option<usize>,
    height: Option<usize>,
    multiple: usize,
    device: &B::Device,
) -> Result<Tensor<B, 4>> {
    pixels(image, (width, height), multiple, device, |v| {
        f32::from(v) / 255.0
    })
}

/// `image` as RGB at the given size (else its own), rounded down to `multiple`, each byte
/// mapped by `value`, `[1, 3, h, w]`.
fn pixels<B: Backend>(
    image: &image::DynamicImage,
    (width, height): (Option<usize>, Option<usize>),
    multiple: usize,
    device: &B::Device,
    value: impl Fn(u8) -> f32,
) -> Result<Tensor<B, 4>> {
    let rgb = image.to_rgb8();
    let round = |v: usize| v - v % multiple.max(1);
    let w = round(width.unwrap_or(rgb.width() as usize));
    let h = round(height.unwrap_or(rgb.height() as usize));
    if w == 0 || h == 0 {
        return Err(PipelineError::InvalidInput(format!(
            "the input image is {}x{}; it must be at least {multiple}x{multiple}",
            rgb.width(),
            rgb.height()
        )));
    }
    let rgb = resized(rgb, w, h);
    let values: Vec<f32> = rgb.as_raw().iter().map(|&v| value(v)).collect();
    let hwc = Tensor::<B, 3>::from_data(burn::tensor::TensorData::new(values, [h, w, 3]), device);
    Ok(hwc.permute([2, 0, 1]).unsqueeze::<4>())
}

/// `image` resized to `width x height` as PIL's Lanczos resize (unchanged when it has that size).
fn resized<P: image::Pixel<Subpixel = u8>>(
    image: image::ImageBuffer<P, Vec<u8>>,
    width: usize,
    height: usize,
) -> image::ImageBuffer<P, Vec<u8>> {
    let size = (image.width() as usize, image.height() as usize);
    if size == (width, height) {
        return image;
    }
    let channels = usize::from(P::CHANNEL_COUNT);
    let pixels = crate::resample::resize_lanczos(image.as_raw(), channels, size, (width, height));
    image::ImageBuffer::from_raw(width as u32, height as u32, pixels)
        .expect("the resampled buffer has the new size")
}

/// diffusers' mask `VaeImageProcessor` (`do_binarize`, `do_convert_grayscale`, no
/// normalization) for one mask image: resized to `width x height` when it differs (PIL's
/// Lanczos, before the grayscale conversion, in diffusers' order), converted to grayscale with PIL's
/// integer luma (`L = (19595 R + 38470 G + 7471 B + 2^15) >> 16`, alpha ignored), scaled to
/// `[0, 1]` and binarized at 0.5 (1: repaint, 0: keep); `[1, 1, height, width]`.
pub fn preprocess_mask<B: Backend>(
    mask: &image::DynamicImage,
    width: usize,
    height: usize,
    device: &B::Device,
) -> Result<Tensor<B, 4>> {
    // A grayscale mask is resized as it is (PIL resizes an "L" image in "L").
    let luma: Vec<u32> = if let image::DynamicImage::ImageLuma8(gray) = mask {
        resized(gray.clone(), width, height)
            .pixels()
            .map(|p| u32::from(p.0[0]))
            .collect()
    } else {
        resized(mask.to_rgb8(), width, height)
            .pixels()
            .map(|p| {
                let [r, g, b] = p.0.map(u32::from);
                (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16
            })
            .collect()
    };
    let values: Vec<f32> = luma
        .into_iter()
        .map(|l| if (l as f32) / 255.0 < 0.5 { 0.0 } else { 1.0 })
        .collect();
    Ok(Tensor::from_data(
        burn::tensor::TensorData::new(values, [1, 1, height, width]),
        device,
    ))
}

/// `F.interpolate(x, size=(height, width))` in its default `nearest` mode (source index
/// `floor(dst * in / out)`), on the host: the inpainting mask brought to the latent size.
pub fn resize_nearest<B: Backend>(
    images: Tensor<B, 4>,
    width: usize,
    height: usize,
) -> Result<Tensor<B, 4>> {
    let [n, c, in_h, in_w] = images.dims();
    if (in_h, in_w) == (height, width) {
        return Ok(images);
    }
    let device = images.device();
    let data = crate::host::read_f32(images)?;
    let index = |d: usize, inp: usize, out: usize| {
        (((d as f32) * (inp as f32 / out as f32)).floor() as usize).min(inp - 1)
    };
    let mut out = Vec::with_capacity(n * c * height * width);
    for plane in data.chunks_exact(in_h * in_w) {
        for y in 0..height {
            let row = index(y, in_h, height) * in_w;
            for x in 0..width {
                out.push(plane[row + index(x, in_w, width)]);
            }
        }
    }
    Ok(Tensor::from_data(
        burn::tensor::TensorData::new(out, [n, c, height, width]),
        &device,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_test_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (input, expected) in cases {
            assert_eq!(base64(input.as_bytes()), expected, "{input:?}");
        }
        assert_eq!(base64(&[0xfb, 0xff, 0xfe]), "+//+");
    }

    fn solid(count: usize, value: f32) -> Images {
        Images {
            count,
            height: 2,
            width: 3,
            data: vec![value; count * 2 * 3 * 3],
        }
    }

    #[test]
    fn grid_tiles_images_row_by_row_and_pads_with_black() {
        let batch = Images::concat(&[solid(1, 0.25), solid(2, 0.5)]).unwrap();
        let grid = batch.grid(2);
        assert_eq!((grid.count, grid.height, grid.width), (1, 4, 6));
        let pixel = |x: usize, y: usize| grid.data[(y * 6 + x) * 3];
        assert_eq!(pixel(0, 0), 0.25);
        assert_eq!(pixel(3, 1), 0.5);
        assert_eq!(pixel(0, 2), 0.5);
        assert_eq!(pixel(5, 3), 0.0, "the empty cell is black");
    }

    #[test]
    fn concat_refuses_mixed_sizes() {
        let mut other = solid(1, 0.0);
        other.width = 2;
        other.data.truncate(2 * 2 * 3);
        let err = Images::concat(&[solid(1, 0.0), other]).unwrap_err();
        assert!(err.to_string().contains("one size"), "{err}");
        assert!(Images::concat(&[]).is_err());
    }
}
