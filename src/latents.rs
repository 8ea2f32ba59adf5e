//! Initial latents from a file (`txt2img --latents`): NumPy `.npy` (float32/float16/float64,
//! C order) or `.safetensors` with a single tensor (or one named `latents`), at most
//! [`MAX_LATENTS_BYTES`] and only from a regular file.

use std::path::{Path, PathBuf};

use oxidiff_models::Weights;

use crate::files::{check_regular, read_limited, InputError};

/// The largest latents file read: far above the latents of the largest image (`[1, 16,
/// 256, 256]` in float64 is 8 MiB), far below what could exhaust memory.
pub const MAX_LATENTS_BYTES: u64 = 64 << 20;

/// Why a latents file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LatentsError {
    #[error("cannot read latents file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("latents file {path}: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error(transparent)]
    Input(#[from] InputError),
}

/// Host values and shape of the latents in `path`.
pub fn read_latents(path: &Path) -> Result<(Vec<f32>, Vec<usize>), LatentsError> {
    let format = |reason: String| LatentsError::Format {
        path: path.to_path_buf(),
        reason,
    };
    match path.extension().and_then(|e| e.to_str()) {
        Some("npy") => {
            let bytes = read_limited(path, MAX_LATENTS_BYTES, "latents file")?;
            parse_npy(&bytes).map_err(format)
        }
        Some("safetensors") => {
            check_regular(path, "latents file")?;
            let len = std::fs::metadata(path)
                .map_err(|source| LatentsError::Io {
                    path: path.to_path_buf(),
                    source,
                })?
                .len();
            if len > MAX_LATENTS_BYTES {
                return Err(InputError::TooLarge {
                    what: "latents file",
                    path: path.to_path_buf(),
                    limit: MAX_LATENTS_BYTES,
                }
                .into());
            }
            let weights =
                Weights::from_files(&[path.to_path_buf()]).map_err(|e| format(e.to_string()))?;
            let keys: Vec<String> = weights.keys().map(str::to_string).collect();
            let key = if weights.contains("latents") {
                "latents".to_string()
            } else if keys.len() == 1 {
                keys[0].clone()
            } else {
                return Err(format(format!(
                    "holds {} tensors; name the one to use `latents`",
                    keys.len()
                )));
            };
            weights.read_f32(&key).map_err(|e| format(e.to_string()))
        }
        _ => Err(format(
            "unknown extension: use a .npy or .safetensors file".into(),
        )),
    }
}

/// Encodes float32 values of `shape` as a version 1 `.npy` file (C order).
pub fn encode_npy(values: &[f32], shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let trailing = if dims.len() == 1 { "," } else { "" };
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}{trailing}), }}",
        dims.join(", ")
    );
    // The header (with magic, version and length) is padded to a multiple of 64 bytes.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    for v in values {
        bytes.extend(v.to_le_bytes());
    }
    bytes
}

/// Parses a version 1-3 `.npy` file holding little-endian floats in C order.
pub fn parse_npy(bytes: &[u8]) -> Result<(Vec<f32>, Vec<usize>), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (bad magic)".into());
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or("header longer than the file")?;
    let header = std::str::from_utf8(&bytes[start..end]).map_err(|_| "header is not text")?;
    let field = |name: &str| -> Option<&str> {
        let at = header.find(&format!("'{name}'"))?;
        let rest = &header[at + name.len() + 2..];
        Some(rest.trim_start().trim_start_matches(':').trim_start())
    };
    let descr = field("descr").ok_or("header has no descr")?;
    let dtype = descr.split('\'').nth(1).ok_or("bad descr")?;
    if field("fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err("Fortran-ordered arrays are not supported; save with C order".into());
    }
    let shape_text = field("shape").ok_or("header has no shape")?;
    let inner = shape_text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("bad shape")?;
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad shape entry `{s}`"))
        })
        .collect::<Result<_, _>>()?;
    let count = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or("shape overflows")?;
    let data = &bytes[end..];
    let (width, convert): (usize, fn(&[u8]) -> f32) = match dtype {
        "<f4" => (4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        "<f2" => (2, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        "<f8" => (8, |b| {
            f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
        }),
        other => return Err(format!("dtype {other} is not supported; use float32")),
    };
    if count.checked_mul(width) != Some(data.len()) {
        return Err(format!(
            "shape {shape:?} needs {} bytes of data but the file has {}",
            count.saturating_mul(width),
            data.len()
        ));
    }
    Ok((data.chunks_exact(width).map(convert).collect(), shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `.npy` of `n` elements whose dtype string is `descr`, with raw `data`.
    fn npy(descr: &str, data: &[u8], n: usize) -> Vec<u8> {
        let mut out = encode_npy(&vec![0.0; n], &[n]);
        out.truncate(out.len() - 4 * n);
        let at = out.windows(3).position(|w| w == b"<f4").expect("descr");
        out[at..at + 3].copy_from_slice(descr.as_bytes());
        out.extend(data);
        out
    }

    #[test]
    fn round_trips_f32_npy() {
        let values = [1.0f32, -2.5, 3.0, 0.5];
        let (read, shape) = parse_npy(&encode_npy(&values, &[1, 2, 2])).unwrap();
        assert_eq!(shape, vec![1, 2, 2]);
        assert_eq!(read, values);
        let (read, shape) = parse_npy(&encode_npy(&values, &[4])).unwrap();
        assert_eq!((read.len(), shape), (4, vec![4]));
    }

    #[test]
    fn rejects_truncated_and_wrong_dtype() {
        let mut short = encode_npy(&[0.0; 4], &[1, 2, 2]);
        short.truncate(short.len() - 4);
        assert!(parse_npy(&short).unwrap_err().contains("needs 16 bytes"));
        assert!(parse_npy(&npy("<i8", &[0u8; 16], 2))
            .unwrap_err()
            .contains("not supported"));
        assert!(parse_npy(b"hello world").is_err());
    }
}
