//! The SPMD run phase: a partitioned program on its device mesh, each input
//! split or copied per its layout, each weight as placed, one argument list
//! per device; the replicated results come back on the mesh's first device.

use std::collections::HashMap;

use burn_ir::{TensorId, TensorIr};

use super::run::{bind_results, upload_rng_state};
use super::shard::SpmdRun;
use super::sources::Source;
use super::tensors::Tensors;
use super::{CompileError, CompiledFn, Program};
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::pjrt::{self, Buffer};
use crate::spmd::Layout;

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Executes a partitioned `program` on its mesh: each input split or copied per its
    /// layout, each weight as placed, one argument list per device; binds partition 0's
    /// (replicated) results to `outputs`.
    pub(super) fn run_spmd(
        &self,
        spmd: &SpmdRun,
        client: &PjrtClient,
        device: &OxiDevice,
        program: &Program,
        inputs: &[TensorIr],
        outputs: &[TensorId],
    ) -> Result<(), CompileError> {
        let run_error = |message: String| CompileError::Run {
            name: self.name.clone(),
            device: device.clone(),
            message,
        };
        let placement = &spmd.placement;
        if placement.device() != *device {
            return Err(run_error(format!(
                "its inputs are on {device} but its device mesh starts at {}",
                placement.device()
            )));
        }
        let mesh = placement.mesh();
        let devices = placement.devices();
        let (pjrt_client, _) = client.target().map_err(run_error)?;

        // Each input used, one buffer per partition (`None`: the input's own buffer).
        let mut input_parts: HashMap<usize, Vec<Option<Buffer>>> = HashMap::new();
        for source in &program.sources {
            let Source::Input(k) = *source else {
                continue;
            };
            if input_parts.contains_key(&k) {
                continue;
            }
            let layout = spmd.input_layout(k, &inputs[k].shape);
            let id = inputs[k].id;
            let parts = client.with_buffers(|buffers| -> Result<Vec<Option<Buffer>>, String> {
                let full = buffers.get(&id).ok_or_else(|| {
                    format!("input {k} (tensor {id}) is not on the device (was it produced by an op that failed?)")
                })?;
                if layout == Layout::Replicated {
                    let mut parts = vec![None];
                    for d in &devices[1..] {
                        let copy = full
                            .copy_to_device(d)
                            .map_err(|e| format!("copying input {k}: {e}"))?;
                        parts.push(Some(copy));
                    }
                    return Ok(parts);
                }
                let shape = full.shape().map_err(|e| e.to_string())?;
                let dims: Vec<usize> = shape.dims.iter().map(|&d| d as usize).collect();
                layout
                    .check(mesh, &dims)
                    .map_err(|e| format!("input {k}: {e}"))?;
                let bytes = full.to_host().map_err(|e| e.to_string())?;
                let part_dims: Vec<i64> = layout
                    .part_dims(mesh, &dims)
                    .iter()
                    .map(|&d| d as i64)
                    .collect();
                let part_shape = pjrt::Shape::new(shape.element_type, part_dims);
                let elem = shape.element_type.byte_size();
                (0..mesh.partitions())
                    .map(|p| {
                        let part = layout.part_of(mesh, p, &bytes, &dims, elem);
                        pjrt_client
                            .buffer_from_host(&part, &part_shape, &devices[p])
                            .map(Some)
                            .map_err(|e| format!("splitting input {k}: {e}"))
                    })
                    .collect()
            });
            input_parts.insert(k, parts.map_err(run_error)?);
        }
        // The same random state on every device.
        let mut rng_states = Vec::new();
        for source in &program.sources {
            if matches!(source, Source::Rng) {
                let states = upload_rng_state(client, pjrt_client, devices).map_err(run_error)?;
                rng_states.push(states);
            }
        }
        // The executable's device order, as partitions.
        let order = program
            .executable
            .addressable_devices()
            .iter()
            .map(|d| {
                devices
                    .iter()
                    .position(|m| m.index() == d.index())
                    .ok_or_else(|| {
                        format!(
                            "the executable runs on device {} outside its mesh",
                            d.index()
                        )
                    })
            })
            .collect::<Result<Vec<usize>, String>>()
            .map_err(run_error)?;
        let captured: Vec<TensorId> = program
            .sources
            .iter()
            .filter_map(|s| match s {
                Source::Captured(id) => Some(*id),
                _ => None,
            })
            .collect();
        let results = placement
            .with_weights(&captured, |view| -> Result<Vec<Vec<Buffer>>, String> {
                let mut lists: Vec<Vec<&Buffer>> = Vec::with_capacity(order.len());
                for &p in &order {
                    let mut rng = rng_states.iter();
                    let mut args = Vec::with_capacity(program.sources.len());
                    for (i, source) in program.sources.iter().enumerate() {
                        let buffer = match source {
                            Source::Input(k) => match &input_parts[k][p] {
                                Some(part) => part,
                                None => view.eager.get(&inputs[*k].id).ok_or_else(|| {
                                    format!("input {k} is no longer on the device")
                                })?,
                            },
                            Source::Captured(id) => view.weight(*id, p).ok_or_else(|| {
                                format!("tensor {id}, which the closure captured (a weight), is no longer on the device: keep the module the closure uses alive")
                            })?,
                            Source::Owned(buffer) if p == 0 => buffer,
                            Source::Owned(_) => program
                                .replicas
                                .get(&i)
                                .and_then(|copies| copies.get(p - 1))
                                .ok_or_else(|| "a constant's copy is missing (a bug)".to_string())?,
                            Source::Shared(_) => {
                                return Err(
                                    "a partitioned program has a permuted kernel (a bug)"
                                        .to_string(),
                                )
                            }
                            Source::Rng => rng
                                .next()
                                .map(|states| &states[p])
                                .ok_or_else(|| "a random state is missing (a bug)".to_string())?,
                        };
                        args.push(buffer);
                    }
                    lists.push(args);
                }
                let lists: Vec<&[&Buffer]> = lists.iter().map(Vec::as_slice).collect();
                program
                    .executable
                    .execute_sharded(&lists)
                    .map_err(|e| format!("execution failed: {e}"))
            })
            .map_err(run_error)?
            .map_err(run_error)?;
        let first = order.iter().position(|&p| p == 0).unwrap_or(0);
        let Some(mine) = results.into_iter().nth(first) else {
            return Err(run_error(
                "the program returned no results for the first device".into(),
            ));
        };
        bind_results(client, outputs, mine).map_err(run_error)
    }
}
