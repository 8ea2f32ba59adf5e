//! Staged weights: tensors registered on a PJRT device while its client stages uploads
//! ([`PjrtClient::stage_uploads`](crate::eager::PjrtClient::stage_uploads)) stay on the host,
//! in the bytes the loader gave (a memory-mapped checkpoint's, when the file stores the dtype),
//! until something needs them on the device. Transposes of a staged tensor (how `Linear` holds
//! its checkpoint's `[out, in]` weight as `[in, out]`) are recorded as a view, not run.
//!
//! This is what lets tensor parallelism place a weight without the first device ever holding
//! it whole: [`SpmdPlacement`](crate::spmd::SpmdPlacement) cuts each device's shard straight out
//! of the staged bytes ([`StagedTensor::upload`]: a strided view the plugin reads as it copies,
//! or one gathered shard where a part is not a view), so each device receives only its shard
//! and the host holds at most one shard beside the mapped file. A staged tensor anything else
//! uses is uploaded then, once.

#[cfg(test)]
use std::borrow::Cow;
use std::sync::Arc;

use burn_backend::TensorData;

use crate::pjrt::{self, Buffer, Client, Device, ElementType};
use crate::spmd::{Layout, Mesh};

/// A tensor on the host waiting for its device: the stored dense data and a permutation of
/// its dimensions (`axes[i]` is the stored dimension that logical dimension `i` reads).
#[derive(Clone, Debug)]
pub(crate) struct StagedTensor {
    data: Arc<TensorData>,
    element: ElementType,
    axes: Vec<usize>,
}

impl StagedTensor {
    /// `data` (dense, row-major) as it is stored.
    pub(crate) fn new(data: TensorData, element: ElementType) -> Self {
        let axes = (0..data.shape.len()).collect();
        Self {
            data: Arc::new(data),
            element,
            axes,
        }
    }

    /// The logical dimensions (the stored ones, permuted).
    pub(crate) fn dims(&self) -> Vec<usize> {
        self.axes.iter().map(|&a| self.data.shape[a]).collect()
    }

    /// The same data with logical dimensions `dim1` and `dim2` swapped (Burn's `swap_dims`).
    pub(crate) fn swapped(&self, dim1: usize, dim2: usize) -> Option<Self> {
        let mut axes = self.axes.clone();
        if dim1 >= axes.len() || dim2 >= axes.len() {
            return None;
        }
        axes.swap(dim1, dim2);
        Some(Self {
            axes,
            ..self.clone()
        })
    }

    /// The same data with its logical dimensions in the order `order` (Burn's `permute`).
    pub(crate) fn permuted(&self, order: &[usize]) -> Option<Self> {
        if order.len() != self.axes.len() || order.iter().any(|&o| o >= self.axes.len()) {
            return None;
        }
        let axes = order.iter().map(|&o| self.axes[o]).collect();
        Some(Self {
            axes,
            ..self.clone()
        })
    }

    /// The logical tensor as dense row-major bytes: the stored bytes themselves when no
    /// dimension moved, else one gathered copy (what [`upload`](Self::upload) sends).
    #[cfg(test)]
    fn dense(&self) -> Cow<'_, [u8]> {
        let bytes = self.data.as_bytes();
        if self.axes.iter().enumerate().all(|(i, &a)| i == a) {
            return Cow::Borrowed(bytes);
        }
        let dims = self.dims();
        let tables = dims
            .iter()
            .enumerate()
            .map(|(i, &n)| self.offsets(i, (0..n).collect()))
            .collect::<Vec<_>>();
        Cow::Owned(gather(bytes, self.element.byte_size(), &tables))
    }

    /// Partition `p`'s part of the logical tensor under `layout` on `mesh`, as dense row-major
    /// bytes, and its dimensions (the same blocks as [`Layout::part_of`] cuts from dense bytes).
    #[cfg(test)]
    fn part(&self, layout: &Layout, mesh: &Mesh, p: usize) -> (Vec<u8>, Vec<usize>) {
        let dims = self.dims();
        let part_dims = layout.part_dims(mesh, &dims);
        let tables = dims
            .iter()
            .enumerate()
            .map(|(i, _)| self.offsets(i, layout.source_indices(mesh, p, &dims, i)))
            .collect::<Vec<_>>();
        (
            gather(self.data.as_bytes(), self.element.byte_size(), &tables),
            part_dims,
        )
    }

    /// Copies the logical tensor, or partition `p`'s part of it under `layout` on `mesh`, to
    /// `device`: as a strided view of the stored bytes, so the plugin transposes and slices
    /// while it copies, or, where the part is not one view (packed splits), from a gathered
    /// copy. Returns the buffer and the bytes copied.
    pub(crate) fn upload(
        &self,
        client: &Client,
        device: &Device,
        part: Option<(&Layout, &Mesh, usize)>,
    ) -> pjrt::Result<(Buffer, usize)> {
        let dims = self.dims();
        let elem = self.element.byte_size();
        let indices: Vec<Vec<usize>> = match part {
            Some((layout, mesh, p)) => (0..dims.len())
                .map(|i| layout.source_indices(mesh, p, &dims, i))
                .collect(),
            None => dims.iter().map(|&n| (0..n).collect()).collect(),
        };
        let part_dims: Vec<i64> = indices.iter().map(|ix| ix.len() as i64).collect();
        let shape = pjrt::Shape::new(self.element, part_dims);
        let bytes = indices.iter().map(Vec::len).product::<usize>() * elem;
        // One view when every dimension's indices are a contiguous run.
        let contiguous = indices
            .iter()
            .all(|ix| ix.windows(2).all(|w| w[1] == w[0] + 1));
        if contiguous {
            let mut offset = 0;
            let mut strides = Vec::with_capacity(dims.len());
            for (i, ix) in indices.iter().enumerate() {
                let stride = self.stride(i);
                offset += ix.first().copied().unwrap_or(0) * stride;
                strides.push(stride as i64);
            }
            let buffer = client.buffer_from_strided_host(
                self.data.as_bytes(),
                offset,
                &shape,
                &strides,
                device,
            )?;
            return Ok((buffer, bytes));
        }
        // Otherwise the part's elements are gathered in the stored order (whole runs of the
        // stored rows, copied as they lie), and the plugin reads that compact copy through the
        // view's permutation.
        let rank = dims.len();
        let mut logical_of = vec![0; rank];
        for (i, &a) in self.axes.iter().enumerate() {
            logical_of[a] = i;
        }
        let stored_stride = |j: usize| self.data.shape[j + 1..].iter().product::<usize>() * elem;
        let tables: Vec<Vec<usize>> = (0..rank)
            .map(|j| {
                indices[logical_of[j]]
                    .iter()
                    .map(|&x| x * stored_stride(j))
                    .collect()
            })
            .collect();
        let gathered = gather(self.data.as_bytes(), elem, &tables);
        let compact: Vec<usize> = (0..rank).map(|j| indices[logical_of[j]].len()).collect();
        let strides: Vec<i64> = self
            .axes
            .iter()
            .map(|&j| (compact[j + 1..].iter().product::<usize>() * elem) as i64)
            .collect();
        let buffer = client.buffer_from_strided_host(&gathered, 0, &shape, &strides, device)?;
        Ok((buffer, bytes))
    }

    /// The byte stride of logical dimension `dim` in the stored data.
    fn stride(&self, dim: usize) -> usize {
        let stored = self.axes[dim];
        self.data.shape[stored + 1..].iter().product::<usize>() * self.element.byte_size()
    }

    /// Byte offsets in the stored data of logical dimension `dim`'s `indices`.
    #[cfg(test)]
    fn offsets(&self, dim: usize, indices: Vec<usize>) -> Vec<usize> {
        let stored = self.axes[dim];
        let stride: usize =
            self.data.shape[stored + 1..].iter().product::<usize>() * self.element.byte_size();
        indices.into_iter().map(|i| i * stride).collect()
    }
}

/// The elements at every combination of per-dimension byte offsets (`tables[d][j]`: where
/// index `j` of dimension `d` starts), in row-major order: a strided copy of any view.
fn gather(src: &[u8], elem: usize, tables: &[Vec<usize>]) -> Vec<u8> {
    let count: usize = tables.iter().map(Vec::len).product();
    let mut out = Vec::with_capacity(count * elem);
    if count == 0 {
        return out;
    }
    let Some((inner, outer)) = tables.split_last() else {
        out.extend_from_slice(&src[..elem]);
        return out;
    };
    // The innermost dimension read contiguously, when it is.
    let contiguous = inner.windows(2).all(|w| w[1] == w[0] + elem);
    let mut index = vec![0usize; outer.len()];
    loop {
        let base: usize = outer.iter().zip(&index).map(|(t, &i)| t[i]).sum();
        if contiguous {
            let start = base + inner[0];
            out.extend_from_slice(&src[start..start + inner.len() * elem]);
        } else {
            for &o in inner {
                out.extend_from_slice(&src[base + o..base + o + elem]);
            }
        }
        // The next outer index, last dimension fastest.
        let mut d = outer.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d].len() {
                break;
            }
            index[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(values: Vec<f32>, shape: Vec<usize>) -> StagedTensor {
        StagedTensor::new(TensorData::new(values, shape), ElementType::F32)
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn a_transposed_view_gathers_the_transpose() {
        // [2, 3] stored, seen as [3, 2].
        let t = staged((0..6).map(|v| v as f32).collect(), vec![2, 3]);
        assert!(matches!(t.dense(), Cow::Borrowed(_)));
        let tt = t.swapped(0, 1).unwrap();
        assert_eq!(tt.dims(), vec![3, 2]);
        assert_eq!(floats(&tt.dense()), vec![0., 3., 1., 4., 2., 5.]);
        // Swapping back is the stored tensor again.
        assert!(matches!(
            tt.swapped(1, 0).unwrap().dense(),
            Cow::Borrowed(_)
        ));
        // A 3-d permutation against the index arithmetic.
        let t = staged((0..24).map(|v| v as f32).collect(), vec![2, 3, 4]);
        let p = t.permuted(&[2, 0, 1]).unwrap();
        assert_eq!(p.dims(), vec![4, 2, 3]);
        let got = floats(&p.dense());
        for a in 0..4 {
            for b in 0..2 {
                for c in 0..3 {
                    assert_eq!(got[(a * 2 + b) * 3 + c], (b * 12 + c * 4 + a) as f32);
                }
            }
        }
        assert!(t.permuted(&[0, 1]).is_none());
        assert!(t.swapped(0, 3).is_none());
    }

    #[test]
    fn parts_of_a_view_equal_the_parts_of_its_dense_bytes() {
        // A [4, 6] weight stored as [6, 4] (Linear's checkpoint layout), every layout, tp 2.
        let stored = staged((0..24).map(|v| v as f32).collect(), vec![6, 4]);
        let view = stored.swapped(0, 1).unwrap();
        let dense = view.dense().into_owned();
        let dims = view.dims();
        let mesh = Mesh::new(1, 2);
        for layout in [
            Layout::TensorSplit(0),
            Layout::TensorSplit(1),
            Layout::PackedTensorSplit(1, 3),
            Layout::Replicated,
        ] {
            for p in 0..2 {
                let (part, part_dims) = view.part(&layout, &mesh, p);
                assert_eq!(
                    part,
                    layout.part_of(&mesh, p, &dense, &dims, 4),
                    "{layout:?} {p}"
                );
                assert_eq!(part_dims, layout.part_dims(&mesh, &dims));
            }
        }
        // On dp 2 x tp 2, a batch split of the stored (not permuted) tensor.
        let mesh = Mesh::new(2, 2);
        let bytes = stored.dense().into_owned();
        for p in 0..4 {
            let (part, _) = stored.part(&Layout::BatchSplit(0), &mesh, p);
            assert_eq!(
                part,
                Layout::BatchSplit(0).part_of(&mesh, p, &bytes, &[6, 4], 4)
            );
        }
    }
}
