//! `AutoPipelineForImage2Image` and `AutoPipelineForInpainting`: image editing with whichever
//! family a folder or single file holds, as diffusers' classes of the same names: any
//! `_class_name` of a family (text to image, image to image or inpainting) loads that family's
//! editing pipeline over the same components.
//!
//! Where this sits: beside [`crate::auto`], above the editing pipelines; nothing imports it.

use std::path::Path;

use burn::tensor::backend::Backend;
use image::DynamicImage;
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::{AutoencoderKL, ControlNetModel};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{NoiseSource, Scheduler};

use crate::auto::PipelineFamily;
use crate::compiled::{CompileStats, ComponentStats};
use crate::control::ControlRequest;
use crate::denoise::{GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::inpaint::InpaintOptions;
use crate::loading::{pipeline_class, LoadOptions};
use crate::lora::LoraReport;
use crate::single_file::{single_file_pipeline_class, SingleFileOptions};
use crate::stable_diffusion_controlnet::StableDiffusionControlNetPipeline;
use crate::stable_diffusion_controlnet_img2img::StableDiffusionControlNetImg2ImgPipeline;
use crate::stable_diffusion_controlnet_inpaint::StableDiffusionControlNetInpaintPipeline;
use crate::stable_diffusion_img2img::StableDiffusionImg2ImgPipeline;
use crate::stable_diffusion_inpaint::StableDiffusionInpaintPipeline;
use crate::stable_diffusion_xl::XlRequest;
use crate::stable_diffusion_xl_controlnet::StableDiffusionXLControlNetPipeline;
use crate::stable_diffusion_xl_controlnet_img2img::StableDiffusionXLControlNetImg2ImgPipeline;
use crate::stable_diffusion_xl_controlnet_inpaint::StableDiffusionXLControlNetInpaintPipeline;
use crate::stable_diffusion_xl_img2img::{
    StableDiffusionXLImg2ImgPipeline, XlEditOptions, XlInitImage,
};
use crate::stable_diffusion_xl_inpaint::StableDiffusionXLInpaintPipeline;

/// What an edit takes besides the request and the images; `Default` leaves each field at the
/// running pipeline's diffusers default. A field the running pipeline does not take, set away
/// from its default, is an error naming it.
#[derive(Debug, Clone, PartialEq)]
pub struct EditOptions {
    /// In (0, 1]: the part of the schedule that is run; `None`: the pipeline's default
    /// ([`PipelineDefaults::strength`]).
    pub strength: Option<f64>,
    /// SDXL refiners (`requires_aesthetics_score`): the aesthetic score of the positive and
    /// of the negative time ids.
    pub aesthetic_score: f64,
    pub negative_aesthetic_score: f64,
    /// Inpainting only: diffusers' `padding_mask_crop` (see [`InpaintOptions`]).
    pub padding_mask_crop: Option<usize>,
    /// The controls of a pipeline with ControlNets (`with_controlnets`), one per ControlNet;
    /// required by it, refused by the others.
    pub control: Option<ControlRequest>,
}

impl Default for EditOptions {
    fn default() -> Self {
        let xl = XlEditOptions::default();
        Self {
            strength: None,
            aesthetic_score: xl.aesthetic_score,
            negative_aesthetic_score: xl.negative_aesthetic_score,
            padding_mask_crop: None,
            control: None,
        }
    }
}

impl EditOptions {
    /// The strength that runs: the one given, else the pipeline's default.
    pub fn strength_or(&self, defaults: PipelineDefaults) -> f64 {
        self.strength.or(defaults.strength).unwrap_or(1.0)
    }

    /// Refuses the SDXL-only fields for an SD 1.x/2.x pipeline.
    fn refuse_xl_fields(&self) -> Result<()> {
        let xl = XlEditOptions::default();
        if (self.aesthetic_score, self.negative_aesthetic_score)
            != (xl.aesthetic_score, xl.negative_aesthetic_score)
        {
            return Err(PipelineError::InvalidInput(
                "aesthetic scores apply to SDXL refiners, not to Stable Diffusion 1.x/2.x \
                 pipelines; leave them at their defaults (6 and 2.5)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The controls a ControlNet pipeline needs (`controlled`), or an error; refused when the
    /// pipeline has no ControlNets.
    fn control_for(&self, controlled: bool) -> Result<Option<&ControlRequest>> {
        match (&self.control, controlled) {
            (Some(control), true) => Ok(Some(control)),
            (None, false) => Ok(None),
            (None, true) => Err(PipelineError::InvalidInput(
                "this pipeline has ControlNets: give their control images (EditOptions::control)"
                    .into(),
            )),
            (Some(_), false) => Err(PipelineError::InvalidInput(
                "control images need ControlNets: load them with `with_controlnets`".into(),
            )),
        }
    }

    /// The SDXL pipelines' options, at `strength`.
    fn xl(&self, strength: f64) -> XlEditOptions {
        XlEditOptions {
            strength,
            aesthetic_score: self.aesthetic_score,
            negative_aesthetic_score: self.negative_aesthetic_score,
            padding_mask_crop: self.padding_mask_crop,
            ..XlEditOptions::default()
        }
    }
}

/// The family of `class` (read from `source`) if it edits images, else an error naming the
/// class and the ones that do.
fn editing_family(class: &str, source: &Path, task: &'static str) -> Result<PipelineFamily> {
    match PipelineFamily::from_class(class) {
        Some(family @ (PipelineFamily::StableDiffusion | PipelineFamily::StableDiffusionXL)) => {
            Ok(family)
        }
        _ => Err(PipelineError::CannotEdit {
            path: source.to_path_buf(),
            class: class.to_string(),
            task,
            supported: [
                PipelineFamily::StableDiffusion,
                PipelineFamily::StableDiffusionXL,
            ]
            .iter()
            .flat_map(|f| f.classes())
            .copied()
            .collect::<Vec<_>>()
            .join(", "),
        }),
    }
}

/// An editing auto pipeline: the enum over the SD and SDXL pipeline `$sd` / `$xl`, with what
/// every editing pipeline does (loading by class, defaults, LoRA, compiled mode). `$task`
/// names the task in errors.
macro_rules! editing_pipeline {
    ($(#[$doc:meta])* $name:ident, $sd:ident, $cn:ident, $xl:ident, $xcn:ident, $task:literal) => {
        $(#[$doc])*
        pub enum $name<B: Backend> {
            StableDiffusion(Box<$sd<B>>),
            /// SD 1.x/2.x with ControlNets (`with_controlnets`).
            StableDiffusionControlNet(Box<$cn<B>>),
            StableDiffusionXL(Box<$xl<B>>),
            /// SDXL with ControlNets (`with_controlnets`).
            StableDiffusionXLControlNet(Box<$xcn<B>>),
        }

        impl<B: Backend> $name<B> {
            /// Loads a diffusers-format folder, or a Hub id from the local cache.
            pub fn from_pretrained(
                spec: &str,
                options: &LoadOptions,
                device: &B::Device,
            ) -> Result<Self> {
                let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
                Self::from_dir(&dir, options, device)
            }

            /// Loads a diffusers-format folder with the editing pipeline of the family its
            /// `model_index.json` names; a class of another family is an error naming it and
            /// the supported ones.
            pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
                let class = pipeline_class(dir)?;
                let family = editing_family(&class, &dir.join("model_index.json"), $task)?;
                Ok(match family {
                    PipelineFamily::StableDiffusionXL => {
                        Self::StableDiffusionXL(Box::new($xl::from_dir(dir, options, device)?))
                    }
                    _ => Self::StableDiffusion(Box::new($sd::from_dir(dir, options, device)?)),
                })
            }

            /// Loads a single-file checkpoint (SD 1.x/2.x or SDXL, as its weights say).
            pub fn from_single_file(
                path: &Path,
                options: &SingleFileOptions,
                device: &B::Device,
            ) -> Result<Self> {
                let class = single_file_pipeline_class(path)?;
                Ok(match editing_family(class, path, $task)? {
                    PipelineFamily::StableDiffusionXL => Self::StableDiffusionXL(Box::new(
                        $xl::from_single_file(path, options, device)?,
                    )),
                    _ => Self::StableDiffusion(Box::new($sd::from_single_file(
                        path, options, device,
                    )?)),
                })
            }

            /// The same pipeline steered by `controlnets` (SD 1.x/2.x and SDXL), each checked
            /// against the UNet.
            pub fn with_controlnets(self, controlnets: Vec<ControlNetModel<B>>) -> Result<Self> {
                match self {
                    Self::StableDiffusion(pipe) => Ok(Self::StableDiffusionControlNet(Box::new(
                        $cn::from(StableDiffusionControlNetPipeline::new(pipe.pipe, controlnets)?),
                    ))),
                    Self::StableDiffusionControlNet(pipe) => Self::StableDiffusion(Box::new(
                        $sd::from(pipe.pipe.into_inner()),
                    ))
                    .with_controlnets(controlnets),
                    Self::StableDiffusionXL(pipe) => Ok(Self::StableDiffusionXLControlNet(Box::new(
                        $xcn::from(StableDiffusionXLControlNetPipeline::new(pipe.pipe, controlnets)?),
                    ))),
                    Self::StableDiffusionXLControlNet(pipe) => Self::StableDiffusionXL(Box::new(
                        $xl::from(pipe.pipe.into_inner()),
                    ))
                    .with_controlnets(controlnets),
                }
            }

            /// Which family runs.
            pub fn family(&self) -> PipelineFamily {
                match self {
                    Self::StableDiffusion(_) | Self::StableDiffusionControlNet(_) => {
                        PipelineFamily::StableDiffusion
                    }
                    Self::StableDiffusionXL(_) | Self::StableDiffusionXLControlNet(_) => {
                        PipelineFamily::StableDiffusionXL
                    }
                }
            }

            /// diffusers' class name of the pipeline that runs.
            pub fn pipeline_class(&self) -> &'static str {
                match self {
                    Self::StableDiffusion(_) => stringify!($sd),
                    Self::StableDiffusionControlNet(_) => stringify!($cn),
                    Self::StableDiffusionXL(_) => stringify!($xl),
                    Self::StableDiffusionXLControlNet(_) => stringify!($xcn),
                }
            }

            /// diffusers' `__call__` defaults of the pipeline that runs, its strength too.
            pub fn defaults(&self) -> PipelineDefaults {
                match self {
                    Self::StableDiffusion(pipe) => pipe.defaults(),
                    Self::StableDiffusionControlNet(pipe) => pipe.defaults(),
                    Self::StableDiffusionXL(pipe) => pipe.defaults(),
                    Self::StableDiffusionXLControlNet(pipe) => pipe.defaults(),
                }
            }

            /// A request with the pipeline's steps and guidance; the strength is
            /// [`EditOptions::default`]'s (the pipeline's).
            pub fn default_request(&self) -> GenerateRequest<B> {
                self.defaults().request()
            }

            /// The scheduler the loop runs.
            pub fn scheduler(&self) -> &dyn Scheduler<B> {
                match self {
                    Self::StableDiffusion(pipe) => &*pipe.pipe.scheduler,
                    Self::StableDiffusionControlNet(pipe) => &*pipe.pipe.scheduler,
                    Self::StableDiffusionXL(pipe) => &*pipe.pipe.scheduler,
                    Self::StableDiffusionXLControlNet(pipe) => &*pipe.pipe.scheduler,
                }
            }

            /// The VAE, for its tiling and slicing ([`AutoencoderKL::enable_tiling`]).
            pub fn vae_mut(&mut self) -> &mut AutoencoderKL<B> {
                match self {
                    Self::StableDiffusion(pipe) => &mut pipe.pipe.vae,
                    Self::StableDiffusionControlNet(pipe) => &mut pipe.pipe.vae,
                    Self::StableDiffusionXL(pipe) => &mut pipe.pipe.vae,
                    Self::StableDiffusionXLControlNet(pipe) => &mut pipe.pipe.vae,
                }
            }

            /// Pixels per latent cell.
            pub fn vae_scale_factor(&self) -> usize {
                match self {
                    Self::StableDiffusion(pipe) => pipe.pipe.vae_scale_factor,
                    Self::StableDiffusionControlNet(pipe) => pipe.pipe.vae_scale_factor,
                    Self::StableDiffusionXL(pipe) => pipe.pipe.vae_scale_factor,
                    Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.vae_scale_factor,
                }
            }

            /// Fuses a LoRA into the UNet and the text encoders it targets, at `scale`.
            pub fn load_lora(&mut self, path: impl AsRef<Path>, scale: f32) -> Result<LoraReport> {
                match self {
                    Self::StableDiffusion(pipe) => pipe.pipe.load_lora(path, scale),
                    Self::StableDiffusionControlNet(pipe) => pipe.pipe.load_lora(path, scale),
                    Self::StableDiffusionXL(pipe) => pipe.pipe.load_lora(path, scale),
                    Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.load_lora(path, scale),
                }
            }

            /// Attaches an IP-Adapter at `scale` (the pipeline's `load_ip_adapter` and
            /// `set_ip_adapter_scale`); requests then need an `ip_adapter_image`. Refused with
            /// ControlNets. Before compiling.
            pub fn load_ip_adapter(
                &mut self,
                file: &Path,
                image_encoder: Option<&Path>,
                scale: f64,
            ) -> Result<()> {
                match self {
                    Self::StableDiffusion(pipe) => {
                        pipe.pipe.load_ip_adapter(file, image_encoder)?;
                        pipe.pipe.set_ip_adapter_scale(scale)
                    }
                    Self::StableDiffusionControlNet(pipe) => {
                        pipe.pipe.pipe.load_ip_adapter(file, image_encoder)?;
                        pipe.pipe.pipe.set_ip_adapter_scale(scale)
                    }
                    Self::StableDiffusionXL(pipe) => {
                        pipe.pipe.load_ip_adapter(file, image_encoder)?;
                        pipe.pipe.set_ip_adapter_scale(scale)
                    }
                    Self::StableDiffusionXLControlNet(pipe) => {
                        pipe.pipe.pipe.load_ip_adapter(file, image_encoder)?;
                        pipe.pipe.pipe.set_ip_adapter_scale(scale)
                    }
                }
            }
        }

        impl $name<Oxi> {
            /// Compiled mode for the UNet call with guidance (the pipeline's `compile`).
            pub fn compile(&mut self) -> Result<()> {
                match self {
                    Self::StableDiffusion(pipe) => pipe.pipe.compile(),
                    Self::StableDiffusionControlNet(pipe) => pipe.pipe.compile(),
                    Self::StableDiffusionXL(pipe) => pipe.pipe.compile(),
                    Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.compile(),
                }
            }

            /// The compiled step spread over several devices (the pipeline's
            /// `enable_parallelism`).
            pub fn enable_parallelism(&mut self, config: impl Into<ParallelConfig>) -> Result<()> {
                match self {
                    Self::StableDiffusion(pipe) => pipe.pipe.enable_parallelism(config),
                    Self::StableDiffusionControlNet(pipe) => pipe.pipe.enable_parallelism(config),
                    Self::StableDiffusionXL(pipe) => pipe.pipe.enable_parallelism(config),
                    Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.enable_parallelism(config),
                }
            }

            /// Compiled mode's counts (`None` when eager).
            pub fn compile_stats(&self) -> Option<CompileStats> {
                match self {
                    Self::StableDiffusion(pipe) => pipe.pipe.compile_stats(),
                    Self::StableDiffusionControlNet(pipe) => pipe.pipe.compile_stats(),
                    Self::StableDiffusionXL(pipe) => pipe.pipe.compile_stats(),
                    Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.compile_stats(),
                }
            }

            /// Compiled mode's counts per component (the pipeline's `component_stats`).
            pub fn component_stats(&self) -> Vec<ComponentStats> {
                match self {
                    Self::StableDiffusion(pipe) => pipe.pipe.component_stats(),
                    Self::StableDiffusionControlNet(pipe) => pipe.pipe.component_stats(),
                    Self::StableDiffusionXL(pipe) => pipe.pipe.component_stats(),
                    Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.component_stats(),
                }
            }
        }
    };
}

editing_pipeline!(
    /// Image to image with the family a folder or file holds (diffusers'
    /// `AutoPipelineForImage2Image`): [`StableDiffusionImg2ImgPipeline`] or
    /// [`StableDiffusionXLImg2ImgPipeline`] (the refiner too).
    AutoPipelineForImage2Image,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLControlNetImg2ImgPipeline,
    "image to image"
);

editing_pipeline!(
    /// Inpainting with the family a folder or file holds (diffusers'
    /// `AutoPipelineForInpainting`): [`StableDiffusionInpaintPipeline`] or
    /// [`StableDiffusionXLInpaintPipeline`], with a 9-channel inpainting UNet or an ordinary
    /// one (the masked-latent method).
    AutoPipelineForInpainting,
    StableDiffusionInpaintPipeline,
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLControlNetInpaintPipeline,
    "inpainting"
);

impl<B: Backend> AutoPipelineForImage2Image<B> {
    /// Edits `image` from the prompt, as the running pipeline's `generate_with` (noise drawn
    /// from `noise` in diffusers' order, `callback` after every step).
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        options: &EditOptions,
        image: &DynamicImage,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let strength = options.strength_or(self.defaults());
        let controlled = matches!(
            self,
            Self::StableDiffusionControlNet(_) | Self::StableDiffusionXLControlNet(_)
        );
        let control = options.control_for(controlled)?;
        match self {
            Self::StableDiffusionControlNet(pipe) => {
                options.refuse_xl_fields()?;
                if options.padding_mask_crop.is_some() {
                    return Err(PipelineError::InvalidInput(
                        "padding_mask_crop applies to inpainting, not to image to image".into(),
                    ));
                }
                let control = control.cloned().unwrap_or_default();
                pipe.generate_with(req, image, strength, &control, noise, callback)
            }
            Self::StableDiffusion(pipe) => {
                options.refuse_xl_fields()?;
                if options.padding_mask_crop.is_some() {
                    return Err(PipelineError::InvalidInput(
                        "padding_mask_crop crops to a mask's region: it applies to \
                         inpainting (AutoPipelineForInpainting), not to image to image"
                            .into(),
                    ));
                }
                pipe.generate_with(req, image, strength, noise, callback)
            }
            Self::StableDiffusionXL(pipe) => pipe.generate_with(
                &XlRequest::new(req.clone()),
                &options.xl(strength),
                XlInitImage::Image(image),
                noise,
                callback,
            ),
            Self::StableDiffusionXLControlNet(pipe) => {
                let control = control.cloned().unwrap_or_default();
                pipe.generate_with(
                    &XlRequest::new(req.clone()),
                    &options.xl(strength),
                    XlInitImage::Image(image),
                    &control,
                    noise,
                    callback,
                )
            }
        }
    }
}

impl<B: Backend> AutoPipelineForInpainting<B> {
    /// Repaints the white part of `mask` (the image's size) from the prompt, as the running
    /// pipeline's `generate_with` (noise drawn from `noise` in diffusers' order, `callback`
    /// after every step).
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        options: &EditOptions,
        image: &DynamicImage,
        mask: &DynamicImage,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let strength = options.strength_or(self.defaults());
        let controlled = matches!(
            self,
            Self::StableDiffusionControlNet(_) | Self::StableDiffusionXLControlNet(_)
        );
        let control = options.control_for(controlled)?;
        let inpaint = InpaintOptions {
            strength,
            padding_mask_crop: options.padding_mask_crop,
        };
        match self {
            Self::StableDiffusionControlNet(pipe) => {
                options.refuse_xl_fields()?;
                let control = control.cloned().unwrap_or_default();
                pipe.generate_with(req, image, mask, &inpaint, &control, noise, callback)
            }
            Self::StableDiffusion(pipe) => {
                options.refuse_xl_fields()?;
                let inpaint = InpaintOptions {
                    strength,
                    padding_mask_crop: options.padding_mask_crop,
                };
                pipe.generate_with_options(req, image, mask, &inpaint, noise, callback)
            }
            Self::StableDiffusionXL(pipe) => pipe.generate_with(
                &XlRequest::new(req.clone()),
                &options.xl(strength),
                image,
                mask,
                noise,
                callback,
            ),
            Self::StableDiffusionXLControlNet(pipe) => {
                let control = control.cloned().unwrap_or_default();
                pipe.generate_with(
                    &XlRequest::new(req.clone()),
                    &options.xl(strength),
                    image,
                    mask,
                    &control,
                    noise,
                    callback,
                )
            }
        }
    }
}
