//! A PJRT client (one plugin's view of its devices) and its devices: creates
//! buffers from host data and compiles StableHLO into loaded executables.

use std::ffi::c_char;
use std::ptr;
use std::sync::Arc;

use super::api::{copy_slice, copy_string, pjrt_call, NamedValue, RawNamedValues};
use super::buffer::{Buffer, NativeType, Shape};
use super::compile_options::CompileOptions;
use super::discovery::PluginKind;
use super::error::{Error, ErrorCode, Result};
use super::executable::LoadedExecutable;
use super::ffi::{self, Padded};
use super::plugin::{tpu_device_present, Plugin};

/// A PJRT client. Cheap to clone; the client is destroyed when the last
/// clone, buffer, device and executable of it is gone.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

pub(crate) struct ClientInner {
    pub(crate) plugin: Plugin,
    pub(crate) raw: *mut ffi::PJRT_Client,
    platform_name: String,
    platform_version: String,
    /// The addressable devices, in the plugin's order.
    devices: Vec<DeviceInfo>,
    /// Number of devices of the whole (possibly multi-process) system.
    global_device_count: usize,
}

// SAFETY: a PJRT client may be used from any thread (the PJRT C API is thread
// safe); the cached metadata is immutable.
unsafe impl Send for ClientInner {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

struct DeviceInfo {
    raw: *mut ffi::PJRT_Device,
    id: i32,
    kind: String,
    debug_string: String,
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut args = Padded::<ffi::PJRT_Client_Destroy_Args>::new();
        args.client = self.raw;
        // SAFETY: every buffer and executable holds an `Arc` to this client,
        // so none is alive; the handle is not used again. A failure cannot be
        // reported from `drop`.
        let _ = unsafe { pjrt_call!(self.plugin.api(), PJRT_Client_Destroy, &mut args) };
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("platform", &self.inner.platform_name)
            .field("version", &self.inner.platform_version)
            .field("devices", &self.inner.devices.len())
            .finish()
    }
}

impl Plugin {
    /// A client with the plugin's default options.
    pub fn client(&self) -> Result<Client> {
        Client::new(self, &[])
    }

    /// A client with named create options, e.g. `("cpu_device_count", 2i64.into())`
    /// for the XLA CPU plugin.
    pub fn client_with_options(&self, options: &[(&str, NamedValue)]) -> Result<Client> {
        Client::new(self, options)
    }
}

impl Client {
    /// Creates a client of `plugin` and checks its platform is the one the
    /// plugin was loaded as.
    pub fn new(plugin: &Plugin, options: &[(&str, NamedValue)]) -> Result<Client> {
        let api = plugin.api();
        let named = RawNamedValues::new(options)?;
        let mut args = Padded::<ffi::PJRT_Client_Create_Args>::new();
        args.create_options = named.as_ptr();
        args.num_options = named.len();
        // SAFETY: `named` outlives the call; no key-value callbacks are given.
        let created = unsafe { pjrt_call!(api, PJRT_Client_Create, &mut args) };
        if let Err(e) = created {
            return Err(explain_create_error(plugin, e));
        }
        let mut inner = ClientInner {
            plugin: plugin.clone(),
            raw: args.client,
            platform_name: String::new(),
            platform_version: String::new(),
            devices: Vec::new(),
            global_device_count: 0,
        };
        // From here `inner`'s drop destroys the client on any error.
        inner.platform_name = inner.query_platform_name()?;
        inner.platform_version = inner.query_platform_version()?;
        if let Some(kind) = plugin.kind() {
            if !kind
                .platform_names()
                .contains(&inner.platform_name.as_str())
            {
                return Err(Error::PlatformMismatch {
                    path: plugin.path().clone(),
                    expected: kind.name().to_string(),
                    found: inner.platform_name.clone(),
                });
            }
        }
        inner.devices = inner.query_devices()?;
        inner.global_device_count = inner.query_global_device_count()?;
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// The plugin this client belongs to.
    pub fn plugin(&self) -> &Plugin {
        &self.inner.plugin
    }

    /// The platform name (`cpu`, `tpu`, `cuda`).
    pub fn platform_name(&self) -> &str {
        &self.inner.platform_name
    }

    /// The platform's version string.
    pub fn platform_version(&self) -> &str {
        &self.inner.platform_version
    }

    /// The devices this process can use, indexed from 0.
    pub fn devices(&self) -> Vec<Device> {
        (0..self.inner.devices.len())
            .map(|index| Device {
                client: self.inner.clone(),
                index,
            })
            .collect()
    }

    /// Number of addressable devices.
    pub fn device_count(&self) -> usize {
        self.inner.devices.len()
    }

    /// Number of devices in the whole system (`PJRT_Client_Devices`),
    /// including other processes' devices.
    pub fn global_device_count(&self) -> usize {
        self.inner.global_device_count
    }

    /// Addressable device number `index`.
    pub fn device(&self, index: usize) -> Result<Device> {
        if index >= self.inner.devices.len() {
            return Err(Error::DeviceIndexOutOfRange {
                index,
                count: self.inner.devices.len(),
                platform: self.inner.platform_name.clone(),
            });
        }
        Ok(Device {
            client: self.inner.clone(),
            index,
        })
    }

    /// Copies a dense row-major host array of `shape` to `device`; returns once
    /// the plugin no longer reads `bytes`.
    pub fn buffer_from_host(&self, bytes: &[u8], shape: &Shape, device: &Device) -> Result<Buffer> {
        device.check_client(&self.inner)?;
        let expected = shape.byte_size()?;
        if bytes.len() != expected {
            return Err(Error::InvalidArgument(format!(
                "host data has {} bytes, shape {:?} of {:?} needs {expected}",
                bytes.len(),
                shape.dims,
                shape.element_type
            )));
        }
        // SAFETY: `bytes` holds the whole dense array the plugin reads.
        unsafe { self.transfer(bytes.as_ptr(), shape, None, device) }
    }

    /// Copies a strided view of host bytes to `device` as a dense array of `shape`: element
    /// `[i0, i1, ...]` is read at `offset + Σ i_k * byte_strides[k]` (non-negative strides),
    /// so the plugin transposes or slices while it copies and the host makes no copy. Returns
    /// once the plugin no longer reads `bytes`.
    pub fn buffer_from_strided_host(
        &self,
        bytes: &[u8],
        offset: usize,
        shape: &Shape,
        byte_strides: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        device.check_client(&self.inner)?;
        let elem = shape.element_type.byte_size();
        if byte_strides.len() != shape.dims.len() || byte_strides.iter().any(|&s| s < 0) {
            return Err(Error::InvalidArgument(format!(
                "byte strides {byte_strides:?} do not fit dims {:?}",
                shape.dims
            )));
        }
        // The last byte the view reads must lie inside `bytes`.
        let mut last = offset as u128 + elem as u128;
        for (&d, &s) in shape.dims.iter().zip(byte_strides) {
            if d <= 0 {
                last = 0;
                break;
            }
            last += (d as u128 - 1) * s as u128;
        }
        if last > bytes.len() as u128 {
            return Err(Error::InvalidArgument(format!(
                "a view of dims {:?} with byte strides {byte_strides:?} from byte {offset} reads                  past the {} bytes given",
                shape.dims,
                bytes.len()
            )));
        }
        // SAFETY: checked above: every element the view reads lies within `bytes`, which
        // outlives the call.
        unsafe {
            let data = bytes.as_ptr().add(offset.min(bytes.len()));
            self.transfer(data, shape, Some(byte_strides), device)
        }
    }

    /// Copies host memory at `data`, dense or through `byte_strides`, to `device`; returns once
    /// the plugin no longer reads it.
    ///
    /// # Safety
    /// Every byte the plugin reads for `shape` from `data` (dense, or through the strides) must
    /// stay readable until this returns.
    unsafe fn transfer(
        &self,
        data: *const u8,
        shape: &Shape,
        byte_strides: Option<&[i64]>,
        device: &Device,
    ) -> Result<Buffer> {
        let api = self.inner.plugin.api();
        let mut args = Padded::<ffi::PJRT_Client_BufferFromHostBuffer_Args>::new();
        args.client = self.inner.raw;
        args.data = data.cast();
        args.type_ = shape.element_type.to_raw();
        args.dims = shape.dims.as_ptr();
        args.num_dims = shape.dims.len();
        if let Some(strides) = byte_strides {
            args.byte_strides = strides.as_ptr();
            args.num_byte_strides = strides.len();
        }
        args.host_buffer_semantics = ffi::PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
        args.device = device.raw();
        // SAFETY: the data (the caller's promise), `shape.dims` and the strides are valid for
        // the call; with kImmutableUntilTransferCompletes the plugin may read the data until
        // `done_with_host_buffer` fires, and we wait for that event below, before the data can
        // be released. (With the zero-copy semantics the event would fire only when the buffer
        // is destroyed: waiting would deadlock.)
        unsafe { pjrt_call!(api, PJRT_Client_BufferFromHostBuffer, &mut args) }?;
        let buffer = Buffer::from_raw(self.inner.clone(), args.buffer);
        api.await_event(
            "PJRT_Client_BufferFromHostBuffer",
            args.done_with_host_buffer,
        )?;
        Ok(buffer)
    }

    /// Copies a typed host slice of dimensions `dims` to `device`.
    pub fn buffer_from_slice<T: NativeType>(
        &self,
        data: &[T],
        dims: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        // SAFETY: `NativeType`s are plain numbers without padding, so their
        // memory is `size_of_val(data)` initialized bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        self.buffer_from_host(bytes, &Shape::new(T::ELEMENT_TYPE, dims), device)
    }

    /// Compiles a StableHLO module given as MLIR text.
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<LoadedExecutable> {
        let api = self.inner.plugin.api();
        let encoded = options.encode();
        let format = "mlir";
        let mut program = Padded::<ffi::PJRT_Program>::new();
        // The plugin only reads `code` for compilation; the cast to `*mut`
        // follows the header's in/out declaration.
        program.code = mlir.as_ptr().cast::<c_char>().cast_mut();
        program.code_size = mlir.len();
        program.format = format.as_ptr().cast();
        program.format_size = format.len();
        let mut args = Padded::<ffi::PJRT_Client_Compile_Args>::new();
        args.client = self.inner.raw;
        args.program = &*program;
        args.compile_options = encoded.as_ptr().cast();
        args.compile_options_size = encoded.len();
        // SAFETY: `program`, the text, the format and the encoded options all
        // outlive the call.
        unsafe { pjrt_call!(api, PJRT_Client_Compile, &mut args) }?;
        LoadedExecutable::from_raw(self.inner.clone(), args.executable)
    }

    /// Loads an executable serialized by
    /// [`LoadedExecutable::serialize`] with this plugin version.
    pub fn deserialize_and_load(&self, serialized: &[u8]) -> Result<LoadedExecutable> {
        let mut args = Padded::<ffi::PJRT_Executable_DeserializeAndLoad_Args>::new();
        args.client = self.inner.raw;
        args.serialized_executable = serialized.as_ptr().cast();
        args.serialized_executable_size = serialized.len();
        // SAFETY: the bytes outlive the call; the executable is an
        // out-parameter we take ownership of.
        unsafe {
            pjrt_call!(
                self.inner.plugin.api(),
                PJRT_Executable_DeserializeAndLoad,
                &mut args
            )
        }?;
        LoadedExecutable::from_raw(self.inner.clone(), args.loaded_executable)
    }
}

/// Turns libtpu's "no device" failure into [`Error::NoTpu`].
fn explain_create_error(plugin: &Plugin, error: Error) -> Error {
    match error {
        Error::Pjrt { code, message, .. }
            if plugin.kind() == Some(PluginKind::Tpu)
                && (code == ErrorCode::NotFound || !tpu_device_present()) =>
        {
            Error::NoTpu {
                detail: format!("libtpu: {message}"),
            }
        }
        other => other,
    }
}

impl ClientInner {
    fn api(&self) -> &super::api::Api {
        self.plugin.api()
    }

    fn query_platform_name(&self) -> Result<String> {
        let mut args = Padded::<ffi::PJRT_Client_PlatformName_Args>::new();
        args.client = self.raw;
        // SAFETY: a live client; out-parameters only.
        unsafe { pjrt_call!(self.api(), PJRT_Client_PlatformName, &mut args) }?;
        // SAFETY: the name lives as long as the client.
        Ok(unsafe { copy_string(args.platform_name, args.platform_name_size) })
    }

    fn query_platform_version(&self) -> Result<String> {
        let mut args = Padded::<ffi::PJRT_Client_PlatformVersion_Args>::new();
        args.client = self.raw;
        // SAFETY: a live client; out-parameters only.
        unsafe { pjrt_call!(self.api(), PJRT_Client_PlatformVersion, &mut args) }?;
        // SAFETY: the version lives as long as the client.
        Ok(unsafe { copy_string(args.platform_version, args.platform_version_size) })
    }

    fn query_devices(&self) -> Result<Vec<DeviceInfo>> {
        let mut args = Padded::<ffi::PJRT_Client_AddressableDevices_Args>::new();
        args.client = self.raw;
        // SAFETY: a live client; out-parameters only.
        unsafe { pjrt_call!(self.api(), PJRT_Client_AddressableDevices, &mut args) }?;
        // SAFETY: the array lives as long as the client.
        let raw = unsafe { copy_slice(args.addressable_devices, args.num_addressable_devices) };
        raw.into_iter()
            .map(|device| self.describe(device))
            .collect()
    }

    fn query_global_device_count(&self) -> Result<usize> {
        let mut args = Padded::<ffi::PJRT_Client_Devices_Args>::new();
        args.client = self.raw;
        // SAFETY: a live client; out-parameters only.
        unsafe { pjrt_call!(self.api(), PJRT_Client_Devices, &mut args) }?;
        Ok(args.num_devices)
    }

    fn describe(&self, device: *mut ffi::PJRT_Device) -> Result<DeviceInfo> {
        let api = self.api();
        let mut get = Padded::<ffi::PJRT_Device_GetDescription_Args>::new();
        get.device = device;
        // SAFETY: `device` is one of this client's devices.
        unsafe { pjrt_call!(api, PJRT_Device_GetDescription, &mut get) }?;
        let description = get.device_description;
        let (id, kind, debug_string) = describe_description(api, description)?;
        Ok(DeviceInfo {
            raw: device,
            id,
            kind,
            debug_string,
        })
    }
}

/// Id, kind and debug string of a device description.
pub(crate) fn describe_description(
    api: &super::api::Api,
    description: *mut ffi::PJRT_DeviceDescription,
) -> Result<(i32, String, String)> {
    let mut id = Padded::<ffi::PJRT_DeviceDescription_Id_Args>::new();
    id.device_description = description;
    // SAFETY: `description` is a live description owned by its device or
    // topology.
    unsafe { pjrt_call!(api, PJRT_DeviceDescription_Id, &mut id) }?;
    let mut kind = Padded::<ffi::PJRT_DeviceDescription_Kind_Args>::new();
    kind.device_description = description;
    // SAFETY: as above.
    unsafe { pjrt_call!(api, PJRT_DeviceDescription_Kind, &mut kind) }?;
    let mut debug = Padded::<ffi::PJRT_DeviceDescription_DebugString_Args>::new();
    debug.device_description = description;
    // SAFETY: as above.
    unsafe { pjrt_call!(api, PJRT_DeviceDescription_DebugString, &mut debug) }?;
    // SAFETY: the strings live as long as the description.
    let (kind, debug) = unsafe {
        (
            copy_string(kind.device_kind, kind.device_kind_size),
            copy_string(debug.debug_string, debug.debug_string_size),
        )
    };
    Ok((id.id, kind, debug))
}

/// One addressable device of a client.
#[derive(Clone)]
pub struct Device {
    client: Arc<ClientInner>,
    index: usize,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("index", &self.index)
            .field("id", &self.id())
            .field("kind", &self.kind())
            .finish()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.client, &other.client) && self.index == other.index
    }
}
impl Eq for Device {}

impl Device {
    fn info(&self) -> &DeviceInfo {
        // `index` was checked against the device list when the `Device` was
        // made, and the list never changes.
        &self.client.devices[self.index]
    }

    /// Position among the client's addressable devices.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The plugin's device id (unique in the system).
    pub fn id(&self) -> i32 {
        self.info().id
    }

    /// The device kind, e.g. `cpu` or `TPU v5 lite`.
    pub fn kind(&self) -> &str {
        &self.info().kind
    }

    /// The plugin's verbose description.
    pub fn debug_string(&self) -> &str {
        &self.info().debug_string
    }

    pub(crate) fn raw(&self) -> *mut ffi::PJRT_Device {
        self.info().raw
    }

    /// The `Device` for a raw device pointer of `client`.
    pub(crate) fn from_raw(
        client: &Arc<ClientInner>,
        raw: *mut ffi::PJRT_Device,
    ) -> Result<Device> {
        client
            .devices
            .iter()
            .position(|d| ptr::eq(d.raw, raw))
            .map(|index| Device {
                client: client.clone(),
                index,
            })
            .ok_or_else(|| {
                Error::InvalidArgument(
                    "the plugin returned a device that is not addressable".to_string(),
                )
            })
    }

    /// Addressable device `index` of `client`, if it exists.
    pub(crate) fn at(client: &Arc<ClientInner>, index: usize) -> Option<Device> {
        (index < client.devices.len()).then(|| Device {
            client: client.clone(),
            index,
        })
    }

    pub(crate) fn check_client(&self, client: &Arc<ClientInner>) -> Result<()> {
        if Arc::ptr_eq(&self.client, client) {
            Ok(())
        } else {
            Err(Error::ForeignObject { what: "device" })
        }
    }
}
