//! A checkpoint tensor's stored bytes as Burn [`TensorData`] in the float dtype a model holds
//! its weights in.
//!
//! When the file stores the tensor in that dtype (an f32 checkpoint loaded in f32, an fp16
//! variant loaded in f16), the tensor's storage is the memory-mapped file itself: nothing is
//! copied or converted at load, the pages are read from the page cache when a layer first uses
//! them, and a backend that writes into a weight gets its own copy first (copy on write). When
//! the dtypes differ, the values are converted once, straight from the stored type into the
//! target (no f32 detour for bf16 or f16 targets), in parallel for large tensors; a bf16 copy
//! starts on a cache line, so the AMX product reads its rows in place as whole lines.

use burn::tensor::{AllocationProperty, Bytes, DType, FloatDType, TensorData};
use half::{bf16, f16};
use std::borrow::Cow;
use std::mem::MaybeUninit;

use crate::cpu::aligned::Aligned;
use crate::cpu::common::{round_bf16, widen_f16};

/// The float types oxidiff reads from a checkpoint, as stored (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    F32,
    F16,
    BF16,
    F64,
}

impl Stored {
    /// The stored type of a safetensors dtype, or `None` for one oxidiff cannot load.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(Self::F32),
            safetensors::Dtype::F16 => Some(Self::F16),
            safetensors::Dtype::BF16 => Some(Self::BF16),
            safetensors::Dtype::F64 => Some(Self::F64),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::F64 => 8,
        }
    }

    /// The Burn dtype a tensor holding these bytes as they are has.
    fn burn_dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
            Self::F64 => DType::F64,
        }
    }
}

/// A tensor of zeros held in `dtype` (see [`held_dtype`]): zeroed pages from the allocator,
/// untouched until read.
pub(crate) fn zeros(shape: Vec<usize>, dtype: FloatDType) -> TensorData {
    let dtype = held_dtype(dtype);
    let bytes = shape.iter().product::<usize>() * dtype.size();
    TensorData::from_bytes_vec(vec![0u8; bytes], shape, dtype)
}

/// The dtype weights are held in: f32, f16 or bf16 (Burn's `Flex32` is held as f32; f64 too,
/// since no model here computes in it).
fn held_dtype(dtype: FloatDType) -> DType {
    match dtype {
        FloatDType::F16 => DType::F16,
        FloatDType::BF16 => DType::BF16,
        FloatDType::F32 | FloatDType::Flex32 | FloatDType::F64 => DType::F32,
    }
}

/// One element type weights are converted into.
trait Target: bytemuck::Pod + Send + Sync {
    fn from_f32(v: f32) -> Self;
}

impl Target for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Target for f16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Target for bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        round_bf16(v)
    }
}

// Checkpoints are little-endian; the stored bytes are read as the host's own numbers.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "oxidiff reads checkpoints on little-endian hosts only"
);

/// The stored values as a typed slice: in place when the bytes are aligned for `S`, else
/// copied once (a checkpoint may place a tensor at any offset).
fn typed<S: bytemuck::Pod>(bytes: &[u8]) -> Cow<'_, [S]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(values) => Cow::Borrowed(values),
        Err(_) => Cow::Owned(
            bytes
                .chunks_exact(std::mem::size_of::<S>())
                .map(bytemuck::pod_read_unaligned)
                .collect(),
        ),
    }
}

/// `bytes` (stored as `stored`) converted element by element into `T` in parallel, rounding
/// to nearest even as PyTorch's `tensor.to(dtype)` does.
fn convert<T: Target>(bytes: &[u8], stored: Stored) -> Vec<T> {
    let len = bytes.len() / stored.size();
    let mut out: Vec<T> = Vec::with_capacity(len);
    convert_into(bytes, stored, &mut out.spare_capacity_mut()[..len]);
    // SAFETY: `convert_into` wrote every one of the first `len` elements.
    unsafe { out.set_len(len) };
    out
}

/// [`convert`] into memory that starts on a cache line: bf16 weights that the AMX product
/// reads in place (its tile rows then start on cache lines; see [`crate::cpu::aligned`]).
fn convert_aligned<T: Target>(bytes: &[u8], stored: Stored) -> Aligned<T> {
    let len = bytes.len() / stored.size();
    // SAFETY: `convert_into` writes every one of the `len` values.
    unsafe { Aligned::from_uninit_mapped(len, |out| convert_into(bytes, stored, out)) }
}

/// [`convert`] into `out`, which holds one element for each stored value; every element of
/// `out` is written.
fn convert_into<T: Target>(bytes: &[u8], stored: Stored, out: &mut [MaybeUninit<T>]) {
    match stored {
        Stored::F32 => map(&typed::<f32>(bytes), T::from_f32, out),
        Stored::F16 => map_f16(&typed::<f16>(bytes), out),
        Stored::BF16 => map(&typed::<bf16>(bytes), |v| T::from_f32(v.to_f32()), out),
        Stored::F64 => map(&typed::<f64>(bytes), |v| T::from_f32(v as f32), out),
    }
}

/// `src` mapped through `f` into `out` (as long as `src`), in parallel chunks, each element
/// written once (no zeroing pass first: faulting in fresh pages is a large part of a
/// conversion's cost).
fn map<S: Sync + Copy, D: Send + Copy>(
    src: &[S],
    f: impl Fn(S) -> D + Sync,
    out: &mut [MaybeUninit<D>],
) {
    use rayon::prelude::*;
    assert_eq!(out.len(), src.len());
    let chunk = (16 * 1024).max(src.len().div_ceil(4 * rayon::current_num_threads().max(1)));
    out.par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(d, s)| {
            crate::cpu::simd::vectorize!({
                for (d, s) in d.iter_mut().zip(s) {
                    d.write(f(*s));
                }
            })
        });
}

/// f16 `src` converted into `out` (as long as `src`): widened a block at a time
/// ([`widen_f16`]), then each value put into `T`.
fn map_f16<T: Target>(src: &[f16], out: &mut [MaybeUninit<T>]) {
    use rayon::prelude::*;
    const BLOCK: usize = 1024;
    assert_eq!(out.len(), src.len());
    out.par_chunks_mut(64 * BLOCK)
        .zip(src.par_chunks(64 * BLOCK))
        .for_each(|(dst, src)| {
            let mut wide = [0f32; BLOCK];
            for (dst, src) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
                let wide = &mut wide[..src.len()];
                widen_f16(src, wide);
                crate::cpu::simd::vectorize!({
                    for (d, &v) in dst.iter_mut().zip(wide.iter()) {
                        d.write(T::from_f32(v));
                    }
                })
            }
        });
}

/// The values of `bytes` (stored as `stored`) as f32.
pub(crate) fn to_f32(bytes: &[u8], stored: Stored) -> Vec<f32> {
    convert(bytes, stored)
}

/// Whether `bytes` can be the storage of a tensor of its stored type as it is: aligned for the
/// element type (a checkpoint may place a tensor at any offset).
fn shareable(bytes: &[u8], stored: Stored) -> bool {
    (bytes.as_ptr() as usize).is_multiple_of(stored.size())
}

/// Whether [`tensor_data`] would hold `bytes` (stored as `stored`) in `dtype` as they are,
/// converting nothing.
pub(crate) fn shares(bytes: &[u8], stored: Stored, dtype: FloatDType) -> bool {
    held_dtype(dtype) == stored.burn_dtype() && shareable(bytes, stored)
}

/// Tensor data of `shape` from `bytes` (stored as `stored`), held in `dtype`: the mapped bytes
/// themselves (`share` makes the shared handle) when they can be, else one converted copy.
/// Returns whether the data was shared.
pub(crate) fn tensor_data(
    bytes: &[u8],
    stored: Stored,
    shape: Vec<usize>,
    dtype: FloatDType,
    share: impl FnOnce() -> bytes::Bytes,
) -> (TensorData, bool) {
    let held = held_dtype(dtype);
    if shares(bytes, stored, dtype) {
        let shared = Bytes::from_shared(share(), AllocationProperty::File);
        return (TensorData::from_bytes(shared, shape, held), true);
    }
    let data = match held {
        DType::F16 => TensorData::new(convert::<f16>(bytes, stored), shape),
        DType::BF16 => {
            let aligned = bytes::Bytes::from_owner(convert_aligned::<bf16>(bytes, stored));
            TensorData::from_bytes(
                Bytes::from_shared(aligned, AllocationProperty::Native),
                shape,
                held,
            )
        }
        _ => TensorData::new(convert::<f32>(bytes, stored), shape),
    };
    (data, false)
}

/// `values` `[rows, cols]` transposed to `[cols, rows]`, in cache-sized tiles.
pub(crate) fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 64;
    let mut out = vec![0f32; values.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    out[c * rows + r] = values[r * cols + c];
                }
            }
        }
    }
    out
}

/// f32 `values` of `shape` held in `dtype`.
pub(crate) fn from_f32(values: Vec<f32>, shape: Vec<usize>, dtype: FloatDType) -> TensorData {
    match held_dtype(dtype) {
        DType::F16 => TensorData::new(values.into_iter().map(f16::from_f32).collect(), shape),
        DType::BF16 => TensorData::new(values.into_iter().map(bf16::from_f32).collect(), shape),
        _ => TensorData::new(values, shape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T: bytemuck::Pod>(values: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(values).to_vec()
    }

    #[test]
    fn every_stored_type_converts_into_every_held_type_rounding_to_nearest_even() {
        // 1 + 2^-8 + 2^-12 lies between two bf16 values and rounds up; 1 + 2^-8 is a tie that
        // rounds to even (down); 65520 overflows f16 to infinity.
        let values = [
            1.0f32 + 1.0 / 256.0 + 1.0 / 4096.0,
            1.0 + 1.0 / 256.0,
            65520.0,
            -0.0,
        ];
        let f32_bytes = bytes_of(&values);
        let bf16_out: Vec<bf16> = convert(&f32_bytes, Stored::F32);
        let expected: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(bf16_out, expected);
        assert_eq!(bf16_out[0].to_f32(), 1.0 + 2.0 / 256.0);
        assert_eq!(bf16_out[1].to_f32(), 1.0);
        let f16_out: Vec<f16> = convert(&f32_bytes, Stored::F32);
        assert!(f16_out[2].is_infinite());

        let halves = [f16::from_f32(0.5), f16::from_f32(-3.25), f16::MAX];
        let widened: Vec<f32> = convert(&bytes_of(&halves), Stored::F16);
        assert_eq!(widened, vec![0.5, -3.25, 65504.0]);
        let as_bf16: Vec<bf16> = convert(&bytes_of(&halves), Stored::F16);
        assert_eq!(
            as_bf16,
            widened
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect::<Vec<_>>()
        );

        let doubles = [0.1f64, -2.5];
        let narrowed: Vec<f32> = convert(&bytes_of(&doubles), Stored::F64);
        assert_eq!(narrowed, vec![0.1f32, -2.5]);
    }

    #[test]
    fn large_tensors_convert_in_parallel_to_the_same_values() {
        let values: Vec<f32> = (0..300_017).map(|i| i as f32 * 0.37 - 9.0).collect();
        let out: Vec<bf16> = convert(&bytes_of(&values), Stored::F32);
        assert_eq!(out.len(), values.len());
        // Misaligned by one byte: the same values through the copied path.
        let mut odd = vec![0u8; 1];
        odd.extend_from_slice(&bytes_of(&values));
        assert_eq!(convert::<bf16>(&odd[1..], Stored::F32), out);
        assert!(out
            .iter()
            .zip(&values)
            .all(|(o, v)| *o == bf16::from_f32(*v)));
    }

    #[test]
    fn a_tensor_in_its_stored_dtype_shares_the_bytes_and_a_misaligned_one_is_copied() {
        let values = [1.5f32, -2.0, 3.25];
        let mut words = vec![0u32; 4];
        words[..3].copy_from_slice(bytemuck::cast_slice(&values));
        let all: &[u8] = bytemuck::cast_slice(&words);
        let aligned = &all[..12];
        let shared = || bytes::Bytes::copy_from_slice(aligned);
        let (data, was_shared) =
            tensor_data(aligned, Stored::F32, vec![3], FloatDType::F32, shared);
        assert!(was_shared);
        assert_eq!(data.to_vec::<f32>().unwrap(), values);

        // One byte off: f32 elements are not aligned, so the data is converted into a copy.
        let mut odd = vec![0u32; 4];
        bytemuck::cast_slice_mut::<u32, u8>(&mut odd)[1..13].copy_from_slice(&bytes_of(&values));
        let odd: &[u8] = bytemuck::cast_slice(&odd);
        let (data, was_shared) =
            tensor_data(&odd[1..13], Stored::F32, vec![3], FloatDType::F32, || {
                unreachable!("misaligned bytes are never shared")
            });
        assert!(!was_shared);
        assert_eq!(data.to_vec::<f32>().unwrap(), values);

        let (data, was_shared) = tensor_data(
            aligned,
            Stored::F32,
            vec![3],
            FloatDType::BF16,
            || unreachable!(),
        );
        assert!(!was_shared);
        assert_eq!(data.dtype, DType::BF16);
        assert_eq!(data.to_vec::<bf16>().unwrap(), values.map(bf16::from_f32));
    }
}
