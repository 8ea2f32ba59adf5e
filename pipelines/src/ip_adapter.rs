//! IP-Adapter (image prompts) for Stable Diffusion 1.x/2.x and SDXL, as diffusers'
//! `load_ip_adapter` / `set_ip_adapter_scale` / `ip_adapter_image`: the image goes through
//! [`ClipImageProcessor`] and the CLIP image encoder, its embedding (Plus: the penultimate
//! hidden states) through the adapter's image projection to image tokens, which are appended
//! to each row of the UNet's text context; each cross-attention's image branch reads them
//! ([`oxidiff_models::ip_adapter`]). With guidance, the negative rows get the projection of a
//! zero embedding (Plus: of an all-zero image's states), as diffusers' `encode_image` makes
//! them.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use oxidiff_models::ip_adapter::{load_ip_adapter, unload_ip_adapter};
use oxidiff_models::{
    ClipVisionModelWithProjection, IpImageProjection, ModelError, ToDevice, UNet2DConditionModel,
};
use serde::Deserialize;

use crate::error::{PipelineError, Result};
use crate::resample::{resize_box, Filter};

/// CLIP's mean and std (transformers' `OPENAI_CLIP_MEAN` / `OPENAI_CLIP_STD`).
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// transformers' `CLIPImageProcessor` (its PIL backend): convert to RGB, resize the shortest
/// side to `shortest_edge` (bicubic, as Pillow), centre-crop, rescale by 1/255, normalize.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipImageProcessor {
    pub shortest_edge: usize,
    /// Crop height and width.
    pub crop: (usize, usize),
    pub do_resize: bool,
    pub do_center_crop: bool,
    pub rescale_factor: Option<f64>,
    /// Mean and std per channel, when `do_normalize`.
    pub normalize: Option<([f64; 3], [f64; 3])>,
}

impl ClipImageProcessor {
    /// The processor `load_ip_adapter` makes for a pipeline without a feature extractor:
    /// `CLIPImageProcessor(size=image_size, crop_size=image_size)`.
    pub fn for_image_size(image_size: usize) -> Self {
        Self {
            shortest_edge: image_size,
            crop: (image_size, image_size),
            do_resize: true,
            do_center_crop: true,
            rescale_factor: Some(1.0 / 255.0),
            normalize: Some((CLIP_MEAN, CLIP_STD)),
        }
    }

    /// Reads a `preprocessor_config.json` (a pipeline's `feature_extractor/`).
    pub fn from_file(path: &Path) -> Result<Self> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Size {
            Square(usize),
            Named {
                shortest_edge: Option<usize>,
                height: Option<usize>,
                width: Option<usize>,
            },
        }
        #[derive(Deserialize)]
        struct Raw {
            size: Option<Size>,
            crop_size: Option<Size>,
            do_resize: Option<bool>,
            do_center_crop: Option<bool>,
            do_rescale: Option<bool>,
            rescale_factor: Option<f64>,
            do_normalize: Option<bool>,
            image_mean: Option<[f64; 3]>,
            image_std: Option<[f64; 3]>,
            resample: Option<u32>,
        }
        let bad = |reason: String| {
            PipelineError::Model(ModelError::Config {
                path: path.to_path_buf(),
                reason,
            })
        };
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let raw: Raw = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if raw.resample.is_some_and(|r| r != 3) {
            return Err(bad(
                "`resample` must be 3 (bicubic), the only filter oxidiff's CLIP image \
                 processor implements"
                    .into(),
            ));
        }
        let shortest_edge = match raw.size {
            None => 224,
            Some(Size::Square(n)) => n,
            Some(Size::Named {
                shortest_edge: Some(n),
                ..
            }) => n,
            Some(Size::Named { .. }) => {
                return Err(bad(
                    "`size` must be a number or {\"shortest_edge\": N}".into()
                ))
            }
        };
        let crop = match raw.crop_size {
            None => (224, 224),
            Some(Size::Square(n)) => (n, n),
            Some(Size::Named {
                height: Some(h),
                width: Some(w),
                ..
            }) => (h, w),
            Some(Size::Named { .. }) => {
                return Err(bad(
                    "`crop_size` must be a number or {\"height\": H, \"width\": W}".into(),
                ))
            }
        };
        if shortest_edge == 0 || shortest_edge > 4096 || crop.0 == 0 || crop.1 == 0 {
            return Err(bad("`size` and `crop_size` must be in 1..=4096".into()));
        }
        Ok(Self {
            shortest_edge,
            crop,
            do_resize: raw.do_resize.unwrap_or(true),
            do_center_crop: raw.do_center_crop.unwrap_or(true),
            rescale_factor: match raw.do_rescale.unwrap_or(true) {
                true => Some(raw.rescale_factor.unwrap_or(1.0 / 255.0)),
                false => None,
            },
            normalize: raw.do_normalize.unwrap_or(true).then(|| {
                (
                    raw.image_mean.unwrap_or(CLIP_MEAN),
                    raw.image_std.unwrap_or(CLIP_STD),
                )
            }),
        })
    }

    /// `pixel_values` `[1, 3, crop height, crop width]`.
    pub fn preprocess<B: Backend>(
        &self,
        image: &image::DynamicImage,
        device: &B::Device,
    ) -> Result<Tensor<B, 4>> {
        let (mut w, mut h) = (image.width() as usize, image.height() as usize);
        let mut pixels = rgb_over_white(image);
        if w == 0 || h == 0 {
            return Err(PipelineError::InvalidInput(
                "the IP-Adapter image is empty".into(),
            ));
        }
        if self.do_resize {
            // transformers' `get_resize_output_image_size(default_to_square=False)`.
            let (short, long) = (w.min(h), w.max(h));
            let new_long = (self.shortest_edge as f64 * long as f64 / short as f64) as usize;
            let (nw, nh) = match w <= h {
                true => (self.shortest_edge, new_long),
                false => (new_long, self.shortest_edge),
            };
            let whole = [0.0, 0.0, w as f64, h as f64];
            pixels = resize_box(Filter::Bicubic, &pixels, 3, (w, h), (nw, nh), whole);
            (w, h) = (nw, nh);
        }
        let (ch, cw) = match self.do_center_crop {
            true => self.crop,
            false => (h, w),
        };
        if ch > h || cw > w {
            return Err(PipelineError::InvalidInput(format!(
                "the IP-Adapter image is {w}x{h} after resizing, smaller than the {cw}x{ch} crop"
            )));
        }
        let (top, left) = ((h - ch) / 2, (w - cw) / 2);
        let mut values = vec![0f32; 3 * ch * cw];
        for c in 0..3 {
            for y in 0..ch {
                for x in 0..cw {
                    let mut v = f64::from(pixels[((top + y) * w + left + x) * 3 + c]);
                    if let Some(factor) = self.rescale_factor {
                        // transformers rescales in f64, then stores f32.
                        v = f64::from((v * factor) as f32);
                    }
                    if let Some((mean, std)) = self.normalize {
                        v = (v - f64::from(mean[c] as f32)) / f64::from(std[c] as f32);
                    }
                    values[(c * ch + y) * cw + x] = v as f32;
                }
            }
        }
        Ok(Tensor::from_data(
            TensorData::new(values, [1, 3, ch, cw]),
            device,
        ))
    }
}

/// transformers' `convert_to_rgb`: transparency composited onto white, as PIL's
/// `alpha_composite` over an opaque white background rounds it.
fn rgb_over_white(image: &image::DynamicImage) -> Vec<u8> {
    if !image.color().has_alpha() {
        return image.to_rgb8().into_raw();
    }
    let over_white = |c: u8, a: u8| {
        let (c, a) = (u32::from(c), u32::from(a));
        let tmp = (c * a + 255 * (255 - a)) * 128 + (0x80 << 7);
        ((((tmp >> 8) + tmp) >> 8) >> 7) as u8
    };
    image
        .to_rgba8()
        .pixels()
        .flat_map(|p| {
            let [r, g, b, a] = p.0;
            [over_white(r, a), over_white(g, a), over_white(b, a)]
        })
        .collect()
}

/// An IP-Adapter attached to a pipeline: the image encoder, the image projection and the
/// processor; the image branches live in the pipeline's UNet.
#[derive(Debug)]
pub struct IpAdapter<B: Backend> {
    pub image_encoder: ClipVisionModelWithProjection<B>,
    pub image_proj: IpImageProjection<B>,
    pub processor: ClipImageProcessor,
    /// The weight file, for messages and metadata.
    pub file: PathBuf,
    pub scale: f64,
}

impl<B: Backend> IpAdapter<B> {
    /// Loads `file` into `unet` (at scale 1, as diffusers) with the image encoder folder
    /// `image_encoder`; `feature_extractor` is the pipeline's `preprocessor_config.json` when
    /// it has one, else the processor is CLIP's at the encoder's image size. On error the UNet
    /// is left unchanged.
    pub fn load(
        file: &Path,
        image_encoder: &Path,
        feature_extractor: Option<&Path>,
        unet: &mut UNet2DConditionModel<B>,
        dtype: FloatDType,
    ) -> Result<Self> {
        let device = unet.conv_in.weight.device();
        let encoder = ClipVisionModelWithProjection::from_dir_in(image_encoder, dtype, &device)?;
        let processor = match feature_extractor {
            Some(path) => ClipImageProcessor::from_file(path)?,
            None => ClipImageProcessor::for_image_size(encoder.image_size),
        };
        let image_proj = load_ip_adapter(file, unet, 1.0, dtype)?;
        let (what, gives) = match &image_proj {
            IpImageProjection::Plain(_) => ("image embeddings", "projection_dim"),
            IpImageProjection::Plus(_) => ("hidden states", "hidden_size"),
        };
        let width = match &image_proj {
            IpImageProjection::Plain(_) => encoder.projection_dim(),
            IpImageProjection::Plus(_) => encoder.hidden_size(),
        };
        if image_proj.input_width() != width {
            unload_ip_adapter(unet);
            return Err(ModelError::IpAdapter {
                path: file.to_path_buf(),
                reason: format!(
                    "its image projection takes {}-wide {what}, but the image encoder in {} \
                     gives {width} ({gives}): use the image encoder the adapter was trained with",
                    image_proj.input_width(),
                    image_encoder.display(),
                ),
            }
            .into());
        }
        Ok(Self {
            image_encoder: encoder,
            image_proj,
            processor,
            file: file.to_path_buf(),
            scale: 1.0,
        })
    }

    /// The image tokens for a batch of `batch` images: `[batch, tokens, cross_attention_dim]`,
    /// and with guidance the negative first (`[2 * batch, ..]`), as diffusers' `encode_image`
    /// and `prepare_ip_adapter_image_embeds` make them: the projection of a zero image
    /// embedding (plain), or of the encoder's hidden states for an all-zero image (Plus).
    pub fn image_tokens(
        &self,
        image: &image::DynamicImage,
        batch: usize,
        guidance: bool,
    ) -> Result<Tensor<B, 3>> {
        let device = self.image_encoder.visual_projection.weight.device();
        let pixels = self.processor.preprocess::<B>(image, &device)?;
        let encoder = &self.image_encoder;
        let (tokens, uncond) = match &self.image_proj {
            IpImageProjection::Plain(proj) => {
                let embeds = encoder.forward(pixels)?.image_embeds;
                let uncond = guidance.then(|| proj.forward(embeds.zeros_like()));
                (proj.forward(embeds), uncond)
            }
            IpImageProjection::Plus(proj) => {
                let uncond = match guidance {
                    true => {
                        Some(proj.forward(encoder.penultimate_hidden_state(pixels.zeros_like())?))
                    }
                    false => None,
                };
                (
                    proj.forward(encoder.penultimate_hidden_state(pixels)?),
                    uncond,
                )
            }
        };
        let tokens = Tensor::cat(vec![tokens; batch], 0);
        Ok(match uncond {
            Some(uncond) => Tensor::cat(vec![Tensor::cat(vec![uncond; batch], 0), tokens], 0),
            None => tokens,
        })
    }

    /// The weights it holds besides the UNet's image branches (counted with the UNet):
    /// `image_encoder` and `image_proj`.
    pub fn memory(
        &self,
        place: crate::memory::PlaceName<'_, B::Device>,
    ) -> Vec<crate::memory::ComponentMemory> {
        use crate::memory::component_memory;
        vec![
            component_memory("image_encoder", &self.image_encoder, None, place),
            component_memory("image_proj", &self.image_proj, None, place),
        ]
    }

    /// Moves the encoder and the projection to `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        Self {
            image_encoder: self.image_encoder.to(device),
            image_proj: self.image_proj.to(device),
            ..self
        }
    }
}

/// The image encoder folder for an IP-Adapter weight file when none is given: diffusers'
/// `image_encoder_folder="image_encoder"`, looked for next to the weight file, then in the
/// model folder.
pub fn find_image_encoder(file: &Path, model: &Path) -> Result<PathBuf> {
    let beside = file
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join("image_encoder");
    let in_model = model.join("image_encoder");
    for dir in [&beside, &in_model] {
        if dir.join("config.json").is_file() {
            return Ok(dir.clone());
        }
    }
    Err(PipelineError::InvalidInput(format!(
        "no IP-Adapter image encoder found: looked for {} and {} (a folder with config.json and \
         model.safetensors of a CLIPVisionModelWithProjection); name the folder explicitly",
        beside.display(),
        in_model.display()
    )))
}

/// The UNet context with an IP-Adapter's image tokens appended to each row (`context` as the
/// pipeline made it: negative rows first with guidance). Without an adapter, the context as
/// it is; an image without an adapter, or an adapter without an image, is an error.
pub fn append_image_tokens<B: Backend>(
    adapter: Option<&IpAdapter<B>>,
    image: Option<&image::DynamicImage>,
    context: Tensor<B, 3>,
    guidance: bool,
) -> Result<Tensor<B, 3>> {
    match (adapter, image) {
        (None, None) => Ok(context),
        (None, Some(_)) => Err(PipelineError::InvalidInput(
            "an IP-Adapter image was given, but no IP-Adapter is loaded: load one first \
             (`load_ip_adapter`)"
                .into(),
        )),
        (Some(adapter), None) => Err(PipelineError::InvalidInput(format!(
            "the IP-Adapter {} is loaded, so the request needs an `ip_adapter_image` (or unload \
             the adapter)",
            adapter.file.display()
        ))),
        (Some(adapter), Some(image)) => {
            let rows = context.dims()[0];
            let batch = if guidance { rows / 2 } else { rows };
            let tokens = adapter
                .image_tokens(image, batch, guidance)?
                .to_device(&context.device());
            let dtype = FloatDType::from(context.dtype());
            let tokens = match FloatDType::from(tokens.dtype()) == dtype {
                true => tokens,
                false => tokens.cast(dtype),
            };
            Ok(Tensor::cat(vec![context, tokens], 1))
        }
    }
}

/// The IP-Adapter state of a pipeline: what its `load_ip_adapter`, `set_ip_adapter_scale` and
/// `unload_ip_adapter` share. A compiled denoiser holds the UNet it was traced with, so these
/// are refused once the pipeline is compiled.
pub(crate) fn attach<B: Backend>(
    slot: &mut Option<IpAdapter<B>>,
    unet: &mut UNet2DConditionModel<B>,
    model_dir: &Path,
    file: &Path,
    image_encoder: Option<&Path>,
    compiled: bool,
) -> Result<()> {
    refuse_when_compiled(compiled)?;
    // A single-file checkpoint's folder stands for the model folder.
    let model_dir = match model_dir.is_file() {
        true => model_dir.parent().unwrap_or(Path::new(".")),
        false => model_dir,
    };
    let encoder_dir = match image_encoder {
        Some(dir) => dir.to_path_buf(),
        None => find_image_encoder(file, model_dir)?,
    };
    let processor = model_dir
        .join("feature_extractor")
        .join("preprocessor_config.json");
    let processor = processor.is_file().then_some(processor);
    let dtype = FloatDType::from(unet.conv_in.weight.val().dtype());
    if slot.take().is_some() {
        unload_ip_adapter(unet);
    }
    *slot = Some(IpAdapter::load(
        file,
        &encoder_dir,
        processor.as_deref(),
        unet,
        dtype,
    )?);
    Ok(())
}

pub(crate) fn set_scale<B: Backend>(
    slot: &mut Option<IpAdapter<B>>,
    unet: &mut UNet2DConditionModel<B>,
    scale: f64,
    compiled: bool,
) -> Result<()> {
    refuse_when_compiled(compiled)?;
    if !scale.is_finite() {
        return Err(PipelineError::InvalidInput(format!(
            "the IP-Adapter scale must be a finite number, got {scale}"
        )));
    }
    let Some(adapter) = slot else {
        return Err(PipelineError::InvalidInput(
            "no IP-Adapter is loaded: load one before setting its scale".into(),
        ));
    };
    adapter.scale = scale;
    oxidiff_models::ip_adapter::set_ip_adapter_scale(unet, scale);
    Ok(())
}

pub(crate) fn detach<B: Backend>(
    slot: &mut Option<IpAdapter<B>>,
    unet: &mut UNet2DConditionModel<B>,
    compiled: bool,
) -> Result<()> {
    refuse_when_compiled(compiled)?;
    *slot = None;
    unload_ip_adapter(unet);
    Ok(())
}

fn refuse_when_compiled(compiled: bool) -> Result<()> {
    match compiled {
        true => Err(PipelineError::Compile(
            "load, rescale or unload the IP-Adapter before compile(): the compiled denoiser \
             holds the UNet it was traced with"
                .into(),
        )),
        false => Ok(()),
    }
}

/// Pipelines without IP-Adapter (SD3, Flux, PixArt) refuse a request with an image prompt
/// rather than ignore it.
pub(crate) fn refuse_image_prompt<B: Backend>(
    req: &crate::denoise::GenerateRequest<B>,
    family: &str,
) -> Result<()> {
    match req.ip_adapter_image.is_some() {
        true => Err(PipelineError::InvalidInput(format!(
            "IP-Adapter applies to Stable Diffusion 1.x/2.x and SDXL; {family} pipelines take \
             no `ip_adapter_image`"
        ))),
        false => Ok(()),
    }
}

/// Tensor and data parallelism are not tested with an IP-Adapter's image branches: refused.
pub(crate) fn refuse_parallel<B: Backend>(adapter: Option<&IpAdapter<B>>) -> Result<()> {
    match adapter {
        Some(adapter) => Err(PipelineError::Compile(format!(
            "the IP-Adapter {} does not split over devices yet: compile on one device \
             (`compile()`), or unload the adapter",
            adapter.file.display()
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transparency_is_composited_onto_white_as_pil_rounds_it() {
        // (value, alpha) and what PIL's `alpha_composite` over opaque white gives.
        let cases = [
            (200, 100, 233),
            (0, 0, 255),
            (255, 255, 255),
            (17, 1, 254),
            (100, 254, 101),
            (0, 128, 127),
            (255, 37, 255),
        ];
        for (value, alpha, expected) in cases {
            let image = image::DynamicImage::ImageRgba8(image::RgbaImage::from_pixel(
                1,
                1,
                image::Rgba([value, value, value, alpha]),
            ));
            assert_eq!(
                rgb_over_white(&image),
                vec![expected; 3],
                "{value}, {alpha}"
            );
        }
    }
}
