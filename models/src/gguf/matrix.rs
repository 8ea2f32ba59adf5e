//! A quantized 2-D weight kept in its GGML blocks.

use rayon::prelude::*;

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
