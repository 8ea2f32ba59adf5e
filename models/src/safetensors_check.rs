//! A safetensors header check of our own, run before the safetensors crate parses a file.
//!
//! Checkpoints come from strangers, so a header is untrusted input. The safetensors crate
//! rejects most bad files but names the fault vaguely (`invalid shape, data type, or offset for
//! tensor`) and silently keeps the last of two entries with the same name. This check reads the
//! header as plain JSON, with bounded nesting, and says exactly what is wrong and where: which
//! tensor, which offsets, how many bytes were claimed and how many exist. Nothing here allocates
//! in proportion to a shape: sizes are computed in `u128` and compared with the file's length.

use std::collections::HashSet;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// The safetensors crate's own limit on the header's size.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks the header of the safetensors file `bytes` (the whole file); returns what is wrong.
pub fn check_header(bytes: &[u8]) -> Result<(), String> {
    let file_len = bytes.len() as u64;
    let Some(len_bytes) = bytes.first_chunk::<8>() else {
        return Err(format!(
            "the file is {file_len} bytes long, shorter than the 8-byte header length that \
             starts every safetensors file"
        ));
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    if header_len > file_len - 8 {
        return Err(format!(
            "the header length field says {header_len} bytes, but only {} bytes follow it",
            file_len - 8
        ));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(format!(
            "the header is {header_len} bytes, over safetensors' limit of {MAX_HEADER_BYTES}"
        ));
    }
    let header = &bytes[8..8 + header_len as usize];
    let text = std::str::from_utf8(header).map_err(|e| {
        format!(
            "the header is not UTF-8 text (invalid byte at header offset {})",
            e.valid_up_to()
        )
    })?;
    // Duplicate names first: a JSON map keeps only the last of them.
    let mut de = serde_json::Deserializer::from_str(text);
    let duplicate = de
        .deserialize_map(DuplicateKeys)
        .map_err(|e| format!("the header is not a valid JSON object: {e}"))?;
    match duplicate {
        Some(Duplicate::Name(name)) => {
            return Err(format!(
                "tensor `{name}` is listed twice in the header; a loader would silently keep one"
            ))
        }
        Some(Duplicate::Field { entry, field }) => {
            return Err(format!(
                "header entry `{entry}` gives `{field}` twice; a loader would have to pick one"
            ))
        }
        None => {}
    }
    let value: Value = serde_json::from_str(text)
        .map_err(|e| format!("the header is not a valid JSON object: {e}"))?;
    let Value::Object(entries) = value else {
        return Err("the header is not a JSON object".into());
    };
    let data_len = (file_len - 8 - header_len) as u128;
    let mut spans = Vec::with_capacity(entries.len());
    for (name, entry) in &entries {
        if name == "__metadata__" {
            check_metadata(entry)?;
            continue;
        }
        let (start, end) = check_tensor(name, entry)?;
        if end > data_len {
            return Err(format!(
                "tensor `{name}`: data offsets [{start}, {end}) reach past the end of the data \
                 ({data_len} bytes); the file is truncated or the header is wrong"
            ));
        }
        spans.push((start, end, name.as_str()));
    }
    spans.sort_unstable();
    let mut covered = 0u128;
    let mut previous: Option<&str> = None;
    for &(start, end, name) in &spans {
        if start < covered {
            return Err(format!(
                "tensors `{}` and `{name}` overlap (`{name}` starts at byte {start}, before byte \
                 {covered} where `{}` ends)",
                previous.unwrap_or_default(),
                previous.unwrap_or_default()
            ));
        }
        if start > covered {
            return Err(format!(
                "bytes [{covered}, {start}) of the data belong to no tensor (before `{name}`)"
            ));
        }
        covered = end;
        previous = Some(name);
    }
    if covered != data_len {
        return Err(format!(
            "the tensors cover {covered} bytes of data, but the file holds {data_len}: the file \
             has trailing bytes or lost some"
        ));
    }
    Ok(())
}

/// Validates one tensor entry; returns its data offsets.
fn check_tensor(name: &str, entry: &Value) -> Result<(u128, u128), String> {
    let bad = |what: &str| format!("tensor `{name}`: {what}");
    let Value::Object(fields) = entry else {
        return Err(bad(
            "the entry is not an object with dtype, shape and data_offsets",
        ));
    };
    let dtype = fields
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`dtype` is missing or not a string"))?;
    let bits = dtype_bits(dtype).ok_or_else(|| bad(&format!("unknown dtype `{dtype}`")))?;
    let shape = fields
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("`shape` is missing or not a list"))?;
    let mut elements: u128 = 1;
    for dim in shape {
        let d = dim
            .as_u64()
            .ok_or_else(|| bad(&format!("shape entry {dim} is not a non-negative integer")))?;
        // Saturate: any product past 2^64 is absurd for a file and is caught below.
        elements = elements.saturating_mul(d as u128).min(u64::MAX as u128 + 1);
    }
    let offsets = fields
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|o| o.len() == 2)
        .ok_or_else(|| bad("`data_offsets` is missing or not a pair [start, end]"))?;
    let offset = |v: &Value| {
        v.as_u64()
            .map(u128::from)
            .ok_or_else(|| bad(&format!("data offset {v} is not a non-negative integer")))
    };
    let (start, end) = (offset(&offsets[0])?, offset(&offsets[1])?);
    if end < start {
        return Err(bad(&format!(
            "data offsets [{start}, {end}) end before they start"
        )));
    }
    let bits_needed = elements * bits;
    if !bits_needed.is_multiple_of(8) {
        return Err(bad(&format!(
            "{elements} elements of {dtype} do not fill whole bytes"
        )));
    }
    let needed = bits_needed / 8;
    if needed != end - start {
        return Err(bad(&format!(
            "dtype {dtype} and shape {shape:?} need {needed} bytes, but its data offsets \
             [{start}, {end}) span {}",
            end - start
        )));
    }
    Ok((start, end))
}

/// `__metadata__` must map strings to strings, as the format says.
fn check_metadata(entry: &Value) -> Result<(), String> {
    let Value::Object(fields) = entry else {
        return Err("`__metadata__` is not an object of strings".into());
    };
    match fields.iter().find(|(_, v)| !v.is_string()) {
        Some((k, _)) => Err(format!("`__metadata__` entry `{k}` is not a string")),
        None => Ok(()),
    }
}

/// Bits per element of a safetensors dtype name.
fn dtype_bits(dtype: &str) -> Option<u128> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// Walks the header's top-level object and returns the first repeated name (values are
/// skipped, within serde_json's nesting limit).
struct DuplicateKeys;

/// What a header names twice: an entry, or a field within one entry.
enum Duplicate {
    Name(String),
    Field { entry: String, field: String },
}

impl<'de> Visitor<'de> for DuplicateKeys {
    type Value = Option<Duplicate>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<Duplicate>, A::Error> {
        let mut seen = HashSet::new();
        let mut duplicate = None;
        while let Some(key) = map.next_key::<String>()? {
            let field = map.next_value_seed(EntryFields)?;
            if duplicate.is_some() {
                continue;
            }
            if !seen.insert(key.clone()) {
                duplicate = Some(Duplicate::Name(key));
            } else if let Some(field) = field {
                duplicate = Some(Duplicate::Field { entry: key, field });
            }
        }
        Ok(duplicate)
    }
}

/// An entry's value (a tensor's `dtype`/`shape`/`data_offsets`, or `__metadata__`): the first
/// field an object gives twice; any other value is skipped.
struct EntryFields;

impl<'de> DeserializeSeed<'de> for EntryFields {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EntryFields {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<String>, A::Error> {
        let mut seen = HashSet::new();
        let mut duplicate = None;
        while let Some(key) = map.next_key::<String>()? {
            map.next_value::<IgnoredAny>()?;
            if duplicate.is_none() && !seen.insert(key.clone()) {
                duplicate = Some(key);
            }
        }
        Ok(duplicate)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<String>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Option<String>, E> {
        Ok(None)
    }
}
