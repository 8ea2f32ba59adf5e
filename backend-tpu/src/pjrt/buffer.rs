//! Device buffers and their metadata: [`ElementType`] and [`Shape`] describe
//! an array, host bytes are plain `&[u8]`/`Vec<u8>` (or typed slices of a
//! [`NativeType`]), and a [`Buffer`] is the array living on one device.

use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

use super::api::{copy_slice, pjrt_call};
use super::client::{ClientInner, Device};
use super::error::{Error, Result};
use super::ffi::{self, Padded};

/// Element types oxidiff moves through PJRT (`PJRT_Buffer_Type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    Pred,
    S8,
    S16,
    S32,
    S64,
    U8,
    U16,
    U32,
    U64,
    F16,
    F32,
    F64,
    BF16,
}

impl ElementType {
    /// The `PJRT_Buffer_Type` value.
    pub fn to_raw(self) -> ffi::PJRT_Buffer_Type {
        match self {
            Self::Pred => 1,
            Self::S8 => 2,
            Self::S16 => 3,
            Self::S32 => 4,
            Self::S64 => 5,
            Self::U8 => 6,
            Self::U16 => 7,
            Self::U32 => 8,
            Self::U64 => 9,
            Self::F16 => 10,
            Self::F32 => 11,
            Self::F64 => 12,
            Self::BF16 => 13,
        }
    }

    /// The element type for a `PJRT_Buffer_Type` value.
    pub fn from_raw(raw: ffi::PJRT_Buffer_Type) -> Result<Self> {
        Ok(match raw {
            1 => Self::Pred,
            2 => Self::S8,
            3 => Self::S16,
            4 => Self::S32,
            5 => Self::S64,
            6 => Self::U8,
            7 => Self::U16,
            8 => Self::U32,
            9 => Self::U64,
            10 => Self::F16,
            11 => Self::F32,
            12 => Self::F64,
            13 => Self::BF16,
            other => return Err(Error::UnsupportedElementType(other)),
        })
    }

    /// Bytes per element in a dense host array (PRED is one byte).
    pub fn byte_size(self) -> usize {
        match self {
            Self::Pred | Self::S8 | Self::U8 => 1,
            Self::S16 | Self::U16 | Self::F16 | Self::BF16 => 2,
            Self::S32 | Self::U32 | Self::F32 => 4,
            Self::S64 | Self::U64 | Self::F64 => 8,
        }
    }

    /// The StableHLO spelling (`f32`, `bf16`, `i64`, `ui8`, `i1`).
    pub fn mlir_name(self) -> &'static str {
        match self {
            Self::Pred => "i1",
            Self::S8 => "i8",
            Self::S16 => "i16",
            Self::S32 => "i32",
            Self::S64 => "i64",
            Self::U8 => "ui8",
            Self::U16 => "ui16",
            Self::U32 => "ui32",
            Self::U64 => "ui64",
            Self::F16 => "f16",
            Self::F32 => "f32",
            Self::F64 => "f64",
            Self::BF16 => "bf16",
        }
    }
}

/// An array's element type and dimensions (row-major, dense).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub element_type: ElementType,
    pub dims: Vec<i64>,
}

impl Shape {
    pub fn new(element_type: ElementType, dims: impl Into<Vec<i64>>) -> Self {
        Self {
            element_type,
            dims: dims.into(),
        }
    }

    /// Number of elements, or an error for a negative or overflowing shape.
    pub fn element_count(&self) -> Result<usize> {
        self.dims.iter().try_fold(1usize, |acc, &d| {
            usize::try_from(d)
                .ok()
                .and_then(|d| acc.checked_mul(d))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!("invalid dimensions {:?}", self.dims))
                })
        })
    }

    /// Bytes of the dense host array.
    pub fn byte_size(&self) -> Result<usize> {
        self.element_count()?
            .checked_mul(self.element_type.byte_size())
            .ok_or_else(|| Error::InvalidArgument(format!("shape {:?} is too large", self.dims)))
    }

    /// The StableHLO tensor type, e.g. `tensor<2x3xf32>`.
    pub fn mlir_type(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            s.push_str(&format!("{d}x"));
        }
        s.push_str(self.element_type.mlir_name());
        s.push('>');
        s
    }
}

/// Host element types whose every bit pattern is a valid value, so device
/// bytes can be read into them.
///
/// # Safety
/// `Self` must have the size of `ELEMENT_TYPE`'s elements and accept any bit
/// pattern.
pub unsafe trait NativeType: Copy + Default + 'static {
    const ELEMENT_TYPE: ElementType;
}

macro_rules! native {
    ($($t:ty => $e:ident),* $(,)?) => {
        $(
            // SAFETY: a plain numeric type of the element's width; all bit
            // patterns are valid values.
            unsafe impl NativeType for $t {
                const ELEMENT_TYPE: ElementType = ElementType::$e;
            }
        )*
    };
}

native!(
    i8 => S8, i16 => S16, i32 => S32, i64 => S64,
    u8 => U8, u16 => U16, u32 => U32, u64 => U64,
    f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16,
);

/// An array on one device. Dropping it frees the device memory (after any
/// pending use of it completes).
pub struct Buffer {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut ffi::PJRT_Buffer,
}

// SAFETY: PJRT buffers may be used and destroyed from any thread (the PJRT C
// API is thread safe); `Buffer` owns its handle exclusively.
unsafe impl Send for Buffer {}
// SAFETY: every method takes `&self` to issue thread-safe PJRT calls.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Buffer");
        if let Ok(shape) = self.shape() {
            d.field("shape", &shape);
        }
        d.finish_non_exhaustive()
    }
}

impl Buffer {
    /// Wraps a buffer the client returned; takes ownership.
    pub(crate) fn from_raw(client: Arc<ClientInner>, raw: *mut ffi::PJRT_Buffer) -> Self {
        Self { client, raw }
    }

    fn api(&self) -> &super::api::Api {
        self.client.plugin.api()
    }

    /// The element type.
    pub fn element_type(&self) -> Result<ElementType> {
        let mut args = Padded::<ffi::PJRT_Buffer_ElementType_Args>::new();
        args.buffer = self.raw;
        // SAFETY: `self.raw` is a live buffer of this plugin.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_ElementType, &mut args) }?;
        ElementType::from_raw(args.type_)
    }

    /// The dimensions.
    pub fn dims(&self) -> Result<Vec<i64>> {
        let mut args = Padded::<ffi::PJRT_Buffer_Dimensions_Args>::new();
        args.buffer = self.raw;
        // SAFETY: `self.raw` is a live buffer of this plugin.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_Dimensions, &mut args) }?;
        // SAFETY: `dims` has `num_dims` values and lives as long as the buffer.
        Ok(unsafe { copy_slice(args.dims, args.num_dims) })
    }

    /// Element type and dimensions.
    pub fn shape(&self) -> Result<Shape> {
        Ok(Shape::new(self.element_type()?, self.dims()?))
    }

    /// The device holding the buffer.
    pub fn device(&self) -> Result<Device> {
        let mut args = Padded::<ffi::PJRT_Buffer_Device_Args>::new();
        args.buffer = self.raw;
        // SAFETY: `self.raw` is a live buffer of this plugin.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_Device, &mut args) }?;
        Device::from_raw(&self.client, args.device)
    }

    /// Bytes the buffer takes on the device.
    pub fn on_device_size(&self) -> Result<usize> {
        let mut args = Padded::<ffi::PJRT_Buffer_OnDeviceSizeInBytes_Args>::new();
        args.buffer = self.raw;
        // SAFETY: `self.raw` is a live buffer of this plugin.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_OnDeviceSizeInBytes, &mut args) }?;
        Ok(args.on_device_size_in_bytes)
    }

    /// Blocks until the buffer's data is computed; reports a failed
    /// computation that produced it.
    pub fn ready(&self) -> Result<()> {
        let mut args = Padded::<ffi::PJRT_Buffer_ReadyEvent_Args>::new();
        args.buffer = self.raw;
        // SAFETY: `self.raw` is a live buffer of this plugin.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_ReadyEvent, &mut args) }?;
        self.api().await_event("PJRT_Buffer_ReadyEvent", args.event)
    }

    /// Copies the buffer into host memory (dense, row-major); waits for the
    /// data if it is still being computed.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let size = self.host_size()?;
        let mut bytes = vec![0u8; size];
        self.copy_to_host(bytes.as_mut_ptr().cast(), size)?;
        Ok(bytes)
    }

    /// Copies the buffer into a host vector of its element type.
    pub fn to_vec<T: NativeType>(&self) -> Result<Vec<T>> {
        let ty = self.element_type()?;
        if ty != T::ELEMENT_TYPE {
            return Err(Error::InvalidArgument(format!(
                "buffer holds {ty:?}, not {:?}",
                T::ELEMENT_TYPE
            )));
        }
        let size = self.host_size()?;
        let elem = std::mem::size_of::<T>();
        if size % elem != 0 {
            return Err(Error::InvalidArgument(format!(
                "the plugin reports {size} host bytes, not a multiple of {elem}"
            )));
        }
        let mut values = vec![T::default(); size / elem];
        self.copy_to_host(values.as_mut_ptr().cast(), size)?;
        Ok(values)
    }

    /// Host bytes the buffer needs (`PJRT_Buffer_ToHostBuffer` with no
    /// destination).
    fn host_size(&self) -> Result<usize> {
        let mut args = Padded::<ffi::PJRT_Buffer_ToHostBuffer_Args>::new();
        args.src = self.raw;
        // SAFETY: a null `dst` asks only for the size.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_ToHostBuffer, &mut args) }?;
        Ok(args.dst_size)
    }

    /// Copies into `dst`, `size` bytes, and waits for the copy.
    fn copy_to_host(&self, dst: *mut c_void, size: usize) -> Result<()> {
        let mut args = Padded::<ffi::PJRT_Buffer_ToHostBuffer_Args>::new();
        args.src = self.raw;
        args.dst = dst;
        args.dst_size = size;
        // SAFETY: `dst` is writable for `size` bytes, the size the plugin
        // asked for, and stays alive until the event below has completed.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_ToHostBuffer, &mut args) }?;
        self.api()
            .await_event("PJRT_Buffer_ToHostBuffer", args.event)
    }

    /// Copies the buffer to another device of the same client.
    pub fn copy_to_device(&self, device: &Device) -> Result<Buffer> {
        device.check_client(&self.client)?;
        let mut args = Padded::<ffi::PJRT_Buffer_CopyToDevice_Args>::new();
        args.buffer = self.raw;
        args.dst_device = device.raw();
        // SAFETY: a live buffer and a device of the same client.
        unsafe { pjrt_call!(self.api(), PJRT_Buffer_CopyToDevice, &mut args) }?;
        Ok(Buffer::from_raw(self.client.clone(), args.dst_buffer))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut args = Padded::<ffi::PJRT_Buffer_Destroy_Args>::new();
        args.buffer = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: we own the buffer and never use it again; the client it
        // belongs to outlives this call (we hold an `Arc` to it). A failure
        // to free cannot be reported from `drop`.
        let _ = unsafe { pjrt_call!(self.api(), PJRT_Buffer_Destroy, &mut args) };
    }
}
