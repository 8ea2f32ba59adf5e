//! Compiled programs: a [`LoadedExecutable`] is ready to run on a client's
//! devices; an [`Executable`] is compiled code not loaded anywhere (from
//! ahead-of-time compilation for a topology), which can be serialized.

use std::ptr;
use std::sync::Arc;

use super::api::{copy_slice, pjrt_call, read_named_values, Api, NamedValue};
use super::buffer::Buffer;
use super::client::{ClientInner, Device};
use super::error::{Error, Result};
use super::ffi::{self, Padded};
use super::plugin::Plugin;

/// A program compiled for, and loaded on, some of a client's devices.
pub struct LoadedExecutable {
    client: Arc<ClientInner>,
    raw: *mut ffi::PJRT_LoadedExecutable,
    num_outputs: usize,
    /// Indices of the client's devices it runs on, in the plugin's order.
    devices: Vec<usize>,
}

// SAFETY: PJRT executables may be executed and destroyed from any thread (the
// PJRT C API is thread safe); the cached metadata is immutable.
unsafe impl Send for LoadedExecutable {}
// SAFETY: as above.
unsafe impl Sync for LoadedExecutable {}

impl std::fmt::Debug for LoadedExecutable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedExecutable")
            .field("num_outputs", &self.num_outputs)
            .field("devices", &self.devices)
            .finish()
    }
}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        let mut args = Padded::<ffi::PJRT_LoadedExecutable_Destroy_Args>::new();
        args.executable = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: we own the executable and never use it again; its client is
        // alive (we hold an `Arc`). A failure cannot be reported from `drop`.
        let _ = unsafe {
            pjrt_call!(
                self.client.plugin.api(),
                PJRT_LoadedExecutable_Destroy,
                &mut args
            )
        };
    }
}

impl LoadedExecutable {
    /// Takes ownership of a freshly compiled executable and reads its
    /// output count and devices.
    pub(crate) fn from_raw(
        client: Arc<ClientInner>,
        raw: *mut ffi::PJRT_LoadedExecutable,
    ) -> Result<Self> {
        let mut exe = Self {
            client,
            raw,
            num_outputs: 0,
            devices: Vec::new(),
        };
        // From here `exe`'s drop frees the executable on any error.
        exe.num_outputs = exe.executable()?.num_outputs()?;
        let mut args = Padded::<ffi::PJRT_LoadedExecutable_AddressableDevices_Args>::new();
        args.executable = exe.raw;
        // SAFETY: a live executable; out-parameters only.
        unsafe {
            pjrt_call!(
                exe.api(),
                PJRT_LoadedExecutable_AddressableDevices,
                &mut args
            )
        }?;
        // SAFETY: the array lives as long as the executable.
        let raw_devices =
            unsafe { copy_slice(args.addressable_devices, args.num_addressable_devices) };
        exe.devices = raw_devices
            .into_iter()
            .map(|d| Device::from_raw(&exe.client, d).map(|d| d.index()))
            .collect::<Result<_>>()?;
        Ok(exe)
    }

    fn api(&self) -> &Api {
        self.client.plugin.api()
    }

    /// Outputs per device.
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// The devices it runs on, in the order `execute_sharded` takes them.
    pub fn addressable_devices(&self) -> Vec<Device> {
        self.devices
            .iter()
            .filter_map(|&index| Device::at(&self.client, index))
            .collect()
    }

    /// The compiled code, unloaded (`PJRT_LoadedExecutable_GetExecutable`).
    pub fn executable(&self) -> Result<Executable> {
        let mut args = Padded::<ffi::PJRT_LoadedExecutable_GetExecutable_Args>::new();
        args.loaded_executable = self.raw;
        // SAFETY: a live executable; the result is a new object we own.
        unsafe { pjrt_call!(self.api(), PJRT_LoadedExecutable_GetExecutable, &mut args) }?;
        Ok(Executable {
            plugin: self.client.plugin.clone(),
            raw: args.executable,
        })
    }

    /// Runs a single-device executable on `args`; returns its outputs. The
    /// run is asynchronous: outputs become ready later, and a failed run shows
    /// in [`Buffer::ready`] or [`Buffer::to_host`].
    pub fn execute(&self, args: &[&Buffer]) -> Result<Vec<Buffer>> {
        let mut outputs = self.execute_sharded(&[args])?;
        outputs.pop().ok_or_else(|| {
            Error::InvalidArgument("the executable returned no output list".to_string())
        })
    }

    /// Runs on every device of [`addressable_devices`](Self::addressable_devices):
    /// `argument_lists[device][arg]`, returning `outputs[device][output]`.
    pub fn execute_sharded(&self, argument_lists: &[&[&Buffer]]) -> Result<Vec<Vec<Buffer>>> {
        let num_devices = argument_lists.len();
        let num_args = argument_lists.first().map_or(0, |l| l.len());
        if num_devices != self.devices.len() {
            return Err(Error::InvalidArgument(format!(
                "the executable runs on {} device(s), got argument lists for {num_devices}",
                self.devices.len()
            )));
        }
        for list in argument_lists {
            if list.len() != num_args {
                return Err(Error::InvalidArgument(format!(
                    "every device needs the same number of arguments, got {} and {num_args}",
                    list.len()
                )));
            }
            for buffer in list.iter() {
                if !Arc::ptr_eq(&buffer.client, &self.client) {
                    return Err(Error::ForeignObject {
                        what: "argument buffer",
                    });
                }
            }
        }
        let raw_args: Vec<Vec<*mut ffi::PJRT_Buffer>> = argument_lists
            .iter()
            .map(|l| l.iter().map(|b| b.raw).collect())
            .collect();
        let arg_ptrs: Vec<*const *mut ffi::PJRT_Buffer> =
            raw_args.iter().map(|l| l.as_ptr()).collect();
        let mut raw_outputs: Vec<Vec<*mut ffi::PJRT_Buffer>> =
            vec![vec![ptr::null_mut(); self.num_outputs]; num_devices];
        let output_ptrs: Vec<*mut *mut ffi::PJRT_Buffer> =
            raw_outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();

        let mut options = Padded::<ffi::PJRT_ExecuteOptions>::new();
        let mut args = Padded::<ffi::PJRT_LoadedExecutable_Execute_Args>::new();
        args.executable = self.raw;
        args.options = options.as_mut_ptr();
        args.argument_lists = arg_ptrs.as_ptr();
        args.num_devices = num_devices;
        args.num_args = num_args;
        args.output_lists = output_ptrs.as_ptr();
        // SAFETY: `arg_ptrs` holds `num_devices` lists of `num_args` live
        // buffers of this client; `output_ptrs` holds `num_devices` lists of
        // `num_outputs` slots the plugin fills; all of them and `options`
        // outlive the call. No completion events are requested.
        unsafe { pjrt_call!(self.api(), PJRT_LoadedExecutable_Execute, &mut args) }?;
        Ok(raw_outputs
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|raw| Buffer::from_raw(self.client.clone(), raw))
                    .collect()
            })
            .collect())
    }

    /// The plugin's serialization of the compiled code.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        self.executable()?.serialize()
    }

    /// XLA's cost analysis of the compiled code ([`Executable::cost_analysis`]).
    pub fn cost_analysis(&self) -> Result<CostAnalysis> {
        self.executable()?.cost_analysis()
    }

    /// Bytes of generated code ([`Executable::generated_code_size`]).
    pub fn generated_code_size(&self) -> Result<i64> {
        self.executable()?.generated_code_size()
    }
}

/// XLA's static cost analysis of a compiled program
/// (`PJRT_Executable_GetCostAnalysis`): what a roofline estimate needs. The
/// properties are the plugin's (XLA's `HloCostAnalysis` names, for example
/// `flops`, `transcendentals`, `bytes accessed`, `bytes accessed0{}` per
/// operand, `optimal_seconds` on TPU); values are per device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostAnalysis {
    pub properties: Vec<(String, NamedValue)>,
}

impl CostAnalysis {
    /// The property `name` as a number, if the plugin reported it.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.properties
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, value)| match value {
                NamedValue::Float(v) => Some(f64::from(*v)),
                NamedValue::Int64(v) => Some(*v as f64),
                _ => None,
            })
    }

    /// Floating-point operations (a multiply-add counts two).
    pub fn flops(&self) -> Option<f64> {
        self.get("flops")
    }

    /// Transcendental operations (exp, log, tanh, ...).
    pub fn transcendentals(&self) -> Option<f64> {
        self.get("transcendentals")
    }

    /// Bytes read and written from memory (HBM on accelerators), after fusion.
    pub fn bytes_accessed(&self) -> Option<f64> {
        self.get("bytes accessed")
    }
}

/// Compiled code not loaded on any client.
pub struct Executable {
    plugin: Plugin,
    raw: *mut ffi::PJRT_Executable,
}

// SAFETY: PJRT executables may be used and destroyed from any thread (the PJRT
// C API is thread safe); `Executable` owns its handle exclusively.
unsafe impl Send for Executable {}
// SAFETY: as above.
unsafe impl Sync for Executable {}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut args = Padded::<ffi::PJRT_Executable_Destroy_Args>::new();
        args.executable = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: we own the executable and never use it again. A failure
        // cannot be reported from `drop`.
        let _ = unsafe { pjrt_call!(self.plugin.api(), PJRT_Executable_Destroy, &mut args) };
    }
}

impl Executable {
    pub(crate) fn from_raw(plugin: Plugin, raw: *mut ffi::PJRT_Executable) -> Self {
        Self { plugin, raw }
    }

    /// Outputs per device.
    pub fn num_outputs(&self) -> Result<usize> {
        let mut args = Padded::<ffi::PJRT_Executable_NumOutputs_Args>::new();
        args.executable = self.raw;
        // SAFETY: a live executable; out-parameters only.
        unsafe { pjrt_call!(self.plugin.api(), PJRT_Executable_NumOutputs, &mut args) }?;
        Ok(args.num_outputs)
    }

    /// XLA's cost analysis of the compiled code (see [`CostAnalysis`]).
    pub fn cost_analysis(&self) -> Result<CostAnalysis> {
        let mut args = Padded::<ffi::PJRT_Executable_GetCostAnalysis_Args>::new();
        args.executable = self.raw;
        // SAFETY: a live executable; out-parameters only.
        unsafe {
            pjrt_call!(
                self.plugin.api(),
                PJRT_Executable_GetCostAnalysis,
                &mut args
            )
        }?;
        // SAFETY: the properties live as long as the executable, which
        // outlives this copy.
        let properties = unsafe { read_named_values(args.properties, args.num_properties) };
        Ok(CostAnalysis { properties })
    }

    /// Bytes of generated code (`PJRT_Executable_SizeOfGeneratedCodeInBytes`):
    /// the program's size in device (or host) instruction memory.
    pub fn generated_code_size(&self) -> Result<i64> {
        let mut args = Padded::<ffi::PJRT_Executable_SizeOfGeneratedCodeInBytes_Args>::new();
        args.executable = self.raw;
        // SAFETY: a live executable; out-parameters only.
        unsafe {
            pjrt_call!(
                self.plugin.api(),
                PJRT_Executable_SizeOfGeneratedCodeInBytes,
                &mut args
            )
        }?;
        Ok(args.size_in_bytes)
    }

    /// The program after XLA's optimizations (`PJRT_Executable_OptimizedProgram`): its
    /// format (`hlo_with_config` or `hlo`: a serialized `HloModuleProtoWithConfig` or
    /// `HloModuleProto`) and bytes. [`hlo::opcode_counts`](super::hlo::opcode_counts) reads
    /// which instructions it has (the collectives of a partitioned program, for example).
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        let mut program = Padded::<ffi::PJRT_Program>::new();
        let mut args = Padded::<ffi::PJRT_Executable_OptimizedProgram_Args>::new();
        args.executable = self.raw;
        args.program = program.as_mut_ptr();
        // SAFETY: a live executable; with `code` null the plugin only sets `code_size` and
        // `format` (a string it owns, alive as long as the plugin).
        unsafe {
            pjrt_call!(
                self.plugin.api(),
                PJRT_Executable_OptimizedProgram,
                &mut args
            )
        }?;
        let mut code = vec![0u8; program.code_size];
        program.code = code.as_mut_ptr().cast();
        args.program = program.as_mut_ptr();
        // SAFETY: `code` is writable for `code_size` bytes and outlives the call.
        unsafe {
            pjrt_call!(
                self.plugin.api(),
                PJRT_Executable_OptimizedProgram,
                &mut args
            )
        }?;
        // SAFETY: the plugin's format string, `format_size` bytes.
        let format = unsafe { copy_slice(program.format.cast::<u8>(), program.format_size) };
        Ok((String::from_utf8_lossy(&format).into_owned(), code))
    }

    /// The plugin's serialization of the compiled code (not stable across
    /// plugin versions).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut args = Padded::<ffi::PJRT_Executable_Serialize_Args>::new();
        args.executable = self.raw;
        // SAFETY: a live executable; out-parameters only.
        unsafe { pjrt_call!(self.plugin.api(), PJRT_Executable_Serialize, &mut args) }?;
        // SAFETY: the bytes live until the deleter runs on
        // `serialized_executable`, which we call once, after copying.
        let bytes = unsafe {
            copy_slice(
                args.serialized_bytes.cast::<u8>(),
                args.serialized_bytes_size,
            )
        };
        if let Some(deleter) = args.serialized_executable_deleter {
            // SAFETY: as above; called exactly once.
            unsafe { deleter(args.serialized_executable) };
        }
        Ok(bytes)
    }
}
