//! `AutoencoderKL`: the VAE that maps images to latents and back (diffusers' `autoencoder_kl.py`
//! and `vae.py`).

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::Deserialize;

use crate::attention::{Attention, AttentionSpec};
use crate::config::load_json;
use crate::dtype::{cast_to, dtype_of};
use crate::error::{ModelError, Result};
use crate::nn::{Activation, Conv2d, ConvSpec, GroupNorm};
use crate::program::ProgramSlot;
use crate::resnet::{Downsample2D, ResnetBlock2D, ResnetSpec, Upsample2D};
use crate::vae_tiling::VaeTiling;
use crate::var_builder::{load_component, VarBuilder};

/// `vae/config.json`, with diffusers' defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct AutoencoderKLConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub act_fn: String,
    pub latent_channels: usize,
    pub norm_num_groups: usize,
    pub sample_size: Option<usize>,
    pub scaling_factor: f64,
    pub shift_factor: Option<f64>,
    pub force_upcast: bool,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
}

impl Default for AutoencoderKLConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec!["DownEncoderBlock2D".into()],
            up_block_types: vec!["UpDecoderBlock2D".into()],
            block_out_channels: vec![64],
            layers_per_block: 1,
            act_fn: "silu".into(),
            latent_channels: 4,
            norm_num_groups: 32,
            sample_size: None,
            scaling_factor: 0.18215,
            shift_factor: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl AutoencoderKLConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = load_json(path)?;
        config.validate(path)?;
        Ok(config)
    }

    pub fn validate(&self, path: &Path) -> Result<()> {
        use crate::config::{check_at_most, MAX_DIMENSION, MAX_SAMPLE_SIZE};
        let sizes = [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
            ("norm_num_groups", self.norm_num_groups),
            ("layers_per_block", self.layers_per_block),
        ];
        let channels = self
            .block_out_channels
            .iter()
            .map(|&c| ("block_out_channels", c));
        for (field, value) in sizes.into_iter().chain(channels) {
            check_at_most(field, value, MAX_DIMENSION, path)?;
        }
        check_at_most("layers_per_block", self.layers_per_block, 64, path)?;
        if let Some(sample) = self.sample_size {
            check_at_most("sample_size", sample, MAX_SAMPLE_SIZE, path)?;
        }
        let n = self.block_out_channels.len();
        if n == 0 || self.down_block_types.len() != n || self.up_block_types.len() != n {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: "`down_block_types`, `up_block_types` and `block_out_channels` must have \
                         the same, non-zero length"
                    .into(),
            });
        }
        let known = self
            .down_block_types
            .iter()
            .all(|t| t == "DownEncoderBlock2D")
            && self.up_block_types.iter().all(|t| t == "UpDecoderBlock2D");
        if !known {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                reason: "only DownEncoderBlock2D/UpDecoderBlock2D VAE blocks are implemented"
                    .into(),
            });
        }
        if Activation::from_name(&self.act_fn).is_none() {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                reason: format!("`act_fn: {}`", self.act_fn),
            });
        }
        if n > 8 {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: format!(
                    "{n} VAE blocks would scale latents by 2^{}: not a real VAE config",
                    n - 1
                ),
            });
        }
        crate::config::check_groups(
            self.norm_num_groups,
            &self.block_out_channels,
            "block_out_channels",
            path,
        )
    }

    /// How much smaller than the image the latents are (8 for Stable Diffusion).
    pub fn scale_factor(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }

    /// diffusers' default tiles: `sample_size` pixels (32 when the config has none), the
    /// latent tile that over the scale factor, rounded down.
    pub fn default_tiling(&self) -> VaeTiling {
        let sample = self.sample_size.unwrap_or(32);
        VaeTiling {
            sample,
            latent: sample / self.scale_factor(),
        }
    }
}

/// The VAE's middle block: resnet, spatial self-attention, resnet.
#[derive(Module, Debug)]
pub struct VaeMidBlock<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub attentions: Vec<Attention<B>>,
}

impl<B: Backend> VaeMidBlock<B> {
    fn load(
        vb: &VarBuilder<B>,
        c: usize,
        groups: usize,
        act: Activation,
        attn: bool,
    ) -> Result<Self> {
        let spec = ResnetSpec {
            c_in: c,
            c_out: c,
            temb_channels: None,
            groups,
            eps: 1e-6,
            act,
        };
        let mut attentions = Vec::new();
        if attn {
            let vb_attn = vb.pp("attentions").pp(0);
            let mut layer = Attention::load(
                &vb_attn,
                AttentionSpec {
                    query_dim: c,
                    context_dim: c,
                    heads: 1,
                    head_dim: c,
                    qkv_bias: true,
                },
            )?;
            layer.group_norm = Some(GroupNorm::load(&vb_attn.pp("group_norm"), groups, c, 1e-6)?);
            attentions.push(layer);
        }
        Ok(Self {
            resnets: vec![
                ResnetBlock2D::load(&vb.pp("resnets").pp(0), spec)?,
                ResnetBlock2D::load(&vb.pp("resnets").pp(1), spec)?,
            ],
            attentions,
        })
    }

    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = x;
        for (i, resnet) in self.resnets.iter().enumerate() {
            if i > 0 {
                if let Some(attn) = self.attentions.get(i - 1) {
                    x = attn.forward_spatial(x);
                }
            }
            x = resnet.forward(x, None);
        }
        x
    }
}

/// `DownEncoderBlock2D`.
#[derive(Module, Debug)]
pub struct EncoderBlock<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub downsamplers: Vec<Downsample2D<B>>,
}

/// `UpDecoderBlock2D`.
#[derive(Module, Debug)]
pub struct DecoderBlock<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub upsamplers: Vec<Upsample2D<B>>,
}

/// Image to latent moments (`mean` and `logvar` concatenated on channels).
#[derive(Module, Debug)]
pub struct Encoder<B: Backend> {
    pub conv_in: Conv2d<B>,
    pub down_blocks: Vec<EncoderBlock<B>>,
    pub mid_block: VaeMidBlock<B>,
    pub conv_norm_out: GroupNorm<B>,
    pub conv_out: Conv2d<B>,
    #[module(skip)]
    pub act: Activation,
}

/// Latents to image.
#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    pub conv_in: Conv2d<B>,
    pub mid_block: VaeMidBlock<B>,
    pub up_blocks: Vec<DecoderBlock<B>>,
    pub conv_norm_out: GroupNorm<B>,
    pub conv_out: Conv2d<B>,
    #[module(skip)]
    pub act: Activation,
}

/// The KL-regularised autoencoder of Stable Diffusion.
#[derive(Module, Debug)]
pub struct AutoencoderKL<B: Backend> {
    pub encoder: Encoder<B>,
    pub decoder: Decoder<B>,
    pub quant_conv: Option<Conv2d<B>>,
    pub post_quant_conv: Option<Conv2d<B>>,
    /// Latents are multiplied by this after encoding and divided before decoding.
    pub scaling_factor: f64,
    /// Subtracted before scaling (SD3, Flux); zero for SD 1.x/2.x.
    pub shift_factor: f64,
    /// diffusers' `enable_tiling()`: inputs larger than one tile are encoded and decoded tile
    /// by tile ([`VaeTiling`]); `None`: in one piece.
    #[module(skip)]
    pub tiling: Option<VaeTiling>,
    /// diffusers' `enable_slicing()`: a batch is encoded and decoded one image at a time.
    #[module(skip)]
    pub slicing: bool,
    /// diffusers' tiles for this VAE: its config's `sample_size` pixels.
    #[module(skip)]
    pub default_tiling: VaeTiling,
    /// Compiled mode: the encoder ([`run_encoder`](Self::run_encoder)) as one program, run
    /// for each slice and tile; empty: its ops.
    #[module(skip)]
    pub encoder_program: ProgramSlot,
    /// Compiled mode: the decoder ([`run_decoder`](Self::run_decoder)) as one program.
    #[module(skip)]
    pub decoder_program: ProgramSlot,
}

/// The latent distribution `encode` returns: a diagonal Gaussian.
#[derive(Debug, Clone)]
pub struct LatentDist<B: Backend> {
    pub mean: Tensor<B, 4>,
    pub logvar: Tensor<B, 4>,
}

impl<B: Backend> LatentDist<B> {
    pub fn std(&self) -> Tensor<B, 4> {
        self.logvar.clone().mul_scalar(0.5).exp()
    }

    /// `mean + std * noise`, with noise drawn by the caller (standard normal).
    pub fn sample(&self, noise: Tensor<B, 4>) -> Tensor<B, 4> {
        self.mean.clone() + self.std() * noise
    }
}

impl<B: Backend> AutoencoderKL<B> {
    /// Loads `vae/config.json` and the weights of the `vae` folder.
    pub fn from_dir(dir: &Path, variant: Option<&str>, device: &B::Device) -> Result<Self> {
        Self::from_dir_in(dir, variant, FloatDType::F32, device)
    }

    /// The same, with the float weights held in `dtype`: read straight into it, so a checkpoint
    /// stored in it is used in place and any other is converted once, never through f32 (what
    /// the model computes at load, such as sinusoidal tables, is cast after).
    pub fn from_dir_in(
        dir: &Path,
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let path = dir.join("config.json");
        let config = AutoencoderKLConfig::from_file(&path)?;
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, &path, vb),
        )
    }

    pub fn load(cfg: &AutoencoderKLConfig, config_path: &Path, vb: VarBuilder<B>) -> Result<Self> {
        cfg.validate(config_path)?;
        let act = Activation::from_name(&cfg.act_fn).unwrap_or(Activation::Silu);
        let groups = cfg.norm_num_groups;
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let last = ch[n - 1];
        let lat = cfg.latent_channels;
        let resnet = |c_in, c_out| ResnetSpec {
            c_in,
            c_out,
            temb_channels: None,
            groups,
            eps: 1e-6,
            act,
        };

        // Text to image never encodes: on a device, the encoder's weights arrive at its first
        // call instead of at load.
        let vb_enc = vb.pp("encoder").uploaded_at_first_use();
        let mut down_blocks = Vec::new();
        let mut c_out = ch[0];
        for (i, &c) in ch.iter().enumerate() {
            let vb_block = vb_enc.pp("down_blocks").pp(i);
            let c_in = c_out;
            c_out = c;
            let resnets = (0..cfg.layers_per_block)
                .map(|j| {
                    let rin = if j == 0 { c_in } else { c_out };
                    ResnetBlock2D::load(&vb_block.pp("resnets").pp(j), resnet(rin, c_out))
                })
                .collect::<Result<Vec<_>>>()?;
            let downsamplers = if i + 1 < n {
                vec![Downsample2D::load(
                    &vb_block.pp("downsamplers").pp(0),
                    c_out,
                    0,
                )?]
            } else {
                Vec::new()
            };
            down_blocks.push(EncoderBlock {
                resnets,
                downsamplers,
            });
        }
        let encoder = Encoder {
            conv_in: Conv2d::load(
                &vb_enc.pp("conv_in"),
                ConvSpec::same(cfg.in_channels, ch[0], 3),
            )?,
            down_blocks,
            mid_block: VaeMidBlock::load(
                &vb_enc.pp("mid_block"),
                last,
                groups,
                act,
                cfg.mid_block_add_attention,
            )?,
            conv_norm_out: GroupNorm::load(&vb_enc.pp("conv_norm_out"), groups, last, 1e-6)?,
            conv_out: Conv2d::load(&vb_enc.pp("conv_out"), ConvSpec::same(last, 2 * lat, 3))?,
            act,
        };

        let vb_dec = vb.pp("decoder");
        let mut up_blocks = Vec::new();
        let reversed: Vec<usize> = ch.iter().rev().copied().collect();
        let mut c_out = reversed[0];
        for (i, &c) in reversed.iter().enumerate() {
            let vb_block = vb_dec.pp("up_blocks").pp(i);
            let c_in = c_out;
            c_out = c;
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| {
                    let rin = if j == 0 { c_in } else { c_out };
                    ResnetBlock2D::load(&vb_block.pp("resnets").pp(j), resnet(rin, c_out))
                })
                .collect::<Result<Vec<_>>>()?;
            let upsamplers = if i + 1 < n {
                vec![Upsample2D::load(&vb_block.pp("upsamplers").pp(0), c_out)?]
            } else {
                Vec::new()
            };
            up_blocks.push(DecoderBlock {
                resnets,
                upsamplers,
            });
        }
        let decoder = Decoder {
            conv_in: Conv2d::load(&vb_dec.pp("conv_in"), ConvSpec::same(lat, last, 3))?,
            mid_block: VaeMidBlock::load(
                &vb_dec.pp("mid_block"),
                last,
                groups,
                act,
                cfg.mid_block_add_attention,
            )?,
            up_blocks,
            conv_norm_out: GroupNorm::load(&vb_dec.pp("conv_norm_out"), groups, ch[0], 1e-6)?,
            conv_out: Conv2d::load(
                &vb_dec.pp("conv_out"),
                ConvSpec::same(ch[0], cfg.out_channels, 3),
            )?,
            act,
        };

        let quant_conv = if cfg.use_quant_conv {
            Some(Conv2d::load(
                &vb.pp("quant_conv").uploaded_at_first_use(),
                ConvSpec::same(2 * lat, 2 * lat, 1),
            )?)
        } else {
            None
        };
        let post_quant_conv = if cfg.use_post_quant_conv {
            Some(Conv2d::load(
                &vb.pp("post_quant_conv"),
                ConvSpec::same(lat, lat, 1),
            )?)
        } else {
            None
        };
        Ok(Self {
            encoder,
            decoder,
            quant_conv,
            post_quant_conv,
            scaling_factor: cfg.scaling_factor,
            shift_factor: cfg.shift_factor.unwrap_or(0.0),
            tiling: None,
            slicing: false,
            default_tiling: cfg.default_tiling(),
            encoder_program: ProgramSlot::default(),
            decoder_program: ProgramSlot::default(),
        })
    }

    /// Tiled encode and decode from now on (diffusers' `enable_tiling()`, with `tile` for its
    /// `tile_sample_min_size` / `tile_latent_min_size`; [`default_tiling`](Self::default_tiling)
    /// field is diffusers' default).
    pub fn enable_tiling(&mut self, tile: VaeTiling) {
        self.tiling = Some(tile);
    }

    /// Encode and decode in one piece again.
    pub fn disable_tiling(&mut self) {
        self.tiling = None;
    }

    /// A batch one image at a time from now on (diffusers' `enable_slicing()`).
    pub fn enable_slicing(&mut self) {
        self.slicing = true;
    }

    /// A batch at once again.
    pub fn disable_slicing(&mut self) {
        self.slicing = false;
    }

    /// Runs the encoder and decoder as ops again, dropping installed programs (which hold the
    /// weights and device they were built for).
    pub fn clear_programs(&mut self) {
        self.encoder_program.clear();
        self.decoder_program.clear();
    }

    /// `f` on the whole batch, or with slicing on each image of it, concatenated.
    fn per_slice(&self, x: Tensor<B, 4>, f: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>) -> Tensor<B, 4> {
        let n = x.dims()[0];
        if self.slicing && n > 1 {
            Tensor::cat((0..n).map(|i| f(x.clone().narrow(0, i, 1))).collect(), 0)
        } else {
            f(x)
        }
    }

    /// Encodes images in `[-1, 1]`, `[batch, 3, h, w]`, to the latent distribution (unscaled).
    /// Computed in the weights' dtype; the distribution is in `image`'s dtype.
    pub fn encode(&self, image: Tensor<B, 4>) -> LatentDist<B> {
        let caller = dtype_of(&image);
        let image = cast_to(image, dtype_of(&self.encoder.conv_in.weight.val()));
        let x = self.per_slice(image, |x| {
            let [_, _, h, w] = x.dims();
            match self.tiling {
                Some(tile) if h > tile.sample || w > tile.sample => {
                    tile.encode(x, |x| self.encode_moments(x))
                }
                _ => self.encode_moments(x),
            }
        });
        let x = cast_to(x, caller);
        let c = x.dims()[1] / 2;
        LatentDist {
            mean: x.clone().narrow(1, 0, c),
            logvar: x.narrow(1, c, c).clamp(-30.0, 20.0),
        }
    }

    /// Decodes the latents a denoising loop ends with: undoes the checkpoint's
    /// `scaling_factor` and `shift_factor` (SD3, Flux), then [`decode`](Self::decode)s.
    pub fn decode_scaled(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        let unscaled = latents.div_scalar(self.scaling_factor);
        if self.shift_factor == 0.0 {
            self.decode(unscaled)
        } else {
            self.decode(unscaled.add_scalar(self.shift_factor))
        }
    }

    /// Decodes unscaled latents to images in about `[-1, 1]`.
    /// Computed in the weights' dtype; the images are in `latents`' dtype.
    pub fn decode(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        let caller = dtype_of(&latents);
        let latents = cast_to(latents, dtype_of(&self.decoder.conv_in.weight.val()));
        let x = self.per_slice(latents, |z| {
            let [_, _, h, w] = z.dims();
            match self.tiling {
                Some(tile) if h > tile.latent || w > tile.latent => {
                    tile.decode(z, |z| self.decode_pixels(z))
                }
                _ => self.decode_pixels(z),
            }
        });
        cast_to(x, caller)
    }

    /// Pixels to moments: the installed encoder program, or [`run_encoder`](Self::run_encoder).
    fn encode_moments(&self, image: Tensor<B, 4>) -> Tensor<B, 4> {
        self.encoder_program
            .run_or(image, |image| self.run_encoder(image))
    }

    /// Latents to pixels: the installed decoder program, or [`run_decoder`](Self::run_decoder).
    fn decode_pixels(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        self.decoder_program
            .run_or(latents, |latents| self.run_decoder(latents))
    }

    /// The encoder and `quant_conv` as ops: pixels to moments (mean and log-variance stacked
    /// on the channels), in the weights' dtype; what an encoder program computes.
    pub fn run_encoder(&self, image: Tensor<B, 4>) -> Tensor<B, 4> {
        let enc = &self.encoder;
        let mut x = enc.conv_in.forward(image);
        for block in &enc.down_blocks {
            for resnet in &block.resnets {
                x = resnet.forward(x, None);
            }
            for down in &block.downsamplers {
                x = down.forward(x);
            }
        }
        x = enc.mid_block.forward(x);
        x = enc
            .conv_out
            .forward(enc.conv_norm_out.forward_then(x, enc.act));
        match &self.quant_conv {
            Some(conv) => conv.forward(x),
            None => x,
        }
    }

    /// `post_quant_conv` and the decoder as ops: unscaled latents to pixels, in the weights'
    /// dtype; what a decoder program computes.
    pub fn run_decoder(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        let dec = &self.decoder;
        let mut x = match &self.post_quant_conv {
            Some(conv) => conv.forward(latents),
            None => latents,
        };
        x = dec.conv_in.forward(x);
        x = dec.mid_block.forward(x);
        for block in &dec.up_blocks {
            for resnet in &block.resnets {
                x = resnet.forward(x, None);
            }
            for up in &block.upsamplers {
                x = up.forward(x, None);
            }
        }
        dec.conv_out
            .forward(dec.conv_norm_out.forward_then(x, dec.act))
    }
}
