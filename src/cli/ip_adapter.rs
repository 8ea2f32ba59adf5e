//! The IP-Adapter flags (`txt2img --ip-adapter FILE --ip-adapter-image PNG
//! --ip-adapter-scale S [--ip-adapter-image-encoder DIR]`), checked before any model loads.

use std::path::PathBuf;

use crate::cli::UsageError;
use crate::files::check_regular;

/// The PNG field naming the IP-Adapter (and, with ` image` and ` scale`, its image and scale).
pub const IP_ADAPTER_FIELD: &str = "IP-Adapter";

#[derive(clap::Args, Debug, Clone, Default)]
pub struct IpAdapterArgs {
    /// An IP-Adapter weight file (SD 1.x/2.x and SDXL; the original h94 layout as diffusers'
    /// `load_ip_adapter` reads it, safetensors only, e.g. ip-adapter_sd15.safetensors or
    /// ip-adapter-plus_sd15.safetensors): the image of --ip-adapter-image then steers the image
    /// as a prompt does.
    #[arg(long, value_name = "FILE")]
    pub ip_adapter: Option<PathBuf>,
    /// The image prompt for --ip-adapter (PNG, JPEG or WebP), resized and cropped as CLIP's
    /// image processor does.
    #[arg(long, value_name = "FILE")]
    pub ip_adapter_image: Option<PathBuf>,
    /// How strongly the image prompt counts (diffusers' `set_ip_adapter_scale`); 0 turns it
    /// off. Default 1.
    #[arg(long, value_name = "S")]
    pub ip_adapter_scale: Option<f64>,
    /// The adapter's CLIP image encoder folder (config.json, model.safetensors of a
    /// CLIPVisionModelWithProjection). Default: `image_encoder/` next to the --ip-adapter
    /// file, else in the model folder (diffusers' `image_encoder_folder="image_encoder"`).
    #[arg(long, value_name = "DIR")]
    pub ip_adapter_image_encoder: Option<PathBuf>,
}

impl IpAdapterArgs {
    /// Whether an IP-Adapter was asked for.
    pub fn active(&self) -> bool {
        self.ip_adapter.is_some()
    }

    /// The flags' own checks: the file and image given together and readable, a finite scale.
    pub fn check(&self) -> Result<(), UsageError> {
        let Some(file) = &self.ip_adapter else {
            if self.ip_adapter_image.is_some()
                || self.ip_adapter_scale.is_some()
                || self.ip_adapter_image_encoder.is_some()
            {
                return Err(UsageError(
                    "--ip-adapter-image, --ip-adapter-scale and --ip-adapter-image-encoder need \
                     an --ip-adapter FILE"
                        .into(),
                ));
            }
            return Ok(());
        };
        check_regular(file, "--ip-adapter file").map_err(|e| UsageError(e.to_string()))?;
        let Some(image) = &self.ip_adapter_image else {
            return Err(UsageError(
                "--ip-adapter needs an --ip-adapter-image FILE (the image prompt)".into(),
            ));
        };
        check_regular(image, "--ip-adapter-image").map_err(|e| UsageError(e.to_string()))?;
        if let Some(scale) = self.ip_adapter_scale {
            crate::cli::usage::finite("--ip-adapter-scale", scale)?;
        }
        if let Some(dir) = &self.ip_adapter_image_encoder {
            if !dir.join("config.json").is_file() {
                return Err(UsageError(format!(
                    "--ip-adapter-image-encoder {}: no config.json there; give the folder of a \
                     CLIPVisionModelWithProjection (config.json, model.safetensors)",
                    dir.display()
                )));
            }
        }
        Ok(())
    }

    /// The image prompt, read (an unreadable image is a usage error naming it).
    pub fn image(&self) -> Result<Option<image::DynamicImage>, UsageError> {
        self.ip_adapter_image
            .as_ref()
            .map(|path| {
                image::open(path).map_err(|e| {
                    UsageError(format!(
                        "cannot read the --ip-adapter-image {}: {e} (PNG, JPEG and WebP are \
                         supported)",
                        path.display()
                    ))
                })
            })
            .transpose()
    }

    /// The PNG fields that record the adapter: `IP-Adapter` (the weight file's name),
    /// `IP-Adapter image` (the image's file name) and `IP-Adapter scale`.
    pub fn png_fields(&self) -> Vec<(String, String)> {
        let (Some(file), Some(image)) = (&self.ip_adapter, &self.ip_adapter_image) else {
            return Vec::new();
        };
        let name = |p: &std::path::Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string())
        };
        vec![
            (IP_ADAPTER_FIELD.into(), name(file)),
            (format!("{IP_ADAPTER_FIELD} image"), name(image)),
            (
                format!("{IP_ADAPTER_FIELD} scale"),
                self.scale().to_string(),
            ),
        ]
    }

    /// `--from-png`: a PNG made with an IP-Adapter needs the adapter and its image given
    /// again (the PNG records only their names); the scale comes from the PNG unless
    /// --ip-adapter-scale is given.
    pub fn from_png_fields(
        &mut self,
        extra: &[(String, String)],
        png: &std::path::Path,
    ) -> Result<(), UsageError> {
        let field = |key: &str| extra.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let Some(name) = field(IP_ADAPTER_FIELD) else {
            return Ok(());
        };
        if self.ip_adapter.is_none() {
            let image = field(&format!("{IP_ADAPTER_FIELD} image"))
                .map(|i| format!(" with the image prompt {i}"))
                .unwrap_or_default();
            return Err(UsageError(format!(
                "{} was made with the IP-Adapter {name}{image}: pass --ip-adapter FILE and \
                 --ip-adapter-image FILE to make it again",
                png.display()
            )));
        }
        if self.ip_adapter_scale.is_none() {
            if let Some(scale) = field(&format!("{IP_ADAPTER_FIELD} scale")) {
                let scale = scale.parse::<f64>().map_err(|_| {
                    UsageError(format!(
                        "{}: its `{IP_ADAPTER_FIELD} scale` field is not a number ({scale}); \
                         pass --ip-adapter-scale S",
                        png.display()
                    ))
                })?;
                self.ip_adapter_scale = Some(scale);
            }
        }
        Ok(())
    }

    /// The scale, 1 when not given.
    pub fn scale(&self) -> f64 {
        self.ip_adapter_scale.unwrap_or(1.0)
    }
}
