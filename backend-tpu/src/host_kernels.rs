//! Host kernels: oxidiff's own CPU kernels, called from compiled programs on XLA's CPU plugin as
//! typed XLA FFI custom calls (`stablehlo.custom_call @target(...) {api_version = 4}`).
//!
//! XLA's CPU code generation is slower than oxidiff's CPU kernels for the convolutions that
//! dominate a UNet and a VAE decoder. A kernel [`install`]ed here is registered with every XLA
//! CPU plugin loaded (now and later) through the plugin's PJRT FFI extension, and the lowering
//! of a compiled program for that plugin calls it in place of the op
//! ([`Lowerer::with_host_kernels`](crate::lowering::Lowerer::with_host_kernels)). The program
//! stays one XLA executable, cached on disk like any other; the custom call's target names the
//! kernel, so its module text (the cache key) differs from the plain lowering's.
//!
//! A kernel sees its operands as [`HostBuffer`]s (XLA's buffers, in host memory on this plugin)
//! and its integer attributes by name ([`HostCall`]); an error it returns fails the execution
//! with its message. Plugins without the FFI extension (or that refuse the registration) are
//! left as they are: their programs keep XLA's own lowering.

use std::collections::HashSet;
use std::ffi::{c_char, c_void};
use std::sync::{Mutex, OnceLock};

use crate::pjrt::{ElementType, PluginKind};

/// The custom-call target of a 2-D f32 convolution in NCHW with an OIHW square kernel,
/// one group, dilation 1; attributes `stride` and `padding` (the same in both dimensions).
/// Operands: input `[n, c_in, h, w]`, kernel `[c_out, c_in, k, k]`, optionally a bias
/// `[c_out]`; result `[n, c_out, h_out, w_out]`.
pub const CONV2D_F32: &str = "oxidiff_conv2d_f32";

/// The custom-call target of f32 softmax attention scaled by `1 / sqrt(head_dim)`: queries
/// `[batch, s_q, heads, head_dim]`, keys and values `[batch, s_kv, heads, head_dim]`; attribute
/// `causal` (0 or 1, causal only with `s_q == s_kv`); result as the queries.
pub const ATTENTION_F32: &str = "oxidiff_attention_f32";

/// The custom-call target of an f32 matrix product `a b (+ bias)`: `a` `[m, k]`, `b` `[k, n]`,
/// optionally a bias `[n]`; result `[m, n]`. No attributes.
pub const MATMUL_F32: &str = "oxidiff_matmul_f32";

/// Every target the lowering knows how to call ([`Lowerer::with_host_kernels`](
/// crate::lowering::Lowerer::with_host_kernels)).
pub const TARGETS: [&str; 3] = [CONV2D_F32, ATTENTION_F32, MATMUL_F32];

/// What a host kernel computes: reads `call.args`, writes every buffer of `call.results`.
pub type HostKernelFn = fn(&mut HostCall<'_>) -> Result<(), String>;

/// A kernel for a custom-call target.
#[derive(Clone, Copy, Debug)]
pub struct HostKernel {
    /// The custom-call target the lowering names (such as [`CONV2D_F32`]).
    pub target: &'static str,
    pub run: HostKernelFn,
}

/// One operand or result of a custom call: an XLA buffer in host memory, dense, row-major.
pub struct HostBuffer<'a> {
    pub element: Option<ElementType>,
    pub dims: &'a [i64],
    data: *mut c_void,
}

impl HostBuffer<'_> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.dims.iter().map(|&d| d.max(0) as usize).product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dimensions as `usize`.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().map(|&d| d.max(0) as usize).collect()
    }

    fn check_f32(&self, what: &str) -> Result<(), String> {
        if self.element != Some(ElementType::F32) {
            return Err(format!("{what} is {:?}, not f32", self.element));
        }
        if self.data.is_null() && !self.is_empty() {
            return Err(format!("{what} has no data"));
        }
        Ok(())
    }

    /// The elements of an f32 buffer.
    pub fn f32s(&self) -> Result<&[f32], String> {
        self.check_f32("an operand")?;
        if self.is_empty() {
            return Ok(&[]);
        }
        // SAFETY: XLA hands the handler a live, dense buffer of `len` elements of the buffer's
        // type (checked above) for the duration of the call.
        Ok(unsafe { std::slice::from_raw_parts(self.data as *const f32, self.len()) })
    }

    /// The elements of an f32 result buffer, to write.
    pub fn f32s_mut(&mut self) -> Result<&mut [f32], String> {
        self.check_f32("a result")?;
        if self.is_empty() {
            return Ok(&mut []);
        }
        // SAFETY: as in `f32s`; a result buffer is the handler's alone to write during the
        // call (XLA's buffer assignment never aliases it with an operand of the call).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.data as *mut f32, self.len()) })
    }
}

/// One custom call: its operands, results and integer attributes.
pub struct HostCall<'a> {
    pub args: Vec<HostBuffer<'a>>,
    pub results: Vec<HostBuffer<'a>>,
    attrs: Vec<(&'a str, i64)>,
}

impl HostCall<'_> {
    /// The integer attribute `name`.
    pub fn attr(&self, name: &str) -> Result<i64, String> {
        self.attrs
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, v)| v)
            .ok_or_else(|| format!("the attribute `{name}` is missing"))
    }
}

/// The kernels installed in this process, in slot order ([`TRAMPOLINES`]), and which plugins
/// (by path) registered which targets.
#[derive(Default)]
struct Registry {
    kernels: Vec<HostKernel>,
    registered: HashSet<(std::path::PathBuf, &'static str)>,
    /// Calls run, by slot.
    calls: [u64; SLOTS],
}

struct Shared(Mutex<Registry>);

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<&'static Shared> = OnceLock::new();
    &REGISTRY
        .get_or_init(|| crate::process::shared(|| Shared(Mutex::new(Registry::default()))))
        .0
}

fn lock() -> std::sync::MutexGuard<'static, Registry> {
    registry()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Installs `kernel`: registers it with every XLA CPU plugin loaded now, and with each one
/// loaded later. Installing a target again is a no-op. Returns whether a slot was free
/// (a process has [`SLOTS`] of them).
pub fn install(kernel: HostKernel) -> bool {
    {
        let mut registry = lock();
        if registry.kernels.iter().any(|k| k.target == kernel.target) {
            return true;
        }
        if registry.kernels.len() == SLOTS {
            return false;
        }
        registry.kernels.push(kernel);
    }
    for plugin in crate::pjrt::plugin::loaded() {
        register_with(&plugin);
    }
    true
}

/// How many times compiled programs called `target`'s kernel in this process.
pub fn calls(target: &str) -> u64 {
    let registry = lock();
    registry
        .kernels
        .iter()
        .position(|k| k.target == target)
        .map_or(0, |slot| registry.calls[slot])
}

/// Whether programs for `plugin` may call `target` (installed and registered with it).
pub fn available(plugin: &crate::pjrt::Plugin, target: &str) -> bool {
    lock()
        .registered
        .iter()
        .any(|(path, t)| path == plugin.path() && *t == target)
}

/// Registers the installed kernels not yet registered with `plugin`, when it is an XLA CPU
/// plugin with the PJRT FFI extension; called for each plugin as it is loaded, and by
/// [`install`]. A refusal is logged once per target and leaves programs on XLA's lowering.
pub(crate) fn register_with(plugin: &crate::pjrt::Plugin) {
    if plugin.kind() != Some(PluginKind::XlaCpu) {
        return;
    }
    let pending: Vec<(usize, HostKernel)> = {
        let registry = lock();
        registry
            .kernels
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, k)| {
                !registry
                    .registered
                    .contains(&(plugin.path().clone(), k.target))
            })
            .collect()
    };
    for (slot, kernel) in pending {
        match plugin.register_ffi_handler(kernel.target, TRAMPOLINES[slot] as *mut c_void, "Host") {
            Ok(()) => {
                lock()
                    .registered
                    .insert((plugin.path().clone(), kernel.target));
            }
            Err(e) => {
                tracing::warn!(
                    target: "oxidiff::pjrt",
                    "the XLA CPU plugin {} did not take the host kernel {}: {e}; compiled programs use XLA's own lowering",
                    plugin.path().display(),
                    kernel.target
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The XLA FFI C API (`xla/ffi/api/c_api.h`, API version 0.1): the parts a handler reads.

const XLA_FFI_API_MAJOR: i32 = 0;
const XLA_FFI_API_MINOR: i32 = 1;
const XLA_FFI_EXTENSION_METADATA: i32 = 1;
const XLA_FFI_ARG_BUFFER: i32 = 1;
const XLA_FFI_ATTR_SCALAR: i32 = 3;
const XLA_FFI_ERROR_INVALID_ARGUMENT: i32 = 3;

#[repr(C)]
struct ExtensionBase {
    struct_size: usize,
    type_: i32,
    next: *mut ExtensionBase,
}

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    major_version: i32,
    minor_version: i32,
}

#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
}

#[repr(C)]
struct MetadataExtension {
    extension_base: ExtensionBase,
    metadata: *mut Metadata,
}

#[repr(C)]
struct Buffer {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    dtype: i32,
    data: *mut c_void,
    rank: i64,
    dims: *mut i64,
}

#[repr(C)]
struct List {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *mut i32,
    items: *mut *mut c_void,
}

#[repr(C)]
struct ByteSpan {
    ptr: *const c_char,
    len: usize,
}

#[repr(C)]
struct Attrs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *mut i32,
    names: *mut *mut ByteSpan,
    attrs: *mut *mut c_void,
}

#[repr(C)]
struct Scalar {
    dtype: i32,
    value: *mut c_void,
}

#[repr(C)]
struct CallFrame {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api: *const FfiApi,
    ctx: *mut c_void,
    stage: i32,
    args: List,
    rets: List,
    attrs: Attrs,
}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    message: *const c_char,
    errc: i32,
}

type ErrorCreate = unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void;

#[repr(C)]
struct FfiApi {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api_version: ApiVersion,
    internal_api: *mut c_void,
    error_create: Option<ErrorCreate>,
}

/// XLA's `PrimitiveType` numbers (`xla_data.proto`), as the FFI passes them.
fn element_type(dtype: i32) -> Option<ElementType> {
    Some(match dtype {
        1 => ElementType::Pred,
        2 => ElementType::S8,
        3 => ElementType::S16,
        4 => ElementType::S32,
        5 => ElementType::S64,
        6 => ElementType::U8,
        7 => ElementType::U16,
        8 => ElementType::U32,
        9 => ElementType::U64,
        10 => ElementType::F16,
        11 => ElementType::F32,
        12 => ElementType::F64,
        16 => ElementType::BF16,
        _ => return None,
    })
}

/// Reads a call frame's buffers (operands or results).
///
/// # Safety
/// `list` must be a call frame's argument or result list as XLA passes it.
unsafe fn buffers<'a>(list: &'a List, what: &str) -> Result<Vec<HostBuffer<'a>>, String> {
    let n = list.size.max(0) as usize;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: XLA's lists hold `size` types and items.
        let (ty, item) = unsafe { (*list.types.add(i), *list.items.add(i)) };
        if ty != XLA_FFI_ARG_BUFFER || item.is_null() {
            return Err(format!("{what} {i} is not a buffer"));
        }
        // SAFETY: an item of buffer type points to an `XLA_FFI_Buffer`.
        let buffer = unsafe { &*(item as *const Buffer) };
        let rank = buffer.rank.max(0) as usize;
        let dims = if rank == 0 {
            &[][..]
        } else {
            // SAFETY: `dims` holds `rank` values.
            unsafe { std::slice::from_raw_parts(buffer.dims, rank) }
        };
        out.push(HostBuffer {
            element: element_type(buffer.dtype),
            dims,
            data: buffer.data,
        });
    }
    Ok(out)
}

/// Reads a call frame's integer scalar attributes (others are skipped).
///
/// # Safety
/// `attrs` must be a call frame's attributes as XLA passes them.
unsafe fn integer_attrs(attrs: &Attrs) -> Vec<(&str, i64)> {
    let n = attrs.size.max(0) as usize;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: XLA's attributes hold `size` types, names and values.
        let (ty, name, value) = unsafe {
            (
                *attrs.types.add(i),
                *attrs.names.add(i),
                *attrs.attrs.add(i),
            )
        };
        if ty != XLA_FFI_ATTR_SCALAR || name.is_null() || value.is_null() {
            continue;
        }
        // SAFETY: a name is a byte span; a scalar attribute an `XLA_FFI_Scalar`.
        let (name, scalar) = unsafe { (&*name, &*(value as *const Scalar)) };
        // SAFETY: the span covers `len` bytes of the name.
        let bytes = unsafe { std::slice::from_raw_parts(name.ptr as *const u8, name.len) };
        let Ok(name) = std::str::from_utf8(bytes) else {
            continue;
        };
        // SAFETY: the value holds one element of `dtype`.
        let value = unsafe {
            match scalar.dtype {
                2 => i64::from(*(scalar.value as *const i8)),
                3 => i64::from(*(scalar.value as *const i16)),
                4 => i64::from(*(scalar.value as *const i32)),
                5 => *(scalar.value as *const i64),
                _ => continue,
            }
        };
        out.push((name, value));
    }
    out
}

/// An XLA FFI error carrying `message`, made through the call frame's API (null when the API
/// cannot make one: XLA then sees success, so this is only reached with a usable API).
///
/// # Safety
/// `api` must be the call frame's API pointer.
unsafe fn ffi_error(api: *const FfiApi, message: &str) -> *mut c_void {
    let message = std::ffi::CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: XLA's API table outlives the call.
    let Some(create) = (unsafe { api.as_ref() }).and_then(|api| api.error_create) else {
        return std::ptr::null_mut();
    };
    let mut args = ErrorCreateArgs {
        struct_size: std::mem::size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: XLA_FFI_ERROR_INVALID_ARGUMENT,
    };
    // SAFETY: the arguments are valid for the call; XLA copies the message.
    unsafe { create(&mut args) }
}

/// The handler of slot `K`: answers XLA's metadata query (the FFI API version this handler
/// speaks), and otherwise runs the slot's kernel on the call frame's buffers.
unsafe extern "C" fn trampoline<const K: usize>(frame: *mut c_void) -> *mut c_void {
    let frame = frame as *mut CallFrame;
    // SAFETY: XLA passes a live call frame.
    let Some(frame) = (unsafe { frame.as_mut() }) else {
        return std::ptr::null_mut();
    };
    // SAFETY: the extension chain is XLA's, valid for the call.
    if let Some(extension) = unsafe { frame.extension_start.as_ref() } {
        if extension.type_ == XLA_FFI_EXTENSION_METADATA {
            let extension = frame.extension_start as *mut MetadataExtension;
            // SAFETY: an extension of the metadata type is an `XLA_FFI_Metadata_Extension`.
            if let Some(metadata) = unsafe { (*extension).metadata.as_mut() } {
                metadata.api_version.major_version = XLA_FFI_API_MAJOR;
                metadata.api_version.minor_version = XLA_FFI_API_MINOR;
                metadata.traits = 0;
            }
            return std::ptr::null_mut();
        }
    }
    let api = frame.api;
    let kernel = {
        let mut registry = lock();
        let kernel = registry.kernels.get(K).copied();
        if kernel.is_some() {
            registry.calls[K] += 1;
        }
        kernel
    };
    let Some(kernel) = kernel else {
        // SAFETY: `api` is the frame's.
        return unsafe { ffi_error(api, "oxidiff: no host kernel is installed in this slot") };
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the frame's lists and attributes are XLA's, valid for the call.
        let call = unsafe {
            buffers(&frame.args, "operand").and_then(|args| {
                let results = buffers(&frame.rets, "result")?;
                Ok(HostCall {
                    args,
                    results,
                    attrs: integer_attrs(&frame.attrs),
                })
            })
        };
        call.and_then(|mut call| (kernel.run)(&mut call))
    }));
    let message = match result {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => format!("oxidiff host kernel {}: {e}", kernel.target),
        Err(_) => format!("oxidiff host kernel {} panicked", kernel.target),
    };
    // SAFETY: `api` is the frame's.
    unsafe { ffi_error(api, &message) }
}

/// One handler per slot: XLA's call frame does not name the target, so each installed kernel
/// gets a function of its own.
type Handler = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
/// How many kernels a process can install.
const SLOTS: usize = 8;
const TRAMPOLINES: [Handler; SLOTS] = [
    trampoline::<0>,
    trampoline::<1>,
    trampoline::<2>,
    trampoline::<3>,
    trampoline::<4>,
    trampoline::<5>,
    trampoline::<6>,
    trampoline::<7>,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_frame_layout_matches_the_c_header() {
        // Offsets from `xla/ffi/api/c_api.h` on a 64-bit target.
        assert_eq!(std::mem::size_of::<Buffer>(), 48);
        assert_eq!(std::mem::size_of::<List>(), 40);
        assert_eq!(std::mem::size_of::<Attrs>(), 48);
        assert_eq!(std::mem::offset_of!(CallFrame, stage), 32);
        assert_eq!(std::mem::offset_of!(CallFrame, args), 40);
        assert_eq!(std::mem::offset_of!(CallFrame, rets), 80);
        assert_eq!(std::mem::offset_of!(CallFrame, attrs), 120);
        assert_eq!(std::mem::offset_of!(FfiApi, error_create), 48);
        assert_eq!(std::mem::offset_of!(Metadata, traits), 32);
    }
}
