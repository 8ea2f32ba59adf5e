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
    let data = nhwc
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| PipelineError::InvalidInput(format!("reading the image back: {e:?}")))?;
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

/// Reads an input image (PNG, JPEG, WebP) for img2img, naming the file on failure.
pub fn load_image(path: &Path) -> Result<image::DynamicImage> {
    image::open(path).map_err(|e| {
        PipelineError::InvalidInput(format!(
            "cannot read the input image {}: {e} (PNG, JPEG and WebP are supported)",
            path.display()
        ))
    })
}

/// diffusers' `VaeImageProcessor.preprocess` for one image: RGB, the size rounded down to a
/// multiple of `multiple` (the VAE factor) unless `width`/`height` are given, resized when it
/// differs (Lanczos3 here; PIL's Lanczos gives slightly different pixels, so parity holds for
/// images already at the target size), scaled to `[-1, 1]`, `[1, 3, h, w]`.
pub fn preprocess<B: Backend>(
    image: &image::DynamicImage,
    width: Option<usize>,
    height: Option<usize>,
    multiple: usize,
    device: &B::Device,
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
    let rgb = if (w, h) == (rgb.width() as usize, rgb.height() as usize) {
        rgb
    } else {
        image::imageops::resize(
            &rgb,
            w as u32,
            h as u32,
            image::imageops::FilterType::Lanczos3,
        )
    };
    // diffusers: `np.array(image).astype(np.float32) / 255.0`, then `2 * x - 1`.
    let values: Vec<f32> = rgb
        .as_raw()
        .iter()
        .map(|&v| 2.0 * (f32::from(v) / 255.0) - 1.0)
        .collect();
    let hwc = Tensor::<B, 3>::from_data(burn::tensor::TensorData::new(values, [h, w, 3]), device);
    Ok(hwc.permute([2, 0, 1]).unsqueeze::<4>())
}
