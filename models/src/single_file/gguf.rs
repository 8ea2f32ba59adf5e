//! Transformers from GGUF files, as diffusers' `from_single_file(...,
//! quantization_config=GGUFQuantizationConfig(...))`: the file holds the weights (quantized ones
//! stay in their blocks, dense ones are held in the requested dtype), a diffusers folder the
//! config.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;

use crate::error::{ModelError, Result};
use crate::transformer_flux::{FluxTransformer2DConfig, FluxTransformer2DModel};
use crate::transformer_sd3::{SD3Transformer2DConfig, SD3Transformer2DModel};
use crate::var_builder::build_component;
use crate::weights::Weights;

impl<B: Backend> FluxTransformer2DModel<B> {
    /// A transformer from a GGUF file (`--transformer FILE.gguf`, diffusers'
    /// `from_single_file(..., quantization_config=GGUFQuantizationConfig(...))`), with the
    /// config of `config_dir/config.json`. The file's tensors carry diffusers' key names or the
    /// original ones (city96's files; renamed as [`super::flux`] says); quantized
    /// weights stay in their blocks, and plain ones are held in `dtype`.
    pub fn from_gguf_in(
        file: &Path,
        config_dir: &Path,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let config = FluxTransformer2DConfig::from_file(&config_dir.join("config.json"))?;
        let mut weights = Weights::from_gguf(file)?;
        if super::flux::has_original_flux_names(&weights) {
            weights = weights.view(super::flux::flux_names(&config))?;
        }
        build_component(weights, dtype, device, |vb| {
            let mut model = Self::load(&config, vb.clone())?;
            model.quantized = vb.weights().quantized_in_use();
            Ok(model)
        })
    }
}

impl<B: Backend> SD3Transformer2DModel<B> {
    /// A transformer from a GGUF file whose tensors carry diffusers' key names, with the config
    /// of `config_dir/config.json` (diffusers' `from_single_file(...,
    /// quantization_config=GGUFQuantizationConfig(...))`): quantized weights stay in their
    /// blocks, plain ones are held in `dtype`.
    pub fn from_gguf_in(
        file: &Path,
        config_dir: &Path,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let config = SD3Transformer2DConfig::from_file(&config_dir.join("config.json"))?;
        let weights = Weights::from_gguf(file)?;
        if weights.contains("joint_blocks.0.x_block.attn.qkv.weight") {
            return Err(ModelError::Unsupported {
                path: file.to_path_buf(),
                reason: "its tensors carry the original SD3 key names (`joint_blocks.N...`); \
                         oxidiff reads SD3 GGUF files with diffusers' key names for now"
                    .into(),
            });
        }
        build_component(weights, dtype, device, |vb| {
            let mut model = Self::load(&config, vb.clone())?;
            model.quantized = vb.weights().quantized_in_use();
            Ok(model)
        })
    }
}
