//! The IP-Adapter flags (`txt2img --ip-adapter FILE --ip-adapter-image PNG
//! --ip-adapter-scale S [--ip-adapter-image-encoder DIR]`), checked before any model loads.

use std::path::PathBuf;

use crate::cli::UsageError;
use crate::files::check_regular;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct IpAdapterArgs {
    /// An IP-Adapter weight file (SD 1.x/2.x and SDXL; the original h94 layout as diffusers'
    /// `load_ip_adapter` reads it, safetensors only, e.g. ip-adapter_sd15.safetensors): the
    /// image of --ip-adapter-image then steers the image as a prompt does.
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

    /// The scale, 1 when not given.
    pub fn scale(&self) -> f64 {
        self.ip_adapter_scale.unwrap_or(1.0)
    }
}
