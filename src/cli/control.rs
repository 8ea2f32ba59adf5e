//! The ControlNet flags: `--controlnet DIR_OR_FILE[:SCALE]` (repeatable), `--control-image
//! FILE` (one per ControlNet, in order), `--control-guidance-start F`,
//! `--control-guidance-end F` and `--guess-mode`, checked before any model loads, and the PNG
//! fields A1111's ControlNet extension writes (`ControlNet 0: "..."`), read back by
//! `--from-png` ([`ControlArgs::from_png_fields`]).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;
use oxidiff_pipelines::image::load_image_as;
use oxidiff_pipelines::path_scale::parse_path_scale;
use oxidiff_pipelines::{Control, ControlNets, ControlRequest, PipelineError};

use crate::cli::usage::pixels_within;
use crate::cli::UsageError;
use crate::files::check_regular;

/// A ControlNet and its conditioning scale, as `--controlnet DIR_OR_FILE[:SCALE]` takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlNetSpec {
    pub path: PathBuf,
    pub scale: f32,
}

impl FromStr for ControlNetSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (path, scale) = parse_path_scale(text, "ControlNet")?;
        Ok(Self { path, scale })
    }
}

impl ControlNetSpec {
    /// The name the PNG records: the folder's for a diffusers folder or its weights file
    /// (`diffusion_pytorch_model*.safetensors`), else the single file's stem.
    pub fn name(&self) -> String {
        let stem = self.path.file_stem().map(|s| s.to_string_lossy());
        let named = match stem {
            Some(stem) if self.path.is_file() && !stem.starts_with("diffusion_pytorch_model") => {
                self.path.file_stem()
            }
            _ if self.path.is_file() => self.path.parent().and_then(Path::file_name),
            _ => self.path.file_name(),
        };
        named
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }
}

#[derive(clap::Args, Debug, Clone, Default)]
pub struct ControlArgs {
    /// A ControlNet to steer the image (diffusers' ControlNet pipelines): a diffusers
    /// ControlNet folder (config.json and diffusion_pytorch_model.safetensors), or one
    /// .safetensors file of an SD 1.x/2.x or SDXL ControlNet (A1111's control_*.safetensors or
    /// diffusers' names; its config is the config.json beside it, else read from the tensors),
    /// at SCALE (its `controlnet_conditioning_scale`, default 1). Repeat for several, each with its
    /// --control-image. Recorded in the PNG as A1111's ControlNet extension does.
    #[arg(long, value_name = "DIR_OR_FILE[:SCALE]")]
    pub controlnet: Vec<ControlNetSpec>,
    /// The conditioning image of each --controlnet, in the same order (PNG, JPEG or WebP;
    /// resized to the output size, which defaults to the first image's).
    #[arg(long, value_name = "FILE")]
    pub control_image: Vec<PathBuf>,
    /// The fraction of the steps after which the ControlNets start to apply, in [0, 1).
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    pub control_guidance_start: f64,
    /// The fraction of the steps after which they stop applying, in (0, 1].
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    pub control_guidance_end: f64,
    /// diffusers' guess mode: the ControlNets see no negative prompt and their residuals grow
    /// from 0.1 to 1 through the blocks (A1111's "ControlNet is more important").
    #[arg(long)]
    pub guess_mode: bool,
}

impl ControlArgs {
    /// Whether any ControlNet is given.
    pub fn active(&self) -> bool {
        !self.controlnet.is_empty()
    }

    /// The checks that need no model: as many control images as ControlNets, a window inside
    /// [0, 1] with its start before its end, every ControlNet folder and image present and
    /// each image within `max_pixels` (from its header, before any pixel is decoded).
    pub fn check(&self, max_pixels: u64) -> Result<(), UsageError> {
        let (nets, images) = (self.controlnet.len(), self.control_image.len());
        if nets == 0 {
            if images > 0 || self.guess_mode {
                return Err(UsageError(
                    "--control-image and --guess-mode need a --controlnet".into(),
                ));
            }
            if (self.control_guidance_start, self.control_guidance_end) != (0.0, 1.0) {
                return Err(UsageError(
                    "--control-guidance-start/--control-guidance-end need a --controlnet".into(),
                ));
            }
            return Ok(());
        }
        if nets != images {
            return Err(UsageError(format!(
                "{nets} --controlnet and {images} --control-image: give one control image per \
                 ControlNet, in the same order"
            )));
        }
        let (start, end) = (self.control_guidance_start, self.control_guidance_end);
        let inside = |v: f64| (0.0..=1.0).contains(&v);
        if !inside(start) || !inside(end) || start >= end {
            return Err(UsageError(format!(
                "--control-guidance-start {start} and --control-guidance-end {end}: give a \
                 window inside [0, 1] whose start is below its end"
            )));
        }
        for spec in &self.controlnet {
            if !spec.path.is_file() && !spec.path.join("config.json").is_file() {
                return Err(UsageError(format!(
                    "--controlnet {}: no ControlNet there; give a diffusers ControlNet folder \
                     (config.json and diffusion_pytorch_model.safetensors) or a ControlNet \
                     .safetensors file (A1111's control_*.safetensors, or diffusers' names)",
                    spec.path.display()
                )));
            }
        }
        for path in &self.control_image {
            check_regular(path, "control image")
                .map_err(|e| UsageError(format!("--control-image: {e}")))?;
            let (w, h) = image::image_dimensions(path).map_err(|e| {
                UsageError(format!(
                    "--control-image {}: not an image this build reads (PNG, JPEG, WebP): {e}",
                    path.display()
                ))
            })?;
            if pixels_within(w as usize, h as usize, max_pixels).is_none() {
                return Err(UsageError(format!(
                    "pass --max-pixels N to read the control image {} ({w}x{h}): images are \
                     limited to {max_pixels} pixels",
                    path.display()
                )));
            }
        }
        Ok(())
    }

    /// Loads the ControlNets on `device`, weights in `dtype`, each by its config's class
    /// (UNet or SD3 ControlNets).
    pub fn load<B: Backend>(
        &self,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<ControlNets<B>, PipelineError> {
        let paths: Vec<&Path> = self
            .controlnet
            .iter()
            .map(|spec| spec.path.as_path())
            .collect();
        ControlNets::from_paths(&paths, None, dtype, device)
    }

    /// The control mode of each loaded ControlNet, as the flags have none: unset, or 0 for a
    /// Flux ControlNet-Union with a single mode; a Union with several modes is refused.
    pub fn control_modes<B: Backend>(
        &self,
        nets: &ControlNets<B>,
    ) -> Result<Vec<Option<usize>>, UsageError> {
        let ControlNets::Flux(nets) = nets else {
            return Ok(Vec::new());
        };
        (nets.iter().zip(&self.controlnet))
            .map(|(net, spec)| match net.num_mode() {
                None => Ok(None),
                Some(1) => Ok(Some(0)),
                Some(_) => Err(UsageError(format!(
                    "--controlnet {}: a ControlNet-Union needs a control mode; use the \
                     library's Control::control_mode",
                    spec.path.display()
                ))),
            })
            .collect()
    }

    /// The control request (images decoded), or `None` without ControlNets.
    pub fn request(&self) -> Result<Option<ControlRequest>, PipelineError> {
        self.request_with_modes(&[])
    }

    /// [`request`](Self::request) with control mode `modes[k]` for ControlNet `k` (from
    /// [`control_modes`](Self::control_modes); unset past its end).
    pub fn request_with_modes(
        &self,
        modes: &[Option<usize>],
    ) -> Result<Option<ControlRequest>, PipelineError> {
        if !self.active() {
            return Ok(None);
        }
        let controls = self
            .controlnet
            .iter()
            .zip(&self.control_image)
            .enumerate()
            .map(|(k, (spec, path))| {
                Ok(Control {
                    scale: f64::from(spec.scale),
                    guidance_start: self.control_guidance_start,
                    guidance_end: self.control_guidance_end,
                    control_mode: modes.get(k).copied().flatten(),
                    ..Control::new(load_image_as(path, "control image")?)
                })
            })
            .collect::<Result<Vec<_>, PipelineError>>()?;
        Ok(Some(ControlRequest {
            controls,
            guess_mode: self.guess_mode,
        }))
    }

    /// The PNG's ControlNet fields, as A1111's ControlNet extension writes them (the
    /// parameters text quotes each value).
    pub fn png_fields(&self) -> Vec<(String, String)> {
        let mode = if self.guess_mode {
            MORE_IMPORTANT
        } else {
            "Balanced"
        };
        self.controlnet
            .iter()
            .enumerate()
            .map(|(k, spec)| {
                (
                    format!("ControlNet {k}"),
                    format!(
                        "Module: none, Model: {}, Weight: {}, Guidance Start: {}, Guidance \
                         End: {}, Control Mode: {mode}",
                        spec.name(),
                        spec.scale,
                        self.control_guidance_start,
                        self.control_guidance_end
                    ),
                )
            })
            .collect()
    }
}

/// The guess-mode name A1111's ControlNet extension writes as `Control Mode`.
const MORE_IMPORTANT: &str = "ControlNet is more important";

/// One `ControlNet k` field of a PNG, as A1111's ControlNet extension writes it: `Module: none,
/// Model: NAME, Weight: S, Guidance Start: A, Guidance End: B, Control Mode: MODE`.
#[derive(Debug, Clone, PartialEq)]
pub struct PngControlNet {
    pub model: String,
    pub weight: f32,
    pub guidance_start: f64,
    pub guidance_end: f64,
    pub guess_mode: bool,
}

impl PngControlNet {
    /// The field's value parsed; `None` when it is not one (a field of another extension).
    pub fn parse(value: &str) -> Option<Self> {
        let mut model = None;
        let (mut weight, mut start, mut end, mut guess_mode) = (1.0f32, 0.0f64, 1.0f64, false);
        for part in value.split(", ") {
            let (key, v) = part.split_once(": ")?;
            match key.trim() {
                "Model" => model = Some(v.trim().to_string()),
                "Weight" => weight = v.trim().parse().ok()?,
                "Guidance Start" => start = v.trim().parse().ok()?,
                "Guidance End" => end = v.trim().parse().ok()?,
                "Control Mode" => guess_mode = v.trim() == MORE_IMPORTANT,
                _ => {}
            }
        }
        Some(Self {
            model: model.filter(|m| !m.is_empty())?,
            weight,
            guidance_start: start,
            guidance_end: end,
            guess_mode,
        })
    }
}

impl ControlArgs {
    /// `--from-png`'s ControlNets: the PNG's `ControlNet k` fields (`extra`, in order) as
    /// flags, each model found by path or by folder name in `dirs`; nothing when the user gave
    /// `--controlnet`. The conditioning images are not in a PNG: without `--control-image` for
    /// each, the error names them. A PNG `png` whose ControlNets cannot be found or whose
    /// windows differ (one window for all is what this CLI writes) is an error naming the fix.
    pub fn from_png_fields(
        &mut self,
        extra: &[(String, String)],
        png: &Path,
        dirs: &[PathBuf],
    ) -> Result<(), UsageError> {
        if !self.controlnet.is_empty() {
            return Ok(());
        }
        let mut nets = Vec::new();
        for k in 0.. {
            let key = format!("ControlNet {k}");
            let Some((_, value)) = extra.iter().find(|(name, _)| *name == key) else {
                break;
            };
            let net = PngControlNet::parse(value).ok_or_else(|| {
                UsageError(format!(
                    "{}: its {key} field is not one A1111's ControlNet extension writes \
                     ({value}); pass --controlnet DIR:SCALE yourself",
                    png.display()
                ))
            })?;
            nets.push(net);
        }
        let Some(first) = nets.first() else {
            return Ok(());
        };
        if nets.iter().any(|n| {
            (n.guidance_start, n.guidance_end, n.guess_mode)
                != (first.guidance_start, first.guidance_end, first.guess_mode)
        }) {
            return Err(UsageError(format!(
                "{} was made with ControlNets of different guidance windows or modes; pass \
                 --controlnet, --control-guidance-start/-end and --guess-mode yourself",
                png.display()
            )));
        }
        for net in &nets {
            let path = find_controlnet(&net.model, dirs).ok_or_else(|| {
                let searched: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
                UsageError(format!(
                    "{} was made with ControlNet `{}`, which is not in the model folders ({}); \
                     pass --controlnet DIR:{} or --model-dir DIR where it is",
                    png.display(),
                    net.model,
                    searched.join(", "),
                    net.weight
                ))
            })?;
            self.controlnet.push(ControlNetSpec {
                path,
                scale: net.weight,
            });
        }
        if self.control_image.len() != nets.len() {
            let names: Vec<&str> = nets.iter().map(|n| n.model.as_str()).collect();
            return Err(UsageError(format!(
                "{} was made with ControlNet {} steered by images a PNG does not hold; pass \
                 --control-image FILE for each, in that order",
                png.display(),
                names.join(", ")
            )));
        }
        self.control_guidance_start = first.guidance_start;
        self.control_guidance_end = first.guidance_end;
        self.guess_mode = first.guess_mode;
        Ok(())
    }
}

/// The ControlNet `name` a PNG records (A1111 adds ` [hash]`): a path as it is, else a folder
/// of that name (with a `config.json`) or a `NAME.safetensors` file in `dirs`.
fn find_controlnet(name: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    let path = Path::new(name);
    if path.join("config.json").is_file() || path.is_file() {
        return Some(path.to_path_buf());
    }
    let name = match name.rsplit_once(" [") {
        Some((stem, hash)) if hash.ends_with(']') => stem,
        _ => name,
    };
    if name.contains(['/', '\\']) || name == "." || name == ".." || name.is_empty() {
        return None;
    }
    dirs.iter().find_map(|dir| {
        let folder = dir.join(name);
        let file = dir.join(format!("{name}.safetensors"));
        if folder.join("config.json").is_file() {
            Some(folder)
        } else {
            file.is_file().then_some(file)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_fields_parse_back() {
        let args = ControlArgs {
            controlnet: vec![ControlNetSpec {
                path: PathBuf::from("nets/canny"),
                scale: 0.75,
            }],
            control_image: vec![PathBuf::from("edges.png")],
            control_guidance_start: 0.1,
            control_guidance_end: 0.9,
            guess_mode: true,
        };
        let fields = args.png_fields();
        assert_eq!(
            PngControlNet::parse(&fields[0].1),
            Some(PngControlNet {
                model: "canny".into(),
                weight: 0.75,
                guidance_start: 0.1,
                guidance_end: 0.9,
                guess_mode: true,
            })
        );
        // A1111's own field (with a preprocessor and more keys) reads the same way.
        let a1111 = "Module: canny, Model: control_v11p_sd15_canny [d14c016b], Weight: 1, \
                     Resize Mode: Crop and Resize, Low Vram: False, Processor Res: 512, \
                     Guidance Start: 0, Guidance End: 1, Pixel Perfect: False, Control Mode: Balanced";
        let net = PngControlNet::parse(a1111).unwrap();
        assert_eq!(net.model, "control_v11p_sd15_canny [d14c016b]");
        assert_eq!(
            (net.weight, net.guidance_end, net.guess_mode),
            (1.0, 1.0, false)
        );
        assert_eq!(PngControlNet::parse("no model here"), None);
        assert_eq!(PngControlNet::parse("Model: x, Weight: heavy"), None);
    }
}
