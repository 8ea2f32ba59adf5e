//! GGML blocks as small integers with per-group scales and offsets, the form a quantized
//! weight takes on a PJRT device: every type this crate reads dequantizes as
//! `w = scale[g] * q - offset[g]` with `q` an `i8` (`Q8_0`'s own bytes; within `-32..=63` for
//! the others) and
//! groups of 16 or 32 values, so the device holds one byte per value plus a scale (and, for
//! the types with minima, an offset) per group, and the compiled program dequantizes with one
//! multiply and one subtract that XLA fuses into the matrix product.
//!
//! The scale and offset are the f32 numbers `gguf.quants` itself forms (`d`, `d * sc`,
//! `dmin * m`, `-m`) and `scale * q - offset` is its last step in the same order, so each
//! value equals [`GgmlType::dequantize`] bit for bit (`x - 0.0 == x` and `x + m == x - (-m)`
//! exactly).

use super::quant::{crumb, five_bits, half_at, nibble, nibble_k, scale_min_k4, GgmlType};

/// A run of whole blocks as integers, scales and offsets (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct IntegerBlocks {
    /// Values per scale.
    pub group: usize,
    /// One per value.
    pub values: Vec<i8>,
    /// One per group.
    pub scales: Vec<f32>,
    /// One per group, for the types with minima (`Q4_1`, `Q5_1`, `Q2_K`, `Q4_K`, `Q5_K`).
    pub offsets: Option<Vec<f32>>,
}

impl GgmlType {
    /// Values per scale in [`IntegerBlocks`], `None` for the plain float types.
    pub fn group(self) -> Option<usize> {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => None,
            Self::Q2_K | Self::Q3_K | Self::Q6_K => Some(16),
            _ => Some(32),
        }
    }

    /// Whether the type dequantizes with an offset per group.
    pub fn has_offsets(self) -> bool {
        matches!(
            self,
            Self::Q4_1 | Self::Q5_1 | Self::Q2_K | Self::Q4_K | Self::Q5_K
        )
    }

    /// `bytes` (whole blocks of this type) as integers, scales and offsets; `None` for the
    /// plain float types.
    pub fn integer_blocks(self, bytes: &[u8]) -> Option<IntegerBlocks> {
        let group = self.group()?;
        let (block, size) = self.block();
        let count = bytes.len() / size * block;
        let mut values = vec![0i8; count];
        let mut scales = vec![0f32; count / group];
        let mut offsets = vec![0f32; count / group];
        let per_block = block / group;
        for (k, b) in bytes.chunks_exact(size).enumerate() {
            let q = &mut values[k * block..(k + 1) * block];
            let s = &mut scales[k * per_block..(k + 1) * per_block];
            let o = &mut offsets[k * per_block..(k + 1) * per_block];
            match self {
                Self::Q4_0 => q4_0(b, q, s),
                Self::Q4_1 => q4_1(b, q, s, o),
                Self::Q5_0 => q5_0(b, q, s),
                Self::Q5_1 => q5_1(b, q, s, o),
                Self::Q8_0 => q8_0(b, q, s),
                Self::Q2_K => q2_k(b, q, s, o),
                Self::Q3_K => q3_k(b, q, s),
                Self::Q4_K => q4_k(b, q, s, o),
                Self::Q5_K => q5_k(b, q, s, o),
                Self::Q6_K => q6_k(b, q, s),
                Self::F32 | Self::F16 | Self::BF16 => return None,
            }
        }
        Some(IntegerBlocks {
            group,
            values,
            scales,
            offsets: self.has_offsets().then_some(offsets),
        })
    }
}

impl IntegerBlocks {
    /// The f32 values (`scale * q - offset`), as the device computes them.
    pub fn dequantize(&self) -> Vec<f32> {
        self.values
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let g = i / self.group;
                let w = self.scales[g] * f32::from(q);
                match &self.offsets {
                    Some(o) => w - o[g],
                    None => w,
                }
            })
            .collect()
    }
}

fn q4_0(b: &[u8], q: &mut [i8], s: &mut [f32]) {
    s[0] = half_at(b, 0);
    for (i, q) in q.iter_mut().enumerate() {
        *q = nibble(&b[2..], i) as i8 - 8;
    }
}

fn q4_1(b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    (s[0], o[0]) = (half_at(b, 0), -half_at(b, 2));
    for (i, q) in q.iter_mut().enumerate() {
        *q = nibble(&b[4..], i) as i8;
    }
}

fn q5_0(b: &[u8], q: &mut [i8], s: &mut [f32]) {
    s[0] = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (i, q) in q.iter_mut().enumerate() {
        *q = five_bits(qh, &b[6..], i) as i8 - 16;
    }
}

fn q5_1(b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    (s[0], o[0]) = (half_at(b, 0), -half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (i, q) in q.iter_mut().enumerate() {
        *q = five_bits(qh, &b[8..], i) as i8;
    }
}

fn q8_0(b: &[u8], q: &mut [i8], s: &mut [f32]) {
    s[0] = half_at(b, 0);
    for (q, &v) in q.iter_mut().zip(&b[2..34]) {
        *q = v as i8;
    }
}

fn q2_k(b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for k in 0..16 {
        s[k] = d * f32::from(scales[k] & 0x0F);
        o[k] = dmin * f32::from(scales[k] >> 4);
    }
    for (e, q) in q.iter_mut().enumerate() {
        *q = crumb(qs, e) as i8;
    }
}

fn q3_k(b: &[u8], q: &mut [i8], s: &mut [f32]) {
    let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    for (k, s) in s.iter_mut().enumerate() {
        let low = (scales[k % 8] >> (4 * (k / 8))) & 0x0F;
        let high = (scales[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *s = d * f32::from((low | (high << 4)) as i8 - 32);
    }
    for (e, q) in q.iter_mut().enumerate() {
        let high = ((hmask[e % 32] >> (e / 32)) & 1) ^ 1;
        *q = crumb(qs, e) as i8 - (high << 2) as i8;
    }
}

fn scales_k4(b: &[u8], s: &mut [f32], o: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, m) = scale_min_k4(&b[4..16]);
    for j in 0..8 {
        s[j] = d * f32::from(sc[j]);
        o[j] = dmin * f32::from(m[j]);
    }
}

fn q4_k(b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    scales_k4(b, s, o);
    let qs = &b[16..144];
    for (e, q) in q.iter_mut().enumerate() {
        *q = nibble_k(qs, e) as i8;
    }
}

fn q5_k(b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    scales_k4(b, s, o);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (e, q) in q.iter_mut().enumerate() {
        *q = (nibble_k(qs, e) | (((qh[e % 32] >> (e / 32)) & 1) << 4)) as i8;
    }
}

fn q6_k(b: &[u8], q: &mut [i8], s: &mut [f32]) {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for (k, s) in s.iter_mut().enumerate() {
        *s = d * f32::from(scales[k] as i8);
    }
    for (e, q) in q.iter_mut().enumerate() {
        let (half, rest) = (e / 128, e % 128);
        let low = (ql[half * 64 + rest % 64] >> (4 * (rest / 64))) & 0x0F;
        *q = (low | (crumb(qh, e) << 4)) as i8 - 32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// Random blocks with finite f16 scales (the scale bytes of each type rewritten).
    fn random_blocks(kind: GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
        let (_, size) = kind.block();
        let mut state = seed;
        let mut bytes: Vec<u8> = (0..blocks * size)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) as u8
            })
            .collect();
        let half_positions: &[usize] = match kind {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[],
        };
        for (k, block) in bytes.chunks_exact_mut(size).enumerate() {
            for (j, &at) in half_positions.iter().enumerate() {
                let v =
                    f16::from_f32(0.01 + 0.37 * (k + j) as f32 * if j == 1 { -1.0 } else { 1.0 });
                block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn integer_blocks_dequantize_bit_for_bit_as_the_blocks() {
        use GgmlType::*;
        for kind in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
            let bytes = random_blocks(kind, 3, kind as u64 + 1);
            let (block, _) = kind.block();
            let mut expected = vec![0f32; 3 * block];
            kind.dequantize(&bytes, &mut expected);
            let blocks = kind.integer_blocks(&bytes).unwrap();
            assert_eq!(blocks.values.len(), 3 * block);
            assert_eq!(blocks.scales.len() * blocks.group, 3 * block);
            if kind != Q8_0 {
                assert!(
                    blocks.values.iter().all(|&q| (-32..=63).contains(&q)),
                    "{kind}"
                );
            }
            let got = blocks.dequantize();
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(g.to_bits(), e.to_bits(), "{kind} value {i}: {g} vs {e}");
            }
        }
        assert!(F16.integer_blocks(&[0, 0]).is_none());
    }
}
