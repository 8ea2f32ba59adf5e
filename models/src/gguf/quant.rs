//! GGML's tensor types and their dequantization, block by block.
//!
//! Each quantized type packs a block of 32 (or 256, the "K" types) values with one or more f16
//! scales; a row of a weight is a run of whole blocks. The formulas follow gguf-py's
//! `gguf.quants` step for step (the same f32 products, in the same order, no fused multiply-add),
//! so every value equals what `gguf.quants.dequantize` gives, bit for bit.

use half::f16;

/// Values in one block of the "K" types.
const QK_K: usize = 256;

/// A GGML tensor type this crate reads, named as GGML names them.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl GgmlType {
    /// The type with GGML's numeric id `id`, or `None` for one this crate does not read (the
    /// I-quants, ternary and FP4 types, and ids GGML never assigned).
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2_K,
            11 => Self::Q3_K,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// GGML's name for a numeric type id, for messages about types this crate does not read.
    pub fn name_of_id(id: u32) -> &'static str {
        match id {
            9 => "Q8_1",
            15 => "Q8_K",
            16..=23 | 29 => "an I-quant (IQ*)",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            34 | 35 => "a ternary type (TQ*)",
            39 | 40 => "an FP4 type",
            _ => "an unknown type",
        }
    }

    /// Values per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q2_K => (QK_K, 84),
            Self::Q3_K => (QK_K, 110),
            Self::Q4_K => (QK_K, 144),
            Self::Q5_K => (QK_K, 176),
            Self::Q6_K => (QK_K, 210),
        }
    }

    /// Whether values are stored in blocks with scales (not plain floats).
    pub fn is_quantized(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }

    /// Bytes of a row of `values` values, or `None` when the row is not a whole number of
    /// blocks (or its size overflows).
    pub fn row_bytes(self, values: usize) -> Option<usize> {
        let (block, bytes) = self.block();
        values
            .is_multiple_of(block)
            .then(|| (values / block).checked_mul(bytes))
            .flatten()
    }

    /// Dequantizes whole blocks: `out.len()` values from `bytes` (which holds exactly their
    /// blocks).
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        let (block, size) = self.block();
        debug_assert_eq!(bytes.len() / size * block, out.len());
        let blocks = bytes.chunks_exact(size).zip(out.chunks_exact_mut(block));
        match self {
            Self::F32 => {
                blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            Self::F16 => blocks.for_each(|(b, o)| o[0] = half_at(b, 0)),
            Self::BF16 => {
                blocks.for_each(|(b, o)| o[0] = f32::from_bits(u32::from(u16_at(b, 0)) << 16))
            }
            Self::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
            Self::Q4_1 => blocks.for_each(|(b, o)| q4_1(b, o)),
            Self::Q5_0 => blocks.for_each(|(b, o)| q5_0(b, o)),
            Self::Q5_1 => blocks.for_each(|(b, o)| q5_1(b, o)),
            Self::Q8_0 => blocks.for_each(|(b, o)| q8_0(b, o)),
            Self::Q2_K => blocks.for_each(|(b, o)| q2_k(b, o)),
            Self::Q3_K => blocks.for_each(|(b, o)| q3_k(b, o)),
            Self::Q4_K => blocks.for_each(|(b, o)| q4_k(b, o)),
            Self::Q5_K => blocks.for_each(|(b, o)| q5_k(b, o)),
            Self::Q6_K => blocks.for_each(|(b, o)| q6_k(b, o)),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian f16 at byte `at`, widened (exactly) to f32.
pub(super) fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16_at(b, at)).to_f32()
}

/// The `i`-th of 32 four-bit values packed as 16 low nibbles then 16 high nibbles.
pub(super) fn nibble(qs: &[u8], i: usize) -> u8 {
    (qs[i % 16] >> (4 * (i / 16))) & 0x0F
}

fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    for (i, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(nibble(&b[2..], i) as i8 - 8);
    }
}

fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (i, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(nibble(&b[4..], i)) + m;
    }
}

/// The `i`-th of 32 five-bit values: a nibble, and bit `i` of the 32-bit high mask.
pub(super) fn five_bits(qh: u32, qs: &[u8], i: usize) -> u8 {
    nibble(qs, i) | ((((qh >> i) & 1) as u8) << 4)
}

fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (i, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(five_bits(qh, &b[6..], i) as i8 - 16);
    }
}

fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (i, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(five_bits(qh, &b[8..], i)) + m;
    }
}

fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// The `e`-th of 256 two-bit values packed as two 32-byte halves, each holding four shifted
/// planes.
pub(super) fn crumb(qs: &[u8], e: usize) -> u8 {
    let (half, plane, lane) = (e / 128, (e % 128) / 32, e % 32);
    (qs[half * 32 + lane] >> (2 * plane)) & 3
}

fn q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for (e, o) in out.iter_mut().enumerate() {
        let s = scales[e / 16];
        let dl = d * f32::from(s & 0x0F);
        let ml = dmin * f32::from(s >> 4);
        *o = dl * f32::from(crumb(qs, e)) - ml;
    }
}

fn q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    let mut dl = [0f32; 16];
    for (k, dl) in dl.iter_mut().enumerate() {
        let low = (scales[k % 8] >> (4 * (k / 8))) & 0x0F;
        let high = (scales[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *dl = d * f32::from((low | (high << 4)) as i8 - 32);
    }
    for (e, o) in out.iter_mut().enumerate() {
        let high = ((hmask[e % 32] >> (e / 32)) & 1) ^ 1;
        let q = crumb(qs, e) as i8 - (high << 2) as i8;
        *o = dl[e / 16] * f32::from(q);
    }
}

/// The eight 6-bit scales and eight 6-bit minima of a Q4_K/Q5_K block, from its 12 bytes.
pub(super) fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        m[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

/// The `e`-th of 256 four-bit values: four 32-byte chunks, low nibbles then high nibbles.
pub(super) fn nibble_k(qs: &[u8], e: usize) -> u8 {
    let j = e / 32;
    (qs[(j / 2) * 32 + e % 32] >> (4 * (j % 2))) & 0x0F
}

/// Per-32 scale (`d * sc`) and offset (`dmin * m`) of a Q4_K/Q5_K block.
fn scales_k4(b: &[u8]) -> ([f32; 8], [f32; 8]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, m) = scale_min_k4(&b[4..16]);
    (sc.map(|s| d * f32::from(s)), m.map(|m| dmin * f32::from(m)))
}

fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dm) = scales_k4(b);
    let qs = &b[16..144];
    for (e, o) in out.iter_mut().enumerate() {
        *o = d[e / 32] * f32::from(nibble_k(qs, e)) - dm[e / 32];
    }
}

fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dm) = scales_k4(b);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (e, o) in out.iter_mut().enumerate() {
        let q = nibble_k(qs, e) | (((qh[e % 32] >> (e / 32)) & 1) << 4);
        *o = d[e / 32] * f32::from(q) - dm[e / 32];
    }
}

fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    let dl: [f32; 16] = std::array::from_fn(|k| d * f32::from(scales[k] as i8));
    for (e, o) in out.iter_mut().enumerate() {
        let (half, rest) = (e / 128, e % 128);
        let low = (ql[half * 64 + rest % 64] >> (4 * (rest / 64))) & 0x0F;
        let high = crumb(qh, e);
        let q = (low | (high << 4)) as i8 - 32;
        *o = dl[e / 16] * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4_0.row_bytes(48), None);
        assert_eq!(GgmlType::F16.row_bytes(3), Some(6));
        assert_eq!(GgmlType::Q8_0.row_bytes(usize::MAX - 31), None);
    }

    #[test]
    fn q8_0_is_scale_times_value() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2] = 4;
        block[3] = (-6i8) as u8;
        let mut out = [0f32; 32];
        GgmlType::Q8_0.dequantize(&block, &mut out);
        assert_eq!(&out[..3], &[2.0, -3.0, 0.0]);
    }
}
