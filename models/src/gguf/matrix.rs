//! A quantized 2-D weight kept in its GGML blocks.

use rayon::prelude::*;

use super::blocks::IntegerBlocks;
use super::quant::GgmlType;

/// A `[rows, cols]` matrix stored row by row in GGML blocks, usually the memory-mapped bytes of
/// the file itself. For a Linear layer the rows are the output features, as in the checkpoint.
#[derive(Clone)]
pub struct QuantizedMatrix {
    kind: GgmlType,
    rows: usize,
    cols: usize,
    bytes: bytes::Bytes,
}

impl std::fmt::Debug for QuantizedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantizedMatrix({} [{}, {}])",
            self.kind, self.rows, self.cols
        )
    }
}

impl QuantizedMatrix {
    /// `bytes` must hold exactly `rows` rows of `cols` values of `kind` (the caller checked it
    /// against the file); `None` otherwise.
    pub fn new(kind: GgmlType, rows: usize, cols: usize, bytes: bytes::Bytes) -> Option<Self> {
        let row_bytes = kind.row_bytes(cols)?;
        (row_bytes.checked_mul(rows)? == bytes.len()).then_some(Self {
            kind,
            rows,
            cols,
            bytes,
        })
    }

    pub fn kind(&self) -> GgmlType {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the blocks take.
    pub fn stored_bytes(&self) -> usize {
        self.bytes.len()
    }

    fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }

    /// Dequantizes rows `start..start + out.len() / cols` into `out`, row-major.
    pub fn dequantize_rows(&self, start: usize, out: &mut [f32]) {
        let count = out.len() / self.cols.max(1);
        let rb = self.row_bytes();
        self.kind
            .dequantize(&self.bytes[start * rb..(start + count) * rb], out);
    }

    /// The matrix as integers with per-group scales and offsets ([`IntegerBlocks`]), row-major,
    /// rows converted in parallel.
    pub fn integer_blocks(&self) -> IntegerBlocks {
        let rb = self.row_bytes().max(1);
        let parts: Vec<IntegerBlocks> = self
            .bytes
            .par_chunks(rb * 16)
            .filter_map(|rows| self.kind.integer_blocks(rows))
            .collect();
        let group = self.kind.group().unwrap_or(1);
        let mut all = IntegerBlocks {
            group,
            values: Vec::with_capacity(self.rows * self.cols),
            scales: Vec::with_capacity(self.rows * self.cols / group),
            offsets: parts
                .first()
                .and_then(|p| p.offsets.as_ref())
                .map(|_| Vec::new()),
        };
        for part in parts {
            all.values.extend_from_slice(&part.values);
            all.scales.extend_from_slice(&part.scales);
            if let (Some(all), Some(part)) = (&mut all.offsets, &part.offsets) {
                all.extend_from_slice(part);
            }
        }
        all
    }

    /// The whole matrix in f32, row-major, rows dequantized in parallel.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        let cols = self.cols.max(1);
        out.par_chunks_mut(cols * 16)
            .enumerate()
            .for_each(|(i, chunk)| self.dequantize_rows(i * 16, chunk));
        out
    }
}
