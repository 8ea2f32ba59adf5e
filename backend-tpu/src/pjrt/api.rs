//! The checked call layer over a plugin's function table: finds a function
//! only where the plugin's table reaches, turns a returned `PJRT_Error` into an
//! [`Error::Pjrt`], awaits and frees events, and copies out strings.

use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::ptr;

use super::error::{Error, ErrorCode, Result};
use super::ffi::{self, ArgsStruct, ErrFn, PJRT_Api, PJRT_Error, PJRT_Event, Padded};

/// A copy of a plugin's `PJRT_Api` table, with every slot the plugin's
/// `struct_size` does not cover left null.
pub(crate) struct Api {
    table: PJRT_Api,
    /// The plugin's own `struct_size` of its table.
    table_size: usize,
    /// The plugin file, for error messages.
    path: PathBuf,
}

// SAFETY: the table is a plain copy of function pointers into a library that
// stays loaded for the life of the process (plugins are never unloaded), and
// the PJRT C API documents its functions as callable from any thread.
unsafe impl Send for Api {}
// SAFETY: as above; `Api` is never mutated after construction.
unsafe impl Sync for Api {}

/// The function in `$api`'s table named `$name`, or an [`Error::MissingFunction`].
macro_rules! pjrt_fn {
    ($api:expr, $name:ident) => {
        $api.function(
            $api.table().$name,
            stringify!($name),
            ::std::mem::offset_of!($crate::pjrt::ffi::PJRT_Api, $name),
        )
    };
}
pub(crate) use pjrt_fn;

/// Calls the PJRT function `$name` with the padded arguments `$args`.
/// Expands to an `unsafe` call: the caller vouches for the pointers in `$args`.
macro_rules! pjrt_call {
    ($api:expr, $name:ident, $args:expr) => {{
        let api: &$crate::pjrt::api::Api = $api;
        match $crate::pjrt::api::pjrt_fn!(api, $name) {
            Ok(function) => api.call(stringify!($name), function, $args),
            Err(e) => Err(e),
        }
    }};
}
pub(crate) use pjrt_call;

impl Api {
    /// Copies the table the plugin returned from `GetPjrtApi`.
    ///
    /// # Safety
    /// `table` must point to a live `PJRT_Api` whose first field is its
    /// `struct_size` and which is at least that many bytes long.
    pub(crate) unsafe fn from_raw(table: *const PJRT_Api, path: PathBuf) -> Self {
        // SAFETY: the caller guarantees `table` is readable for `struct_size`
        // bytes, and `struct_size` is its first field.
        let table_size = unsafe { ptr::read(table.cast::<usize>()) };
        let n = table_size.min(std::mem::size_of::<PJRT_Api>());
        // SAFETY: all-zero bytes are a valid `PJRT_Api` (integers, raw
        // pointers, `Option`s of function pointers).
        let mut copy: PJRT_Api = unsafe { std::mem::zeroed() };
        // SAFETY: we copy `n` bytes, no more than the plugin's table holds
        // and no more than our struct has, between non-overlapping objects;
        // every byte pattern of the plugin's table is a valid value of the
        // declared fields (null or a function pointer), slots beyond `n` stay
        // null.
        unsafe {
            ptr::copy_nonoverlapping(table.cast::<u8>(), ptr::addr_of_mut!(copy).cast::<u8>(), n);
        }
        Self {
            table: copy,
            table_size,
            path,
        }
    }

    pub(crate) fn table(&self) -> &PJRT_Api {
        &self.table
    }

    pub(crate) fn path(&self) -> &PathBuf {
        &self.path
    }

    /// `(major, minor)` of the API the plugin implements.
    pub(crate) fn version(&self) -> (i32, i32) {
        let v = self.table.pjrt_api_version;
        (v.major_version, v.minor_version)
    }

    pub(crate) fn version_string(&self) -> String {
        let (major, minor) = self.version();
        format!("{major}.{minor}")
    }

    /// The plugin's `struct_size` of its function table.
    pub(crate) fn table_size(&self) -> usize {
        self.table_size
    }

    /// `slot`, checked to lie within the plugin's table and to be set.
    pub(crate) fn function<F>(
        &self,
        slot: Option<F>,
        name: &'static str,
        offset: usize,
    ) -> Result<F> {
        let end = offset + std::mem::size_of::<Option<F>>();
        if end > self.table_size {
            return Err(Error::MissingFunction {
                path: self.path.clone(),
                api_version: self.version_string(),
                function: name,
                reason: format!(
                    "its function table is {} bytes and ends before this function (bytes {offset}..{end})",
                    self.table_size
                ),
            });
        }
        slot.ok_or_else(|| Error::MissingFunction {
            path: self.path.clone(),
            api_version: self.version_string(),
            function: name,
            reason: "the table slot is null".to_string(),
        })
    }

    /// Calls `function` and converts a returned `PJRT_Error`.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid as the PJRT header describes for
    /// `function`, for the duration of the call.
    pub(crate) unsafe fn call<A: ArgsStruct>(
        &self,
        name: &'static str,
        function: ErrFn<A>,
        args: &mut Padded<A>,
    ) -> Result<()> {
        // SAFETY: `args` is a padded struct whose `struct_size` covers the
        // whole allocation; the caller vouches for the pointers inside it.
        let error = unsafe { function(args.as_mut_ptr()) };
        self.check(name, error)
    }

    /// `Ok` for a null error; otherwise reads, frees and returns it.
    pub(crate) fn check(&self, function: &'static str, error: *mut PJRT_Error) -> Result<()> {
        if error.is_null() {
            return Ok(());
        }
        let message = self.error_message(error);
        let code = self.error_code(error);
        self.destroy_error(error);
        Err(Error::Pjrt {
            function,
            code,
            message,
        })
    }

    fn error_message(&self, error: *mut PJRT_Error) -> String {
        let Ok(function) = pjrt_fn!(self, PJRT_Error_Message) else {
            return "(the plugin has no PJRT_Error_Message)".to_string();
        };
        let mut args = Padded::<ffi::PJRT_Error_Message_Args>::new();
        args.error = error;
        // SAFETY: `error` is a live error returned by this plugin; `message`
        // lives as long as `error`, which we free only after copying it.
        unsafe {
            function(args.as_mut_ptr());
            copy_string(args.message, args.message_size)
        }
    }

    fn error_code(&self, error: *mut PJRT_Error) -> ErrorCode {
        let Ok(function) = pjrt_fn!(self, PJRT_Error_GetCode) else {
            return ErrorCode::Unknown;
        };
        let mut args = Padded::<ffi::PJRT_Error_GetCode_Args>::new();
        args.error = error;
        // SAFETY: `error` is a live error returned by this plugin.
        let nested = unsafe { function(args.as_mut_ptr()) };
        if nested.is_null() {
            ErrorCode::from_raw(args.code)
        } else {
            self.destroy_error(nested);
            ErrorCode::Unknown
        }
    }

    fn destroy_error(&self, error: *mut PJRT_Error) {
        if let Ok(function) = pjrt_fn!(self, PJRT_Error_Destroy) {
            let mut args = Padded::<ffi::PJRT_Error_Destroy_Args>::new();
            args.error = error;
            // SAFETY: `error` is a live error owned by us; it is not used again.
            unsafe { function(args.as_mut_ptr()) };
        }
    }

    /// Blocks until `event` is ready, frees it, and returns its status.
    /// `what` names the operation the event belongs to.
    pub(crate) fn await_event(&self, what: &'static str, event: *mut PJRT_Event) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut args = Padded::<ffi::PJRT_Event_Await_Args>::new();
        args.event = event;
        // SAFETY: `event` is a live event returned by this plugin and owned
        // by us.
        let awaited = unsafe { pjrt_call!(self, PJRT_Event_Await, &mut args) };
        let destroyed = self.destroy_event(event);
        awaited.map_err(|e| match e {
            Error::Pjrt { code, message, .. } => Error::Pjrt {
                function: what,
                code,
                message,
            },
            other => other,
        })?;
        destroyed
    }

    pub(crate) fn destroy_event(&self, event: *mut PJRT_Event) -> Result<()> {
        let mut args = Padded::<ffi::PJRT_Event_Destroy_Args>::new();
        args.event = event;
        // SAFETY: `event` is a live event owned by us; it is not used again.
        unsafe { pjrt_call!(self, PJRT_Event_Destroy, &mut args) }
    }
}

/// Copies a `(pointer, length)` string the plugin returned; null gives "".
///
/// # Safety
/// `ptr` must be null or valid for reading `len` bytes.
pub(crate) unsafe fn copy_string(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: the caller guarantees `len` readable bytes at `ptr`.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// Copies a `(pointer, length)` array the plugin returned; null gives `[]`.
///
/// # Safety
/// `ptr` must be null or valid for reading `len` values of `T`.
pub(crate) unsafe fn copy_slice<T: Copy>(ptr: *const T, len: usize) -> Vec<T> {
    if ptr.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller guarantees `len` readable values at `ptr`.
    unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec()
}

/// A value of a PJRT named option or attribute (`PJRT_NamedValue`).
#[derive(Clone, Debug, PartialEq)]
pub enum NamedValue {
    String(String),
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl From<&str> for NamedValue {
    fn from(v: &str) -> Self {
        Self::String(v.to_string())
    }
}
impl From<String> for NamedValue {
    fn from(v: String) -> Self {
        Self::String(v)
    }
}
impl From<i64> for NamedValue {
    fn from(v: i64) -> Self {
        Self::Int64(v)
    }
}
impl From<Vec<i64>> for NamedValue {
    fn from(v: Vec<i64>) -> Self {
        Self::Int64List(v)
    }
}
impl From<f32> for NamedValue {
    fn from(v: f32) -> Self {
        Self::Float(v)
    }
}
impl From<bool> for NamedValue {
    fn from(v: bool) -> Self {
        Self::Bool(v)
    }
}

/// Named values laid out for the C API: owns the strings and lists the
/// `PJRT_NamedValue` array points into.
pub(crate) struct RawNamedValues {
    _names: Vec<CString>,
    _strings: Vec<CString>,
    _lists: Vec<Vec<i64>>,
    values: Vec<ffi::PJRT_NamedValue>,
}

impl RawNamedValues {
    pub(crate) fn new(options: &[(&str, NamedValue)]) -> Result<Self> {
        let mut names = Vec::with_capacity(options.len());
        let mut strings = Vec::new();
        let mut lists = Vec::new();
        let mut values = Vec::with_capacity(options.len());
        for (name, value) in options {
            let c_name = CString::new(*name).map_err(|_| {
                Error::InvalidArgument(format!("option name {name:?} contains a NUL byte"))
            })?;
            let (type_, raw, size) = match value {
                NamedValue::String(s) => {
                    let c = CString::new(s.as_str()).map_err(|_| {
                        Error::InvalidArgument(format!(
                            "option {name} value {s:?} contains a NUL byte"
                        ))
                    })?;
                    let raw = ffi::PJRT_NamedValue_Value {
                        string_value: c.as_ptr(),
                    };
                    strings.push(c);
                    (ffi::PJRT_NamedValue_kString, raw, s.len())
                }
                NamedValue::Int64(v) => (
                    ffi::PJRT_NamedValue_kInt64,
                    ffi::PJRT_NamedValue_Value { int64_value: *v },
                    1,
                ),
                NamedValue::Int64List(v) => {
                    let list = v.clone();
                    let raw = ffi::PJRT_NamedValue_Value {
                        int64_array_value: list.as_ptr(),
                    };
                    let len = list.len();
                    lists.push(list);
                    (ffi::PJRT_NamedValue_kInt64List, raw, len)
                }
                NamedValue::Float(v) => (
                    ffi::PJRT_NamedValue_kFloat,
                    ffi::PJRT_NamedValue_Value { float_value: *v },
                    1,
                ),
                NamedValue::Bool(v) => (
                    ffi::PJRT_NamedValue_kBool,
                    ffi::PJRT_NamedValue_Value { bool_value: *v },
                    1,
                ),
            };
            values.push(ffi::PJRT_NamedValue {
                struct_size: ffi::PJRT_NamedValue_STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                name: c_name.as_ptr(),
                name_size: name.len(),
                type_,
                value: raw,
                value_size: size,
            });
            // Moving a CString or Vec moves only its handle, not the heap
            // data the pointers above refer to.
            names.push(c_name);
        }
        Ok(Self {
            _names: names,
            _strings: strings,
            _lists: lists,
            values,
        })
    }

    pub(crate) fn as_ptr(&self) -> *const ffi::PJRT_NamedValue {
        if self.values.is_empty() {
            ptr::null()
        } else {
            self.values.as_ptr()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.values.len()
    }
}

/// Reads a plugin-owned `PJRT_NamedValue` array.
///
/// # Safety
/// `ptr` must be null or point to `len` valid named values whose strings and
/// lists are alive.
pub(crate) unsafe fn read_named_values(
    ptr: *const ffi::PJRT_NamedValue,
    len: usize,
) -> Vec<(String, NamedValue)> {
    // SAFETY: forwarded from the caller.
    let raw = unsafe { copy_slice(ptr, len) };
    raw.iter()
        .map(|nv| {
            // SAFETY: the caller guarantees the name and value pointers are
            // valid; the union member read is the one `type_` selects.
            unsafe {
                let name = copy_string(nv.name, nv.name_size);
                let value = match nv.type_ {
                    ffi::PJRT_NamedValue_kString => {
                        NamedValue::String(copy_string(nv.value.string_value, nv.value_size))
                    }
                    ffi::PJRT_NamedValue_kInt64 => NamedValue::Int64(nv.value.int64_value),
                    ffi::PJRT_NamedValue_kInt64List => {
                        NamedValue::Int64List(copy_slice(nv.value.int64_array_value, nv.value_size))
                    }
                    ffi::PJRT_NamedValue_kFloat => NamedValue::Float(nv.value.float_value),
                    ffi::PJRT_NamedValue_kBool => NamedValue::Bool(nv.value.bool_value),
                    other => NamedValue::String(format!("(unknown named value type {other})")),
                };
                (name, value)
            }
        })
        .collect()
}
