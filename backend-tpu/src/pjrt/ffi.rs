//! The PJRT C API, declared by hand from `xla/pjrt/c/pjrt_c_api.h`: only the
//! functions and argument structs oxidiff uses.
//!
//! Two rules of that header make a hand-written subset safe across plugin
//! versions (checked against API 0.81, 0.113 and 0.115 headers):
//! - the function table `PJRT_Api` and every argument struct only grow at
//!   their end within major version 0, so a prefix of them is valid for every
//!   plugin; [`PJRT_Api`] stops at the last function we call, and callers
//!   check the plugin's `struct_size` covers a function before calling it;
//! - a plugin rejects argument structs whose `struct_size` is smaller than its
//!   own ("Unexpected PJRT_Client_Create_Args size: expected 88, got 72"), so
//!   every argument struct travels inside a [`Padded`] buffer of zeros that is
//!   [`ARGS_PADDING`] bytes longer, with `struct_size` set to the padded size.
//!   Zero is the "unset" value of every field the header appends.
//!
//! C enums are `int`s here (`c_int`), to stay total over codes a newer plugin
//! may return.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void};

/// The PJRT C API major version this declaration follows.
pub const PJRT_API_MAJOR: c_int = 0;

/// Extra zero bytes after every argument struct (see the module docs).
pub const ARGS_PADDING: usize = 256;

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            /// An opaque PJRT object, only ever handled by pointer.
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
            }
        )*
    };
}

opaque!(
    PJRT_Error,
    PJRT_Event,
    PJRT_Client,
    PJRT_Device,
    PJRT_DeviceDescription,
    PJRT_Memory,
    PJRT_Executable,
    PJRT_LoadedExecutable,
    PJRT_Buffer,
    PJRT_TopologyDescription,
    PJRT_Extension_Base,
    PJRT_SerializedExecutable,
    PJRT_ExecuteContext,
);

// ------------------------------- enums (as int) ------------------------------

pub type PJRT_Error_Code = c_int;
pub type PJRT_NamedValue_Type = c_int;
pub const PJRT_NamedValue_kString: PJRT_NamedValue_Type = 0;
pub const PJRT_NamedValue_kInt64: PJRT_NamedValue_Type = 1;
pub const PJRT_NamedValue_kInt64List: PJRT_NamedValue_Type = 2;
pub const PJRT_NamedValue_kFloat: PJRT_NamedValue_Type = 3;
pub const PJRT_NamedValue_kBool: PJRT_NamedValue_Type = 4;

pub type PJRT_Buffer_Type = c_int;

pub type PJRT_HostBufferSemantics = c_int;
/// The runtime may read `data` until `done_with_host_buffer` fires, which
/// happens when the transfer completes (unlike the zero-copy semantics, whose
/// event fires only when the device buffer is destroyed).
pub const PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes: PJRT_HostBufferSemantics = 1;

// --------------------------------- functions ---------------------------------

/// A PJRT function that reports failure through a returned `PJRT_Error*`.
pub type ErrFn<A> = unsafe extern "C" fn(args: *mut A) -> *mut PJRT_Error;
/// A PJRT function without a status (the error accessors).
pub type VoidFn<A> = unsafe extern "C" fn(args: *mut A);
/// A table slot oxidiff does not call: only its size and position matter.
pub type Unused = Option<unsafe extern "C" fn()>;

/// The entry point every plugin exports.
pub type GetPjrtApiFn = unsafe extern "C" fn() -> *const PJRT_Api;

/// Argument structs that may travel in a [`Padded`] buffer.
///
/// # Safety
/// Implementors are `#[repr(C)]` structs whose first field is the
/// `size_t struct_size` of the header, and for which all-zero bytes are a
/// valid value (raw pointers, integers, `Option` of function pointers).
pub unsafe trait ArgsStruct: Sized {
    fn struct_size_mut(&mut self) -> &mut usize;
}

/// An argument struct followed by [`ARGS_PADDING`] zero bytes, with
/// `struct_size` set to the whole padded size.
#[repr(C)]
pub struct Padded<T: ArgsStruct> {
    args: T,
    _tail: [u8; ARGS_PADDING],
}

impl<T: ArgsStruct> Padded<T> {
    /// All fields zero (unset), `struct_size` the padded size.
    pub fn new() -> Self {
        // SAFETY: `ArgsStruct` guarantees all-zero bytes are a valid `T`, and
        // the tail is plain bytes.
        let mut padded: Self = unsafe { std::mem::zeroed() };
        *padded.args.struct_size_mut() = std::mem::size_of::<Self>();
        padded
    }

    /// The pointer handed to the plugin: it may read `struct_size` bytes.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        &mut self.args
    }
}

impl<T: ArgsStruct> Default for Padded<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: ArgsStruct> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.args
    }
}

impl<T: ArgsStruct> std::ops::DerefMut for Padded<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.args
    }
}

macro_rules! args_struct {
    ($(
        $(#[$meta:meta])*
        pub struct $name:ident { $(pub $field:ident : $ty:ty,)* }
    )*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            pub struct $name {
                pub struct_size: usize,
                pub extension_start: *mut PJRT_Extension_Base,
                $(pub $field: $ty,)*
            }

            // SAFETY: `#[repr(C)]`, first field `struct_size`, and every field
            // is a raw pointer, an integer, a bool, a `#[repr(C)]` value of
            // those, or an `Option` of a function pointer: all valid as zeros.
            unsafe impl ArgsStruct for $name {
                fn struct_size_mut(&mut self) -> &mut usize {
                    &mut self.struct_size
                }
            }
        )*
    };
}

// ------------------------------ structs ---------------------------------------

/// `PJRT_Api_Version`, embedded in the table.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub major_version: c_int,
    pub minor_version: c_int,
}

/// The value of a [`PJRT_NamedValue`], selected by its `type_`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Value {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

/// `PJRT_NamedValue`. Passed in arrays, so it is never padded: its
/// `struct_size` is the header's `PJRT_NamedValue_STRUCT_SIZE`, which has not
/// changed since the struct appeared.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PJRT_NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub name: *const c_char,
    pub name_size: usize,
    pub type_: PJRT_NamedValue_Type,
    pub value: PJRT_NamedValue_Value,
    pub value_size: usize,
}

/// `PJRT_NamedValue_STRUCT_SIZE`: up to and including `value_size`.
pub const PJRT_NamedValue_STRUCT_SIZE: usize = 56;
const _: () = assert!(std::mem::size_of::<PJRT_NamedValue>() == PJRT_NamedValue_STRUCT_SIZE);

args_struct! {
    pub struct PJRT_Error_Destroy_Args {
        pub error: *mut PJRT_Error,
    }
    pub struct PJRT_Error_Message_Args {
        pub error: *const PJRT_Error,
        pub message: *const c_char,
        pub message_size: usize,
    }
    pub struct PJRT_Error_GetCode_Args {
        pub error: *const PJRT_Error,
        pub code: PJRT_Error_Code,
    }
    pub struct PJRT_Plugin_Initialize_Args {}
    pub struct PJRT_Plugin_Attributes_Args {
        pub attributes: *const PJRT_NamedValue,
        pub num_attributes: usize,
    }
    pub struct PJRT_Event_Destroy_Args {
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Event_Await_Args {
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Client_Create_Args {
        pub create_options: *const PJRT_NamedValue,
        pub num_options: usize,
        pub kv_get_callback: Unused,
        pub kv_get_user_arg: *mut c_void,
        pub kv_put_callback: Unused,
        pub kv_put_user_arg: *mut c_void,
        pub client: *mut PJRT_Client,
        pub kv_try_get_callback: Unused,
        pub kv_try_get_user_arg: *mut c_void,
    }
    pub struct PJRT_Client_Destroy_Args {
        pub client: *mut PJRT_Client,
    }
    pub struct PJRT_Client_PlatformName_Args {
        pub client: *mut PJRT_Client,
        pub platform_name: *const c_char,
        pub platform_name_size: usize,
    }
    pub struct PJRT_Client_PlatformVersion_Args {
        pub client: *mut PJRT_Client,
        pub platform_version: *const c_char,
        pub platform_version_size: usize,
    }
    pub struct PJRT_Client_Devices_Args {
        pub client: *mut PJRT_Client,
        pub devices: *const *mut PJRT_Device,
        pub num_devices: usize,
    }
    pub struct PJRT_Client_AddressableDevices_Args {
        pub client: *mut PJRT_Client,
        pub addressable_devices: *const *mut PJRT_Device,
        pub num_addressable_devices: usize,
    }
    /// `PJRT_Program`: `code` is only read by the compile functions.
    pub struct PJRT_Program {
        pub code: *mut c_char,
        pub code_size: usize,
        pub format: *const c_char,
        pub format_size: usize,
    }
    pub struct PJRT_Client_Compile_Args {
        pub client: *mut PJRT_Client,
        pub program: *const PJRT_Program,
        pub compile_options: *const c_char,
        pub compile_options_size: usize,
        pub executable: *mut PJRT_LoadedExecutable,
    }
    pub struct PJRT_Client_BufferFromHostBuffer_Args {
        pub client: *mut PJRT_Client,
        pub data: *const c_void,
        pub type_: PJRT_Buffer_Type,
        pub dims: *const i64,
        pub num_dims: usize,
        pub byte_strides: *const i64,
        pub num_byte_strides: usize,
        pub host_buffer_semantics: PJRT_HostBufferSemantics,
        pub device: *mut PJRT_Device,
        pub memory: *mut PJRT_Memory,
        pub device_layout: *mut c_void,
        pub done_with_host_buffer: *mut PJRT_Event,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_DeviceDescription_Id_Args {
        pub device_description: *mut PJRT_DeviceDescription,
        pub id: c_int,
    }
    pub struct PJRT_DeviceDescription_Kind_Args {
        pub device_description: *mut PJRT_DeviceDescription,
        pub device_kind: *const c_char,
        pub device_kind_size: usize,
    }
    pub struct PJRT_DeviceDescription_DebugString_Args {
        pub device_description: *mut PJRT_DeviceDescription,
        pub debug_string: *const c_char,
        pub debug_string_size: usize,
    }
    pub struct PJRT_Device_GetDescription_Args {
        pub device: *mut PJRT_Device,
        pub device_description: *mut PJRT_DeviceDescription,
    }
    pub struct PJRT_Executable_Destroy_Args {
        pub executable: *mut PJRT_Executable,
    }
    pub struct PJRT_Executable_NumOutputs_Args {
        pub executable: *mut PJRT_Executable,
        pub num_outputs: usize,
    }
    pub struct PJRT_Executable_SizeOfGeneratedCodeInBytes_Args {
        pub executable: *mut PJRT_Executable,
        pub size_in_bytes: i64,
    }
    pub struct PJRT_Executable_GetCostAnalysis_Args {
        pub executable: *mut PJRT_Executable,
        pub num_properties: usize,
        pub properties: *const PJRT_NamedValue,
    }
    pub struct PJRT_Executable_OptimizedProgram_Args {
        pub executable: *mut PJRT_Executable,
        pub program: *mut PJRT_Program,
    }
    pub struct PJRT_Executable_Serialize_Args {
        pub executable: *const PJRT_Executable,
        pub serialized_bytes: *const c_char,
        pub serialized_bytes_size: usize,
        pub serialized_executable: *mut PJRT_SerializedExecutable,
        pub serialized_executable_deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
    }
    pub struct PJRT_Executable_DeserializeAndLoad_Args {
        pub client: *mut PJRT_Client,
        pub serialized_executable: *const c_char,
        pub serialized_executable_size: usize,
        pub loaded_executable: *mut PJRT_LoadedExecutable,
        pub overridden_serialized_compile_options: *const c_char,
        pub overridden_serialized_compile_options_size: usize,
    }
    pub struct PJRT_LoadedExecutable_Destroy_Args {
        pub executable: *mut PJRT_LoadedExecutable,
    }
    pub struct PJRT_LoadedExecutable_GetExecutable_Args {
        pub loaded_executable: *mut PJRT_LoadedExecutable,
        pub executable: *mut PJRT_Executable,
    }
    pub struct PJRT_LoadedExecutable_AddressableDevices_Args {
        pub executable: *mut PJRT_LoadedExecutable,
        pub addressable_devices: *const *mut PJRT_Device,
        pub num_addressable_devices: usize,
    }
    /// `PJRT_ExecuteOptions`, declared up to `context`; the later fields
    /// (call location, task incarnations, multi-slice config, HLO output
    /// callbacks) stay zero in the padding.
    pub struct PJRT_ExecuteOptions {
        pub send_callbacks: *mut c_void,
        pub recv_callbacks: *mut c_void,
        pub num_send_ops: usize,
        pub num_recv_ops: usize,
        pub launch_id: c_int,
        pub non_donatable_input_indices: *const i64,
        pub num_non_donatable_input_indices: usize,
        pub context: *mut PJRT_ExecuteContext,
    }
    pub struct PJRT_LoadedExecutable_Execute_Args {
        pub executable: *mut PJRT_LoadedExecutable,
        pub options: *mut PJRT_ExecuteOptions,
        pub argument_lists: *const *const *mut PJRT_Buffer,
        pub num_devices: usize,
        pub num_args: usize,
        pub output_lists: *const *mut *mut PJRT_Buffer,
        pub device_complete_events: *mut *mut PJRT_Event,
        pub execute_device: *mut PJRT_Device,
    }
    pub struct PJRT_Buffer_Destroy_Args {
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_ElementType_Args {
        pub buffer: *mut PJRT_Buffer,
        pub type_: PJRT_Buffer_Type,
    }
    pub struct PJRT_Buffer_Dimensions_Args {
        pub buffer: *mut PJRT_Buffer,
        pub dims: *const i64,
        pub num_dims: usize,
    }
    pub struct PJRT_Buffer_ToHostBuffer_Args {
        pub src: *mut PJRT_Buffer,
        pub host_layout: *mut c_void,
        pub dst: *mut c_void,
        pub dst_size: usize,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Buffer_OnDeviceSizeInBytes_Args {
        pub buffer: *mut PJRT_Buffer,
        pub on_device_size_in_bytes: usize,
    }
    pub struct PJRT_Buffer_Device_Args {
        pub buffer: *mut PJRT_Buffer,
        pub device: *mut PJRT_Device,
    }
    pub struct PJRT_Buffer_CopyToDevice_Args {
        pub buffer: *mut PJRT_Buffer,
        pub dst_device: *mut PJRT_Device,
        pub dst_buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_ReadyEvent_Args {
        pub buffer: *mut PJRT_Buffer,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_TopologyDescription_Create_Args {
        pub topology_name: *const c_char,
        pub topology_name_size: usize,
        pub create_options: *const PJRT_NamedValue,
        pub num_options: usize,
        pub topology: *mut PJRT_TopologyDescription,
    }
    pub struct PJRT_TopologyDescription_Destroy_Args {
        pub topology: *mut PJRT_TopologyDescription,
    }
    pub struct PJRT_TopologyDescription_PlatformName_Args {
        pub topology: *const PJRT_TopologyDescription,
        pub platform_name: *const c_char,
        pub platform_name_size: usize,
    }
    pub struct PJRT_TopologyDescription_GetDeviceDescriptions_Args {
        pub topology: *const PJRT_TopologyDescription,
        pub descriptions: *const *mut PJRT_DeviceDescription,
        pub num_descriptions: usize,
    }
    pub struct PJRT_Compile_Args {
        pub topology: *const PJRT_TopologyDescription,
        pub program: *const PJRT_Program,
        pub compile_options: *const c_char,
        pub compile_options_size: usize,
        pub client: *mut PJRT_Client,
        pub executable: *mut PJRT_Executable,
    }
}

/// The `PJRT_Api` function table, in header order up to `PJRT_Compile`, the
/// last function oxidiff calls. A plugin's table may be longer (newer API) or,
/// in principle, shorter: read its `struct_size` before any slot.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub pjrt_api_version: PJRT_Api_Version,

    pub PJRT_Error_Destroy: Option<VoidFn<PJRT_Error_Destroy_Args>>,
    pub PJRT_Error_Message: Option<VoidFn<PJRT_Error_Message_Args>>,
    pub PJRT_Error_GetCode: Option<ErrFn<PJRT_Error_GetCode_Args>>,

    pub PJRT_Plugin_Initialize: Option<ErrFn<PJRT_Plugin_Initialize_Args>>,
    pub PJRT_Plugin_Attributes: Option<ErrFn<PJRT_Plugin_Attributes_Args>>,

    pub PJRT_Event_Destroy: Option<ErrFn<PJRT_Event_Destroy_Args>>,
    pub PJRT_Event_IsReady: Unused,
    pub PJRT_Event_Error: Unused,
    pub PJRT_Event_Await: Option<ErrFn<PJRT_Event_Await_Args>>,
    pub PJRT_Event_OnReady: Unused,

    pub PJRT_Client_Create: Option<ErrFn<PJRT_Client_Create_Args>>,
    pub PJRT_Client_Destroy: Option<ErrFn<PJRT_Client_Destroy_Args>>,
    pub PJRT_Client_PlatformName: Option<ErrFn<PJRT_Client_PlatformName_Args>>,
    pub PJRT_Client_ProcessIndex: Unused,
    pub PJRT_Client_PlatformVersion: Option<ErrFn<PJRT_Client_PlatformVersion_Args>>,
    pub PJRT_Client_Devices: Option<ErrFn<PJRT_Client_Devices_Args>>,
    pub PJRT_Client_AddressableDevices: Option<ErrFn<PJRT_Client_AddressableDevices_Args>>,
    pub PJRT_Client_LookupDevice: Unused,
    pub PJRT_Client_LookupAddressableDevice: Unused,
    pub PJRT_Client_AddressableMemories: Unused,
    pub PJRT_Client_Compile: Option<ErrFn<PJRT_Client_Compile_Args>>,
    pub PJRT_Client_DefaultDeviceAssignment: Unused,
    pub PJRT_Client_BufferFromHostBuffer: Option<ErrFn<PJRT_Client_BufferFromHostBuffer_Args>>,

    pub PJRT_DeviceDescription_Id: Option<ErrFn<PJRT_DeviceDescription_Id_Args>>,
    pub PJRT_DeviceDescription_ProcessIndex: Unused,
    pub PJRT_DeviceDescription_Attributes: Unused,
    pub PJRT_DeviceDescription_Kind: Option<ErrFn<PJRT_DeviceDescription_Kind_Args>>,
    pub PJRT_DeviceDescription_DebugString: Option<ErrFn<PJRT_DeviceDescription_DebugString_Args>>,
    pub PJRT_DeviceDescription_ToString: Unused,

    pub PJRT_Device_GetDescription: Option<ErrFn<PJRT_Device_GetDescription_Args>>,
    pub PJRT_Device_IsAddressable: Unused,
    pub PJRT_Device_LocalHardwareId: Unused,
    pub PJRT_Device_AddressableMemories: Unused,
    pub PJRT_Device_DefaultMemory: Unused,
    pub PJRT_Device_MemoryStats: Unused,

    pub PJRT_Memory_Id: Unused,
    pub PJRT_Memory_Kind: Unused,
    pub PJRT_Memory_DebugString: Unused,
    pub PJRT_Memory_ToString: Unused,
    pub PJRT_Memory_AddressableByDevices: Unused,

    pub PJRT_Executable_Destroy: Option<ErrFn<PJRT_Executable_Destroy_Args>>,
    pub PJRT_Executable_Name: Unused,
    pub PJRT_Executable_NumReplicas: Unused,
    pub PJRT_Executable_NumPartitions: Unused,
    pub PJRT_Executable_NumOutputs: Option<ErrFn<PJRT_Executable_NumOutputs_Args>>,
    pub PJRT_Executable_SizeOfGeneratedCodeInBytes:
        Option<ErrFn<PJRT_Executable_SizeOfGeneratedCodeInBytes_Args>>,
    pub PJRT_Executable_GetCostAnalysis: Option<ErrFn<PJRT_Executable_GetCostAnalysis_Args>>,
    pub PJRT_Executable_OutputMemoryKinds: Unused,
    pub PJRT_Executable_OptimizedProgram: Option<ErrFn<PJRT_Executable_OptimizedProgram_Args>>,
    pub PJRT_Executable_Serialize: Option<ErrFn<PJRT_Executable_Serialize_Args>>,

    pub PJRT_LoadedExecutable_Destroy: Option<ErrFn<PJRT_LoadedExecutable_Destroy_Args>>,
    pub PJRT_LoadedExecutable_GetExecutable:
        Option<ErrFn<PJRT_LoadedExecutable_GetExecutable_Args>>,
    pub PJRT_LoadedExecutable_AddressableDevices:
        Option<ErrFn<PJRT_LoadedExecutable_AddressableDevices_Args>>,
    pub PJRT_LoadedExecutable_Delete: Unused,
    pub PJRT_LoadedExecutable_IsDeleted: Unused,
    pub PJRT_LoadedExecutable_Execute: Option<ErrFn<PJRT_LoadedExecutable_Execute_Args>>,
    pub PJRT_Executable_DeserializeAndLoad: Option<ErrFn<PJRT_Executable_DeserializeAndLoad_Args>>,
    pub PJRT_LoadedExecutable_Fingerprint: Unused,

    pub PJRT_Buffer_Destroy: Option<ErrFn<PJRT_Buffer_Destroy_Args>>,
    pub PJRT_Buffer_ElementType: Option<ErrFn<PJRT_Buffer_ElementType_Args>>,
    pub PJRT_Buffer_Dimensions: Option<ErrFn<PJRT_Buffer_Dimensions_Args>>,
    pub PJRT_Buffer_UnpaddedDimensions: Unused,
    pub PJRT_Buffer_DynamicDimensionIndices: Unused,
    pub PJRT_Buffer_GetMemoryLayout: Unused,
    pub PJRT_Buffer_OnDeviceSizeInBytes: Option<ErrFn<PJRT_Buffer_OnDeviceSizeInBytes_Args>>,
    pub PJRT_Buffer_Device: Option<ErrFn<PJRT_Buffer_Device_Args>>,
    pub PJRT_Buffer_Memory: Unused,
    pub PJRT_Buffer_Delete: Unused,
    pub PJRT_Buffer_IsDeleted: Unused,
    pub PJRT_Buffer_CopyToDevice: Option<ErrFn<PJRT_Buffer_CopyToDevice_Args>>,
    pub PJRT_Buffer_ToHostBuffer: Option<ErrFn<PJRT_Buffer_ToHostBuffer_Args>>,
    pub PJRT_Buffer_IsOnCpu: Unused,
    pub PJRT_Buffer_ReadyEvent: Option<ErrFn<PJRT_Buffer_ReadyEvent_Args>>,
    pub PJRT_Buffer_UnsafePointer: Unused,
    pub PJRT_Buffer_IncreaseExternalReferenceCount: Unused,
    pub PJRT_Buffer_DecreaseExternalReferenceCount: Unused,
    pub PJRT_Buffer_OpaqueDeviceMemoryDataPointer: Unused,

    pub PJRT_CopyToDeviceStream_Destroy: Unused,
    pub PJRT_CopyToDeviceStream_AddChunk: Unused,
    pub PJRT_CopyToDeviceStream_TotalBytes: Unused,
    pub PJRT_CopyToDeviceStream_GranuleSize: Unused,
    pub PJRT_CopyToDeviceStream_CurrentBytes: Unused,

    pub PJRT_TopologyDescription_Create: Option<ErrFn<PJRT_TopologyDescription_Create_Args>>,
    pub PJRT_TopologyDescription_Destroy: Option<ErrFn<PJRT_TopologyDescription_Destroy_Args>>,
    pub PJRT_TopologyDescription_PlatformName:
        Option<ErrFn<PJRT_TopologyDescription_PlatformName_Args>>,
    pub PJRT_TopologyDescription_PlatformVersion: Unused,
    pub PJRT_TopologyDescription_GetDeviceDescriptions:
        Option<ErrFn<PJRT_TopologyDescription_GetDeviceDescriptions_Args>>,
    pub PJRT_TopologyDescription_Serialize: Unused,
    pub PJRT_TopologyDescription_Attributes: Unused,

    pub PJRT_Compile: Option<ErrFn<PJRT_Compile_Args>>,
}

// The sizes the plugins demand (their "expected N" for a too-small
// `struct_size`, identical on xla-cpu-pjrt 0.0.1 / API 0.81,
// lammps-jax-pjrt-cpu 0.11.2 / API 0.115 and libtpu 0.0.52 / API 0.117): a
// drift here means a field was mistyped.
const _: () = assert!(std::mem::size_of::<PJRT_Plugin_Attributes_Args>() == 32);
const _: () = assert!(std::mem::size_of::<PJRT_Client_Create_Args>() == 88);
const _: () = assert!(std::mem::size_of::<PJRT_Client_BufferFromHostBuffer_Args>() == 120);
const _: () = assert!(std::mem::size_of::<PJRT_Client_Compile_Args>() == 56);
const _: () = assert!(std::mem::size_of::<PJRT_LoadedExecutable_Execute_Args>() == 80);
const _: () = assert!(std::mem::size_of::<PJRT_Buffer_ToHostBuffer_Args>() == 56);
const _: () = assert!(std::mem::size_of::<PJRT_Buffer_CopyToDevice_Args>() == 40);
const _: () = assert!(std::mem::size_of::<PJRT_Executable_Serialize_Args>() == 56);
const _: () = assert!(std::mem::size_of::<PJRT_TopologyDescription_Create_Args>() == 56);
const _: () = assert!(std::mem::size_of::<PJRT_Compile_Args>() == 64);
const _: () = assert!(std::mem::size_of::<PJRT_Executable_DeserializeAndLoad_Args>() == 64);
const _: () = assert!(std::mem::size_of::<PJRT_Api_Version>() == 24);
// Both follow `PJRT_Executable_NumOutputs` in the header's table (checked
// against pjrt_c_api.h: Destroy, Name, NumReplicas, NumPartitions,
// NumOutputs, SizeOfGeneratedCodeInBytes, GetCostAnalysis, ...).
const _: () = assert!(std::mem::size_of::<PJRT_Executable_SizeOfGeneratedCodeInBytes_Args>() == 32);
const _: () = assert!(std::mem::size_of::<PJRT_Executable_GetCostAnalysis_Args>() == 40);
const _: () = assert!(
    std::mem::offset_of!(PJRT_Api, PJRT_Executable_GetCostAnalysis)
        == std::mem::offset_of!(PJRT_Api, PJRT_Executable_NumOutputs) + 16
);
const _: () = assert!(std::mem::offset_of!(PJRT_Api, PJRT_Error_Destroy) == 40);
// 90 slots after the 40-byte head, one pointer each.
const _: () = assert!(std::mem::size_of::<PJRT_Api>() == 40 + 90 * 8);

// ------------------------------ extensions -------------------------------------

/// `PJRT_Extension_Base`'s fields: every extension in the table's `extension_start` chain
/// begins with them.
#[repr(C)]
pub struct PJRT_Extension_Header {
    pub struct_size: usize,
    pub type_: c_int,
    pub next: *mut PJRT_Extension_Header,
}

/// `PJRT_Extension_Type_FFI`.
pub const PJRT_Extension_Type_FFI: c_int = 5;

/// `PJRT_FFI_Register_Handler_Args` (FFI extension version 3 on: no `extension_start`, no
/// `api_version`; typed handlers only).
#[repr(C)]
pub struct PJRT_FFI_Register_Handler_Args {
    pub struct_size: usize,
    pub target_name: *const c_char,
    pub target_name_size: usize,
    pub handler: *mut c_void,
    pub platform_name: *const c_char,
    pub platform_name_size: usize,
    pub traits: u32,
}

/// The same before FFI extension version 3: with `api_version` (1 for a typed handler).
#[repr(C)]
pub struct PJRT_FFI_Register_Handler_Args_V2 {
    pub struct_size: usize,
    pub target_name: *const c_char,
    pub target_name_size: usize,
    pub api_version: c_int,
    pub handler: *mut c_void,
    pub platform_name: *const c_char,
    pub platform_name_size: usize,
    pub traits: u32,
}

/// `PJRT_FFI_Extension`: the header, then `type_id_register`, `user_data_add` and
/// `register_handler` (the slot oxidiff reads).
#[repr(C)]
pub struct PJRT_FFI_Extension {
    pub base: PJRT_Extension_Header,
    pub type_id_register: *mut c_void,
    pub user_data_add: *mut c_void,
    pub register_handler: Option<unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error>,
}
