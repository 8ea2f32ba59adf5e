//! The shard phase of a partitioned program ([`CompiledFn::with_spmd`]):
//! each argument's and result's `mhlo.sharding`, the program's own buffers
//! copied to the mesh's other devices, and the SPMD compile options.

use std::collections::HashMap;
use std::sync::Arc;

use super::sources::Source;
use super::tensors::Tensors;
use super::{CompileError, CompiledFn};
use crate::device::OxiDevice;
use crate::lowering::LoweredFunction;
use crate::pjrt::{self, Buffer, CompileOptions};
use crate::spmd::{Layout, SpmdPlacement};

/// How a partitioned function runs ([`CompiledFn::with_spmd`]).
pub(super) struct SpmdRun {
    pub(super) placement: Arc<SpmdPlacement>,
    /// The layout of each input, by position (missing ones are replicated).
    pub(super) inputs: Vec<Layout>,
}

impl SpmdRun {
    /// Input `k`'s layout for shape `dims`: a batch split that does not divide (a batch of
    /// one on two devices) keeps the input whole, and the partitioner splits what it can.
    pub(super) fn input_layout(&self, k: usize, dims: &[usize]) -> Layout {
        match self.inputs.get(k).copied().unwrap_or(Layout::Replicated) {
            layout @ Layout::BatchSplit(_)
                if layout.check(self.placement.mesh(), dims).is_err() =>
            {
                Layout::Replicated
            }
            layout => layout,
        }
    }

    /// `function`'s module with a sharding on every argument (by its source)
    /// and replicated results, for a program whose inputs are on `device`.
    fn partitioned_module(
        &self,
        device: &OxiDevice,
        function: &LoweredFunction,
        sources: &[Source],
    ) -> Result<String, String> {
        let mesh = self.placement.mesh();
        if self.placement.device() != *device {
            return Err(format!(
                "its inputs are on {device} but its device mesh starts at {}",
                self.placement.device()
            ));
        }
        let mut shardings = Vec::with_capacity(sources.len());
        for (source, (_, ty)) in sources.iter().zip(&function.arguments) {
            let layout = match source {
                Source::Input(k) => self.input_layout(*k, &ty.dims),
                Source::Captured(id) => self.placement.layout_of(*id),
                _ => Layout::Replicated,
            };
            layout
                .check(mesh, &ty.dims)
                .map_err(|e| format!("an argument of type {}: {e}", ty.mlir()))?;
            shardings.push(layout.hlo_sharding(mesh, ty.dims.len()));
        }
        let results = vec![Layout::Replicated.hlo_sharding(mesh, 0); function.results.len()];
        Ok(function.partitioned(mesh.partitions(), &shardings, &results))
    }

    /// Copies of each buffer the program owns (by argument index) on the
    /// mesh's other devices, in partition order from partition 1.
    fn replicate_owned(&self, sources: &[Source]) -> pjrt::Result<HashMap<usize, Vec<Buffer>>> {
        let mut replicas = HashMap::new();
        for (i, source) in sources.iter().enumerate() {
            if let Source::Owned(buffer) = source {
                let copies = self.placement.devices()[1..]
                    .iter()
                    .map(|d| buffer.copy_to_device(d))
                    .collect::<pjrt::Result<Vec<_>>>()?;
                replicas.insert(i, copies);
            }
        }
        Ok(replicas)
    }

    /// Compile options for one partition per mesh device.
    pub(super) fn compile_options(&self) -> CompileOptions {
        let ids: Vec<i64> = self
            .placement
            .devices()
            .iter()
            .map(|d| i64::from(d.id()))
            .collect();
        CompileOptions::spmd(&ids)
    }
}

/// A program's module and, when partitioned, its owned buffers' copies.
pub(super) type Partitioned = (String, HashMap<usize, Vec<Buffer>>);

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// The module to compile: `function`'s own, or with shardings when the
    /// function is partitioned, whose owned buffers are then replicated.
    pub(super) fn partition(
        &self,
        device: &OxiDevice,
        function: &mut LoweredFunction,
        sources: &[Source],
    ) -> Result<Partitioned, CompileError> {
        let Some(spmd) = &self.spmd else {
            return Ok((std::mem::take(&mut function.module), HashMap::new()));
        };
        let module = spmd
            .partitioned_module(device, function, sources)
            .map_err(|message| CompileError::Placement {
                name: self.name.clone(),
                message,
            })?;
        let replicas = spmd
            .replicate_owned(sources)
            .map_err(|e| CompileError::Run {
                name: self.name.clone(),
                device: device.clone(),
                message: format!("replicating a constant: {e}"),
            })?;
        Ok((module, replicas))
    }
}
