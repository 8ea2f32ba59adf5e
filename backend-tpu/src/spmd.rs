//! One compiled program over several devices, partitioned by XLA (GSPMD): a `dp x tp`
//! [`Mesh`] of devices of one PJRT client, a [`Layout`] per program argument (replicated, split
//! over the tensor-parallel axis, or split over the batch axis), written into the module as
//! `mhlo.sharding` attributes, and the weights' shards placed once on their devices
//! ([`SpmdPlacement`]), so each device holds only its slice of a split weight.
//!
//! Where this sits: models declare which layers split (`oxidiff-parallel` plans);
//! pipelines turn a plan into tensor ids and [`Layout`]s; [`CompiledFn::with_spmd`](crate::CompiledFn::with_spmd)
//! runs the program on the mesh. XLA's partitioner inserts the collectives (all-reduce after a
//! row-wise layer, whatever resharding the layouts need); results come back replicated, and the
//! caller sees them on the mesh's first device, as if one device had run the program.

use std::collections::HashMap;
use std::sync::Mutex;

use burn_router::{RouterTensor, RunnerClient};

use crate::channel::pjrt_client;
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::pjrt::{self, Buffer};

/// A `dp x tp` mesh of consecutive devices of one PJRT client: partition `p` is batch slice
/// `p / tp` and tensor slice `p % tp`, and runs on device `first + p`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    pub dp: usize,
    pub tp: usize,
}

impl Mesh {
    pub fn new(dp: usize, tp: usize) -> Self {
        Self {
            dp: dp.max(1),
            tp: tp.max(1),
        }
    }

    /// Partitions (devices) of the mesh.
    pub fn partitions(&self) -> usize {
        self.dp * self.tp
    }
}

/// How one argument (or result) of a partitioned program is laid out over the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Every device holds all of it.
    Replicated,
    /// Dimension `d` split over the tensor-parallel axis (a sharded weight), replicated over
    /// the batch axis.
    TensorSplit(usize),
    /// Dimension `d`, made of `packed` equal segments side by side (GEGLU's value and gate
    /// columns), split over the tensor-parallel axis segment by segment: block `t` is slice
    /// `t` of every segment, so each device holds matching values and gates. The program sees
    /// the tensor in that block order (the model reads it so: see `FeedForward::geglu_groups`).
    PackedTensorSplit(usize, usize),
    /// Dimension `d` split over the batch axis (data parallelism), replicated over the
    /// tensor-parallel axis.
    BatchSplit(usize),
}

impl Layout {
    /// The split dimension and its number of blocks on `mesh`, or `None` when every device
    /// holds the whole tensor.
    fn split(&self, mesh: &Mesh, rank: usize) -> Option<(usize, usize)> {
        match *self {
            Self::TensorSplit(d) | Self::PackedTensorSplit(d, _) if d < rank && mesh.tp > 1 => {
                Some((d, mesh.tp))
            }
            Self::BatchSplit(d) if d < rank && mesh.dp > 1 => Some((d, mesh.dp)),
            _ => None,
        }
    }

    /// Which block of the split dimension partition `p` holds.
    fn block_of(&self, mesh: &Mesh, p: usize) -> usize {
        match self {
            Self::TensorSplit(_) | Self::PackedTensorSplit(..) => p % mesh.tp,
            _ => p / mesh.tp,
        }
    }

    /// Segments of the split dimension ([`PackedTensorSplit`](Self::PackedTensorSplit)), else 1.
    fn packed(&self) -> usize {
        match *self {
            Self::PackedTensorSplit(_, packed) => packed.max(1),
            _ => 1,
        }
    }

    /// The `mhlo.sharding` attribute value for a tensor of rank `rank`, in XLA's HloSharding
    /// syntax: `{replicated}`, `{devices=[1,4]0,1,2,3}`, and on a 2-D mesh
    /// `{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}` (the last tile dimension lists the
    /// devices that hold the same block).
    pub fn hlo_sharding(&self, mesh: &Mesh, rank: usize) -> String {
        let Some((dim, blocks)) = self.split(mesh, rank) else {
            return "{replicated}".to_string();
        };
        let mut tiles = vec![1; rank];
        tiles[dim] = blocks;
        let copies = mesh.partitions() / blocks;
        let mut devices = Vec::with_capacity(mesh.partitions());
        for block in 0..blocks {
            for copy in 0..copies {
                devices.push(match self {
                    Self::TensorSplit(_) | Self::PackedTensorSplit(..) => copy * mesh.tp + block,
                    _ => block * mesh.tp + copy,
                });
            }
        }
        let devices = devices
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",");
        if copies > 1 {
            tiles.push(copies);
        }
        let tiles = tiles
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let replicate = if copies > 1 {
            " last_tile_dim_replicate"
        } else {
            ""
        };
        format!("{{devices=[{tiles}]{devices}{replicate}}}")
    }

    /// The bytes of partition `p`'s part of a row-major tensor `bytes` of shape `dims` with
    /// `elem` bytes per element.
    pub fn part_of(
        &self,
        mesh: &Mesh,
        p: usize,
        bytes: &[u8],
        dims: &[usize],
        elem: usize,
    ) -> Vec<u8> {
        let Some((dim, blocks)) = self.split(mesh, dims.len()) else {
            return bytes.to_vec();
        };
        let block = self.block_of(mesh, p);
        let packed = self.packed();
        let outer: usize = dims[..dim].iter().product();
        let inner: usize = dims[dim + 1..].iter().product::<usize>() * elem;
        let segment = dims[dim] / packed * inner;
        let chunk = dims[dim] / packed / blocks * inner;
        let row = dims[dim] * inner;
        let mut part = Vec::with_capacity(outer * chunk * packed);
        for o in 0..outer {
            for s in 0..packed {
                let start = o * row + s * segment + block * chunk;
                part.extend_from_slice(&bytes[start..start + chunk]);
            }
        }
        part
    }

    /// The indices of dimension `dim` (of a tensor of shape `dims`) that partition `p`'s part
    /// holds, in order: all of them unless `dim` is the split one.
    pub(crate) fn source_indices(
        &self,
        mesh: &Mesh,
        p: usize,
        dims: &[usize],
        dim: usize,
    ) -> Vec<usize> {
        match self.split(mesh, dims.len()) {
            Some((d, blocks)) if d == dim => {
                let block = self.block_of(mesh, p);
                let packed = self.packed();
                let segment = dims[d] / packed;
                let chunk = segment / blocks;
                (0..packed)
                    .flat_map(|s| (0..chunk).map(move |k| s * segment + block * chunk + k))
                    .collect()
            }
            _ => (0..dims[dim]).collect(),
        }
    }

    /// The shape of partition `p`'s part.
    pub fn part_dims(&self, mesh: &Mesh, dims: &[usize]) -> Vec<usize> {
        let mut dims = dims.to_vec();
        if let Some((dim, blocks)) = self.split(mesh, dims.len()) {
            dims[dim] /= blocks;
        }
        dims
    }

    /// Why `dims` cannot take this layout on `mesh` (the split dimension is not a multiple
    /// of its blocks).
    pub fn check(&self, mesh: &Mesh, dims: &[usize]) -> Result<(), String> {
        match self.split(mesh, dims.len()) {
            Some((dim, blocks)) if !dims[dim].is_multiple_of(blocks * self.packed()) => {
                Err(format!(
                    "dimension {dim} of shape {dims:?} does not split into {} equal parts",
                    blocks * self.packed()
                ))
            }
            _ => Ok(()),
        }
    }
}

pub use burn_ir::TensorId;

/// The id of a router tensor (any channel), without consuming it.
pub fn tensor_id<C: RunnerClient>(tensor: &RouterTensor<C>) -> TensorId {
    // The clone keeps the count above one, so `into_ir` registers nothing.
    tensor.clone().into_ir().id
}

/// A float tensor primitive with a tensor id: those of the router backends ([`Oxi`](crate::Oxi),
/// [`Traced`](crate::trace::Traced)), so code generic over a backend can name a weight's buffer.
pub trait HasTensorId {
    fn tensor_id(&self) -> TensorId;
}

impl<C: RunnerClient> HasTensorId for RouterTensor<C> {
    fn tensor_id(&self) -> TensorId {
        tensor_id(self)
    }
}

/// Bytes of weights one device of the mesh holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceWeightBytes {
    /// Of weights split over the tensor-parallel axis (about `1/tp` of theirs).
    pub sharded: usize,
    /// Of weights every device holds whole.
    pub replicated: usize,
}

/// The weights of a model placed on a mesh: split weights as one shard per device (the whole
/// buffer leaves the first device), the others copied to every device on first use.
pub struct SpmdPlacement {
    mesh: Mesh,
    /// The eager client of the mesh's first device, where the model was loaded.
    client: PjrtClient,
    /// The PJRT devices of the partitions, in partition order.
    devices: Vec<pjrt::Device>,
    /// Per weight: its layout and one buffer per partition (`None` for partition 0 of a
    /// replicated weight: the eager client's own buffer).
    weights: Mutex<PlacedWeights>,
}

/// Per weight: its layout and one buffer per partition (`None`: the eager client's own).
type PlacedWeights = HashMap<TensorId, (Layout, Vec<Option<Buffer>>)>;

/// Partition buffers of placed weights, and the first device's eager buffers.
pub(crate) struct WeightView<'a> {
    weights: &'a PlacedWeights,
    pub(crate) eager: &'a HashMap<TensorId, Buffer>,
}

impl<'a> WeightView<'a> {
    /// Partition `p`'s buffer of weight `id`.
    pub(crate) fn weight(&self, id: TensorId, p: usize) -> Option<&'a Buffer> {
        match self.weights.get(&id)?.1.get(p)? {
            Some(buffer) => Some(buffer),
            None => self.eager.get(&id),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SpmdPlacement {
    /// Places the weights `split` (tensor id and layout) of a model on `device` over `mesh`
    /// (devices `device`, `device + 1`, ...): each partition gets its shard, and the whole
    /// buffer is freed from `device`. Other weights are replicated when a program first uses
    /// them.
    pub fn new(
        device: &OxiDevice,
        mesh: Mesh,
        split: &[(TensorId, Layout)],
    ) -> Result<Self, String> {
        let client = pjrt_client(device)
            .ok_or_else(|| format!("{device} is not a PJRT device: parallelism needs one"))?;
        let (pjrt_client, first) = client.target().map_err(|e| e.to_string())?;
        let first = first.index();
        let count = pjrt_client.device_count();
        if first + mesh.partitions() > count {
            return Err(format!(
                "a mesh of {} devices from {device} needs devices up to index {}, but there are {count}",
                mesh.partitions(),
                first + mesh.partitions() - 1
            ));
        }
        let devices = (first..first + mesh.partitions())
            .map(|i| pjrt_client.device(i).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut weights = HashMap::new();
        for &(id, layout) in split {
            // A staged weight (loaded under `stage_uploads`): its shards are cut from the
            // host bytes, and the whole tensor never reaches the first device.
            if let Some(staged) = client.take_staged(id) {
                layout.check(&mesh, &staged.dims())?;
                let mut parts = Vec::with_capacity(mesh.partitions());
                for (p, pjrt_device) in devices.iter().enumerate() {
                    let (buffer, _) = staged
                        .upload(pjrt_client, pjrt_device, Some((&layout, &mesh, p)))
                        .map_err(|e| format!("placing a shard of weight {id}: {e}"))?;
                    parts.push(Some(buffer));
                }
                staged.release_mapped_pages();
                weights.insert(id, (layout, parts));
                continue;
            }
            let Some(full) = client.take_buffer(id) else {
                // Already placed (the same tensor listed twice) or not on this device.
                if weights.contains_key(&id) {
                    continue;
                }
                return Err(format!("weight tensor {id} is not on {device}"));
            };
            let shape = full.shape().map_err(|e| e.to_string())?;
            let dims: Vec<usize> = shape.dims.iter().map(|&d| d as usize).collect();
            let elem = shape.element_type.byte_size();
            layout.check(&mesh, &dims)?;
            let bytes = full.to_host().map_err(|e| e.to_string())?;
            let part_dims: Vec<i64> = layout
                .part_dims(&mesh, &dims)
                .iter()
                .map(|&d| d as i64)
                .collect();
            let part_shape = pjrt::Shape::new(shape.element_type, part_dims);
            let mut parts = Vec::with_capacity(mesh.partitions());
            for (p, pjrt_device) in devices.iter().enumerate() {
                let part = layout.part_of(&mesh, p, &bytes, &dims, elem);
                let buffer = pjrt_client
                    .buffer_from_host(&part, &part_shape, pjrt_device)
                    .map_err(|e| format!("placing a shard of weight {id}: {e}"))?;
                parts.push(Some(buffer));
            }
            weights.insert(id, (layout, parts));
        }
        Ok(Self {
            mesh,
            client,
            devices,
            weights: Mutex::new(weights),
        })
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The device of partition 0, where results come back.
    pub fn device(&self) -> OxiDevice {
        self.client.device()
    }

    /// The devices of the partitions, in partition order (`device`, `device + 1`, ...).
    pub fn partition_devices(&self) -> Vec<OxiDevice> {
        let first = self.client.device();
        match &first {
            OxiDevice::Pjrt { platform, index } => (0..self.mesh.partitions())
                .map(|p| OxiDevice::Pjrt {
                    platform: platform.clone(),
                    index: index + p,
                })
                .collect(),
            OxiDevice::Cpu => vec![first],
        }
    }

    pub(crate) fn devices(&self) -> &[pjrt::Device] {
        &self.devices
    }

    /// The layout of weight `id` (replicated unless it was split).
    pub fn layout_of(&self, id: TensorId) -> Layout {
        lock(&self.weights)
            .get(&id)
            .map_or(Layout::Replicated, |(layout, _)| *layout)
    }

    /// Calls `f` with a view of every partition's weight buffers and the first device's eager
    /// buffers (one lock of each), after copying the replicated weights among `ids` to the other
    /// devices if this is their first use.
    pub(crate) fn with_weights<R>(
        &self,
        ids: &[TensorId],
        f: impl FnOnce(WeightView<'_>) -> R,
    ) -> Result<R, String> {
        let mut weights = lock(&self.weights);
        self.client
            .restore(ids.iter().copied().filter(|id| !weights.contains_key(id)));
        for &id in ids {
            if weights.contains_key(&id) {
                continue;
            }
            let parts = self.client.with_buffers(|buffers| {
                let full = buffers.get(&id).ok_or_else(|| {
                    format!("tensor {id}, which the program captured (a weight), is not on the device: keep the module alive")
                })?;
                let mut parts = vec![None];
                for device in &self.devices[1..] {
                    parts.push(Some(
                        full.copy_to_device(device)
                            .map_err(|e| format!("replicating weight {id}: {e}"))?,
                    ));
                }
                Ok::<_, String>(parts)
            })?;
            weights.insert(id, (Layout::Replicated, parts));
        }
        let weights = &*weights;
        Ok(self
            .client
            .with_buffers(|eager| f(WeightView { weights, eager })))
    }

    /// Weight bytes on each device of the mesh, in partition order: shards of split weights,
    /// and replicated weights placed so far (all of them after a program's first call).
    pub fn weight_bytes(&self) -> Vec<DeviceWeightBytes> {
        let weights = lock(&self.weights);
        let mut bytes = vec![DeviceWeightBytes::default(); self.mesh.partitions()];
        let size = |b: &Buffer| b.shape().ok().and_then(|s| s.byte_size().ok()).unwrap_or(0);
        self.client.with_buffers(|eager| {
            for (id, (layout, parts)) in weights.iter() {
                for (p, part) in parts.iter().enumerate() {
                    let n = match part {
                        Some(buffer) => size(buffer),
                        None => eager.get(id).map_or(0, size),
                    };
                    match layout {
                        Layout::Replicated => bytes[p].replicated += n,
                        _ => bytes[p].sharded += n,
                    }
                }
            }
        });
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shardings_follow_xla_syntax_on_1d_and_2d_meshes() {
        let tp4 = Mesh::new(1, 4);
        assert_eq!(
            Layout::TensorSplit(1).hlo_sharding(&tp4, 2),
            "{devices=[1,4]0,1,2,3}"
        );
        assert_eq!(
            Layout::TensorSplit(0).hlo_sharding(&tp4, 1),
            "{devices=[4]0,1,2,3}"
        );
        assert_eq!(Layout::BatchSplit(0).hlo_sharding(&tp4, 4), "{replicated}");
        let dp2 = Mesh::new(2, 1);
        assert_eq!(
            Layout::BatchSplit(0).hlo_sharding(&dp2, 4),
            "{devices=[2,1,1,1]0,1}"
        );
        // dp 2 x tp 2: partition p = (p / 2, p % 2).
        let mesh = Mesh::new(2, 2);
        assert_eq!(
            Layout::TensorSplit(1).hlo_sharding(&mesh, 2),
            "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
        );
        assert_eq!(
            Layout::BatchSplit(0).hlo_sharding(&mesh, 3),
            "{devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate}"
        );
        assert_eq!(Layout::Replicated.hlo_sharding(&mesh, 2), "{replicated}");
    }

    #[test]
    fn parts_are_the_blocks_of_the_split_dimension() {
        // [2, 4] of u8: rows 0..4 and 4..8.
        let bytes: Vec<u8> = (0..8).collect();
        let mesh = Mesh::new(1, 2);
        let cols = Layout::TensorSplit(1);
        assert_eq!(cols.part_of(&mesh, 0, &bytes, &[2, 4], 1), vec![0, 1, 4, 5]);
        assert_eq!(cols.part_of(&mesh, 1, &bytes, &[2, 4], 1), vec![2, 3, 6, 7]);
        assert_eq!(cols.part_dims(&mesh, &[2, 4]), vec![2, 2]);
        let rows = Layout::TensorSplit(0);
        assert_eq!(rows.part_of(&mesh, 1, &bytes, &[2, 4], 1), vec![4, 5, 6, 7]);
        // On dp 2 x tp 2 a batch split gives partitions 2 and 3 the second half.
        let mesh = Mesh::new(2, 2);
        let batch = Layout::BatchSplit(0);
        assert_eq!(
            batch.part_of(&mesh, 1, &bytes, &[2, 4], 1),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            batch.part_of(&mesh, 2, &bytes, &[2, 4], 1),
            vec![4, 5, 6, 7]
        );
        assert!(Layout::TensorSplit(1)
            .check(&Mesh::new(1, 3), &[2, 4])
            .is_err());
        // Value and gate columns [v0 v1 g0 g1]: device t gets [v_t g_t].
        let mesh = Mesh::new(1, 2);
        let packed = Layout::PackedTensorSplit(1, 2);
        assert_eq!(
            packed.part_of(&mesh, 0, &bytes, &[2, 4], 1),
            vec![0, 2, 4, 6]
        );
        assert_eq!(
            packed.part_of(&mesh, 1, &bytes, &[2, 4], 1),
            vec![1, 3, 5, 7]
        );
        assert_eq!(
            packed.hlo_sharding(&mesh, 2),
            Layout::TensorSplit(1).hlo_sharding(&mesh, 2)
        );
        assert!(packed.check(&mesh, &[2, 6]).is_err());
    }
}
