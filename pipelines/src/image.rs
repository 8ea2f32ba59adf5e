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
