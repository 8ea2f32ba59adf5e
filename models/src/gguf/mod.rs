//! GGUF files: the container ([`file`]) and GGML's quantized tensor types ([`quant`]).
//!
//! A GGUF file is read into [`crate::Weights`] like a safetensors file, its tensors named as in
//! the file: dense tensors (F32, F16, BF16) are used as stored, and quantized 2-D weights stay
//! in their blocks ([`QuantizedMatrix`]), dequantized inside the matrix product on the CPU; on
//! other devices they are held as small integers with their scales ([`blocks`]) and
//! dequantized by the program itself.

pub mod blocks;
pub mod file;
pub mod matrix;
pub mod quant;

pub use blocks::IntegerBlocks;
pub use file::{GgufFile, GgufTensor, MetaValue};
pub use matrix::QuantizedMatrix;
pub use quant::GgmlType;
