//! The GGUF container: a header, typed key-value metadata, tensor descriptions, then the
//! aligned tensor data (versions 2 and 3, little-endian).
//!
//! Every count and length in the header is checked against the bytes left in the file before
//! anything is allocated for it, so a corrupt or hostile header ends in an error naming the file,
//! not in a huge allocation. Arrays in the metadata are skipped, not kept (oxidiff reads only
//! scalar and string values, and a vocabulary array would cost far more memory than its bytes).

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::quant::GgmlType;
use crate::error::{ModelError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
/// GGML's limit on a tensor's dimensions.
const MAX_DIMS: usize = 4;
/// How deep arrays of arrays may nest in the metadata.
const MAX_NESTING: usize = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value oxidiff keeps.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// An array, skipped: its element type id and length.
    Array {
        element: u32,
        len: u64,
    },
}

/// One tensor's description.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// In PyTorch's order (outermost first), the reverse of GGUF's `ne`.
    pub shape: Vec<usize>,
    pub kind: GgmlType,
    /// Byte range in the file.
    pub start: usize,
    pub end: usize,
}

/// A memory-mapped GGUF file with its parsed, validated header.
pub struct GgufFile {
    pub path: PathBuf,
    pub mmap: Mmap,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<GgufTensor>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: read-only map of a file nobody should change while a model uses it; every
        // read below is bounds-checked against the map's length.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (metadata, tensors) = parse(&mmap).map_err(|reason| ModelError::Gguf {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            metadata,
            tensors,
        })
    }

    /// A string value of the metadata.
    pub fn meta_str(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key)? {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Reads the header of a GGUF file held in `bytes`.
fn parse(
    bytes: &[u8],
) -> std::result::Result<(BTreeMap<String, MetaValue>, Vec<GgufTensor>), String> {
    let mut r = Reader { bytes, at: 0 };
    if r.take(4)? != MAGIC {
        return Err("it does not start with `GGUF`; it is not a GGUF file".into());
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!(
            "GGUF version {version}; oxidiff reads versions 2 and 3 (convert the file again \
             with a current gguf-py or llama.cpp)"
        ));
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    // A key-value pair takes at least 12 bytes, a tensor description at least 24.
    r.fits(kv_count, 12, "metadata entries")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key = r.string()?;
        let kind = r.u32()?;
        let value = r
            .value(kind, 0)
            .map_err(|e| format!("metadata `{key}`: {e}"))?;
        metadata.insert(key, value);
    }
    r.fits(tensor_count, 24, "tensor descriptions")?;
    let mut raw = Vec::new();
    let mut names = HashSet::new();
    for _ in 0..tensor_count {
        let name = r.string()?;
        let dims = r.u32()? as usize;
        if dims == 0 || dims > MAX_DIMS {
            return Err(format!(
                "tensor `{name}` has {dims} dimensions (GGML allows 1 to {MAX_DIMS})"
            ));
        }
        let mut ne = Vec::with_capacity(dims);
        for _ in 0..dims {
            ne.push(r.u64()?);
        }
        let type_id = r.u32()?;
        let offset = r.u64()?;
        let kind = GgmlType::from_id(type_id).ok_or_else(|| {
            format!(
                "tensor `{name}` is of GGML type {type_id} ({}), which oxidiff does not read \
                 (it reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K): \
                 use a file quantized to one of those",
                GgmlType::name_of_id(type_id)
            )
        })?;
        if !names.insert(name.clone()) {
            return Err(format!("tensor `{name}` is described twice"));
        }
        raw.push((name, ne, kind, offset));
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(MetaValue::UInt(a)) if *a > 0 && a.is_power_of_two() => *a,
        Some(other) => {
            return Err(format!(
                "`general.alignment` is {other:?}, not a power of two"
            ))
        }
    };
    let data_start = (r.at as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, ne, kind, offset) in raw {
        let too_big = || format!("tensor `{name}` with dimensions {ne:?} is too large");
        let values = ne
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n))
            .ok_or_else(too_big)?;
        let row = usize::try_from(ne[0]).map_err(|_| too_big())?;
        let row_bytes = kind.row_bytes(row).ok_or_else(|| {
            format!(
                "tensor `{name}` has rows of {row} values, not a whole number of {kind} blocks \
                 of {}",
                kind.block().0
            )
        })? as u64;
        let size = (values / ne[0].max(1))
            .checked_mul(row_bytes)
            .ok_or_else(too_big)?;
        let start = data_start.checked_add(offset).ok_or_else(too_big)?;
        let end = start.checked_add(size).ok_or_else(too_big)?;
        if end > bytes.len() as u64 {
            return Err(format!(
                "tensor `{name}` ({kind}, dimensions {ne:?}) needs bytes {start}..{end}, but the \
                 file has {} bytes; it is truncated or corrupt: download it again",
                bytes.len()
            ));
        }
        let shape = ne.iter().rev().map(|&n| n as usize).collect();
        tensors.push(GgufTensor {
            name,
            shape,
            kind,
            start: start as usize,
            end: end as usize,
        });
    }
    Ok((metadata, tensors))
}

/// A cursor over the header, every read bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> std::result::Result<&'a [u8], String> {
        let left = (self.bytes.len() - self.at) as u64;
        if n > left {
            return Err(format!(
                "the header needs {n} more bytes at offset {}, but the file ends {left} bytes \
                 later; it is truncated or corrupt",
                self.at
            ));
        }
        let out = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(out)
    }

    /// Errors unless `count` items of at least `min_size` bytes each can fit in what is left.
    fn fits(&self, count: u64, min_size: u64, what: &str) -> std::result::Result<(), String> {
        let left = (self.bytes.len() - self.at) as u64;
        if count.checked_mul(min_size).is_none_or(|n| n > left) {
            return Err(format!(
                "the header announces {count} {what}, more than the {left} bytes left in the \
                 file can hold; it is corrupt"
            ));
        }
        Ok(())
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.u64()?;
        let raw = self.take(len)?;
        String::from_utf8(raw.to_vec()).map_err(|_| "a string is not UTF-8".to_string())
    }

    /// Bytes of one value of scalar type `kind`, or `None` for strings and arrays.
    fn scalar_size(kind: u32) -> Option<u64> {
        match kind {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    fn value(&mut self, kind: u32, depth: usize) -> std::result::Result<MetaValue, String> {
        Ok(match kind {
            0 => MetaValue::UInt(u64::from(self.take(1)?[0])),
            1 => MetaValue::Int(i64::from(self.take(1)?[0] as i8)),
            2 => {
                let b = self.take(2)?;
                MetaValue::UInt(u64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            3 => {
                let b = self.take(2)?;
                MetaValue::Int(i64::from(i16::from_le_bytes([b[0], b[1]])))
            }
            4 => MetaValue::UInt(u64::from(self.u32()?)),
            5 => MetaValue::Int(i64::from(self.u32()? as i32)),
            6 => MetaValue::Float(f64::from(f32::from_bits(self.u32()?))),
            7 => MetaValue::Bool(self.take(1)?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(format!("arrays nest more than {MAX_NESTING} deep"));
                }
                let element = self.u32()?;
                let len = self.u64()?;
                match Self::scalar_size(element) {
                    Some(size) => {
                        let bytes = len
                            .checked_mul(size)
                            .ok_or("an array is too large for the file")?;
                        self.take(bytes)?;
                    }
                    None if element == 8 || element == 9 => {
                        // Each element takes at least 8 bytes (a length or a type and count).
                        self.fits(len, 8, "array elements")?;
                        for _ in 0..len {
                            self.value(element, depth + 1)?;
                        }
                    }
                    None => return Err(format!("an array of unknown value type {element}")),
                }
                MetaValue::Array { element, len }
            }
            10 => MetaValue::UInt(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64()?)),
            other => return Err(format!("unknown value type {other}")),
        })
    }
}
