//! Reading a component's `config.json` with errors that name the file and the field.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// Reads and parses a JSON config; a wrong type or missing field names its path in the JSON.
pub fn load_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_json(&text, path)
}

/// Parses JSON text; `path` is only used in messages.
pub fn parse_json<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T> {
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        reason: format!("field `{}`: {}", e.path(), e.inner()),
    })
}

/// A config value that is written either once for all blocks or once per block
/// (`attention_head_dim: 8` or `[5, 10, 20, 20]`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PerBlock<T> {
    One(T),
    Each(Vec<T>),
}

impl<T: Clone> PerBlock<T> {
    /// One value for each of `n` blocks; a list of the wrong length is an error.
    pub fn expand(&self, n: usize, field: &str, path: &Path) -> Result<Vec<T>> {
        match self {
            Self::One(v) => Ok(vec![v.clone(); n]),
            Self::Each(list) if list.len() == n => Ok(list.clone()),
            Self::Each(list) => Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: format!(
                    "field `{field}` has {} entries but there are {n} blocks",
                    list.len()
                ),
            }),
        }
    }
}

/// GroupNorm needs a positive group count that divides every channel count it normalizes; a
/// config that breaks this would otherwise fail deep inside a forward pass.
pub fn check_groups(groups: usize, channels: &[usize], field: &str, path: &Path) -> Result<()> {
    match channels
        .iter()
        .find(|&&c| groups == 0 || c == 0 || !c.is_multiple_of(groups))
    {
        Some(c) => Err(ModelError::Config {
            path: path.to_path_buf(),
            reason: format!(
                "`norm_num_groups: {groups}` must be positive and divide every entry of \
                 `{field}` (found {c})"
            ),
        }),
        None => Ok(()),
    }
}

/// The largest width, channel count or vocabulary a config may give. Released models stay far
/// below (Flux: 3072 channels, T5-XXL: 10240 feed-forward, CLIP: 49408 tokens); a larger
/// value is a corrupt or hostile file, refused before a layer or table is built from it.
pub const MAX_DIMENSION: usize = 1 << 20;

/// The largest `sample_size` (in latent pixels for denoisers, image pixels for VAEs) a config may
/// give: 16384, past any real model's 128 (SDXL) or 1024 (a VAE).
pub const MAX_SAMPLE_SIZE: usize = 1 << 14;

/// Refuses `value` of `field` above `max`, naming the file and the field.
pub fn check_at_most(field: &str, value: usize, max: usize, path: &Path) -> Result<()> {
    if value > max {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            reason: format!(
                "`{field}: {value}` is larger than any real model's (at most {max} is accepted): \
                 the config is corrupt"
            ),
        });
    }
    Ok(())
}

/// The most layers (blocks) a config may give: 1024, past any real model's (T5-XXL: 24, Flux:
/// 19 + 38, SD3.5 Large: 38).
pub const MAX_LAYERS: usize = 1024;

/// Refuses any width above [`MAX_DIMENSION`] (heads times head width counted as one) and any
/// layer count above [`MAX_LAYERS`], naming the file and the field, before a layer is built.
pub fn check_transformer_sizes(
    path: &Path,
    dimensions: &[(&str, usize)],
    heads: [(&str, usize); 2],
    layers: &[(&str, usize)],
) -> Result<()> {
    for &(field, value) in dimensions {
        check_at_most(field, value, MAX_DIMENSION, path)?;
    }
    let [(count_field, count), (width_field, width)] = heads;
    let inner = count.saturating_mul(width);
    let field = format!("{count_field} * {width_field}");
    check_at_most(&field, inner, MAX_DIMENSION, path)?;
    for &(field, value) in layers {
        check_at_most(field, value, MAX_LAYERS, path)?;
    }
    Ok(())
}
