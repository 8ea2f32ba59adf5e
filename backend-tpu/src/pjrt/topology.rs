//! Device topologies without devices: describe, say, a TPU v5e 2x2 slice and
//! compile for it ahead of time (`PJRT_Compile`), with no client and no
//! hardware. libtpu does this on any machine.

use std::ffi::c_char;
use std::ptr;

use super::api::{copy_slice, copy_string, pjrt_call, NamedValue, RawNamedValues};
use super::client::describe_description;
use super::compile_options::CompileOptions;
use super::error::Result;
use super::executable::Executable;
use super::ffi::{self, Padded};
use super::plugin::Plugin;

/// A device topology of a plugin (`PJRT_TopologyDescription`).
pub struct Topology {
    plugin: Plugin,
    raw: *mut ffi::PJRT_TopologyDescription,
    name: String,
}

// SAFETY: a topology description is immutable after creation and the PJRT C
// API is thread safe; `Topology` owns its handle exclusively.
unsafe impl Send for Topology {}
// SAFETY: as above.
unsafe impl Sync for Topology {}

/// A device of a topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyDevice {
    pub id: i32,
    pub kind: String,
    pub debug_string: String,
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topology")
            .field("name", &self.name)
            .finish()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut args = Padded::<ffi::PJRT_TopologyDescription_Destroy_Args>::new();
        args.topology = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: we own the topology and never use it again; executables
        // compiled for it do not refer to it. A failure cannot be reported
        // from `drop`.
        let _ = unsafe {
            pjrt_call!(
                self.plugin.api(),
                PJRT_TopologyDescription_Destroy,
                &mut args
            )
        };
    }
}

impl Plugin {
    /// The topology called `name` (for libtpu e.g. `v5e:2x2x1`, `v4:2x2x1`,
    /// `v6e:2x2x1`), with plugin-specific options.
    pub fn topology(&self, name: &str, options: &[(&str, NamedValue)]) -> Result<Topology> {
        Topology::new(self, name, options)
    }
}

impl Topology {
    pub fn new(plugin: &Plugin, name: &str, options: &[(&str, NamedValue)]) -> Result<Topology> {
        let named = RawNamedValues::new(options)?;
        let mut args = Padded::<ffi::PJRT_TopologyDescription_Create_Args>::new();
        args.topology_name = name.as_ptr().cast::<c_char>();
        args.topology_name_size = name.len();
        args.create_options = named.as_ptr();
        args.num_options = named.len();
        // SAFETY: the name and options outlive the call.
        unsafe { pjrt_call!(plugin.api(), PJRT_TopologyDescription_Create, &mut args) }?;
        Ok(Topology {
            plugin: plugin.clone(),
            raw: args.topology,
            name: name.to_string(),
        })
    }

    /// The name it was created with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The platform it describes (`tpu`).
    pub fn platform_name(&self) -> Result<String> {
        let mut args = Padded::<ffi::PJRT_TopologyDescription_PlatformName_Args>::new();
        args.topology = self.raw;
        // SAFETY: a live topology; out-parameters only.
        unsafe {
            pjrt_call!(
                self.plugin.api(),
                PJRT_TopologyDescription_PlatformName,
                &mut args
            )
        }?;
        // SAFETY: the name lives as long as the topology.
        Ok(unsafe { copy_string(args.platform_name, args.platform_name_size) })
    }

    /// Its devices.
    pub fn devices(&self) -> Result<Vec<TopologyDevice>> {
        let api = self.plugin.api();
        let mut args = Padded::<ffi::PJRT_TopologyDescription_GetDeviceDescriptions_Args>::new();
        args.topology = self.raw;
        // SAFETY: a live topology; out-parameters only.
        unsafe {
            pjrt_call!(
                api,
                PJRT_TopologyDescription_GetDeviceDescriptions,
                &mut args
            )
        }?;
        // SAFETY: the array lives as long as the topology.
        let descriptions = unsafe { copy_slice(args.descriptions, args.num_descriptions) };
        descriptions
            .into_iter()
            .map(|d| {
                describe_description(api, d).map(|(id, kind, debug_string)| TopologyDevice {
                    id,
                    kind,
                    debug_string,
                })
            })
            .collect()
    }

    /// Compiles a StableHLO module (MLIR text) for this topology, ahead of
    /// time: the result can be serialized and loaded on matching hardware.
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<Executable> {
        let encoded = options.encode();
        let format = "mlir";
        let mut program = Padded::<ffi::PJRT_Program>::new();
        // The plugin only reads `code` for compilation; the cast to `*mut`
        // follows the header's in/out declaration.
        program.code = mlir.as_ptr().cast::<c_char>().cast_mut();
        program.code_size = mlir.len();
        program.format = format.as_ptr().cast();
        program.format_size = format.len();
        let mut args = Padded::<ffi::PJRT_Compile_Args>::new();
        args.topology = self.raw;
        args.program = &*program;
        args.compile_options = encoded.as_ptr().cast();
        args.compile_options_size = encoded.len();
        // SAFETY: the topology, program, text, format and options outlive the
        // call; no client is given (it is optional).
        unsafe { pjrt_call!(self.plugin.api(), PJRT_Compile, &mut args) }?;
        Ok(Executable::from_raw(self.plugin.clone(), args.executable))
    }
}
