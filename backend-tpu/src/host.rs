//! Host bytes as PJRT buffers hold them: Burn's `TensorData` in and out of a
//! buffer, and an op's scalar as a rank-0 array. Eager and compiled mode upload
//! through these.

use std::borrow::Cow;

use burn_backend::{DType, Shape, TensorData};
use burn_ir::ScalarIr;

use crate::lowering::element_type;
use crate::pjrt::{self, Buffer, ElementType};

pub(crate) fn dims_i64(dims: &[usize]) -> Vec<i64> {
    dims.iter().map(|&d| d as i64).collect()
}

/// The PJRT element type and the data laid out as PJRT reads it.
pub(crate) fn host_layout(data: &TensorData) -> Result<(ElementType, Cow<'_, TensorData>), String> {
    match data.dtype {
        DType::Flex32 => Ok((
            ElementType::F32,
            Cow::Owned(data.clone().convert_dtype(DType::F32)),
        )),
        dtype => match element_type(dtype) {
            Some(elem) => Ok((elem, Cow::Borrowed(data))),
            None => Err(format!(
                "tensors of dtype {dtype:?} cannot live on a PJRT device"
            )),
        },
    }
}

/// A buffer as Burn data of `dtype`, read into a vector of the element
/// type (so the data is aligned for Burn without another copy).
pub(crate) fn read_buffer(buffer: &Buffer, shape: Shape, dtype: DType) -> pjrt::Result<TensorData> {
    Ok(match dtype {
        DType::F32 | DType::Flex32 => TensorData::new(buffer.to_vec::<f32>()?, shape),
        DType::F64 => TensorData::new(buffer.to_vec::<f64>()?, shape),
        DType::F16 => TensorData::new(buffer.to_vec::<half::f16>()?, shape),
        DType::BF16 => TensorData::new(buffer.to_vec::<half::bf16>()?, shape),
        DType::I64 => TensorData::new(buffer.to_vec::<i64>()?, shape),
        DType::I32 => TensorData::new(buffer.to_vec::<i32>()?, shape),
        DType::I16 => TensorData::new(buffer.to_vec::<i16>()?, shape),
        DType::I8 => TensorData::new(buffer.to_vec::<i8>()?, shape),
        DType::U64 => TensorData::new(buffer.to_vec::<u64>()?, shape),
        DType::U32 => TensorData::new(buffer.to_vec::<u32>()?, shape),
        DType::U16 => TensorData::new(buffer.to_vec::<u16>()?, shape),
        other => TensorData::from_bytes_vec(buffer.to_host()?, shape, other),
    })
}

/// A scalar as the bytes of a rank-0 array of `elem`.
pub(crate) fn scalar_bytes(scalar: ScalarIr, elem: ElementType) -> Vec<u8> {
    let (f, i, u, b) = match scalar {
        ScalarIr::Float(v) => (v, v as i64, v as u64, v != 0.0),
        ScalarIr::Int(v) => (v as f64, v, v as u64, v != 0),
        ScalarIr::UInt(v) => (v as f64, v as i64, v, v != 0),
        ScalarIr::Bool(v) => (f64::from(u8::from(v)), i64::from(v), u64::from(v), v),
    };
    match elem {
        ElementType::F32 => (f as f32).to_le_bytes().to_vec(),
        ElementType::F64 => f.to_le_bytes().to_vec(),
        ElementType::F16 => half::f16::from_f64(f).to_le_bytes().to_vec(),
        ElementType::BF16 => half::bf16::from_f64(f).to_le_bytes().to_vec(),
        ElementType::S8 => (i as i8).to_le_bytes().to_vec(),
        ElementType::S16 => (i as i16).to_le_bytes().to_vec(),
        ElementType::S32 => (i as i32).to_le_bytes().to_vec(),
        ElementType::S64 => i.to_le_bytes().to_vec(),
        ElementType::U8 => (u as u8).to_le_bytes().to_vec(),
        ElementType::U16 => (u as u16).to_le_bytes().to_vec(),
        ElementType::U32 => (u as u32).to_le_bytes().to_vec(),
        ElementType::U64 => u.to_le_bytes().to_vec(),
        ElementType::Pred => vec![u8::from(b)],
    }
}

/// Hands the heap's free memory back to the kernel (glibc's `malloc_trim`; nothing elsewhere):
/// XLA's CPU plugin keeps device buffers on the heap.
pub(crate) fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only returns free memory, under the
    // allocator's own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}
