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
//!
//! Once a tensor read from a memory-mapped file is on its device, its pages are handed back to
//! the kernel ([`StagedTensor::release_mapped_pages`]), so moving a model to a device never
//! holds the model twice in the process's memory (the device copy and the file's pages; on
//! XLA's CPU plugin both are host memory).

use std::borrow::Cow;
use std::sync::Arc;

use burn_backend::{AllocationProperty, TensorData};

use crate::host::host_layout;
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

    /// `data` as a PJRT device holds it (Flex32 becomes f32; any other dtype is kept in the
    /// loader's own bytes), or why no device can hold it.
    pub(crate) fn from_data(data: TensorData) -> Result<Self, String> {
        let (element, converted) = match host_layout(&data)? {
            (element, Cow::Owned(converted)) => (element, Some(converted)),
            (element, Cow::Borrowed(_)) => (element, None),
        };
        Ok(Self::new(converted.unwrap_or(data), element))
    }

    /// Whether the stored bytes are a memory-mapped file's (so they can be uploaded again
    /// later without holding host memory meanwhile).
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.data.bytes.property(), AllocationProperty::File)
    }

    /// Hands the pages of a memory-mapped tensor's bytes back to the kernel
    /// (`madvise(MADV_DONTNEED)` on the whole pages the bytes cover), once its device holds a
    /// copy: the process's resident memory no longer counts them. Nothing is lost: the mapping
    /// stays valid and a later read faults the pages back in from the file (the page cache).
    /// Bytes of any other allocation (owned host memory, freed with the tensor) are left alone.
    pub(crate) fn release_mapped_pages(&self) {
        if !self.is_mapped() {
            return;
        }
        release_pages(self.data.as_bytes());
    }

    /// Bytes of the logical tensor.
    pub(crate) fn byte_size(&self) -> usize {
        self.data.shape.iter().product::<usize>() * self.element.byte_size()
    }

    /// Rows `rows` of a 2-d tensor as it is stored (an embedding table), read straight from
    /// the stored bytes, row after row; `None` for a permuted or other-rank tensor or a row out
    /// of range.
    pub(crate) fn rows(&self, rows: impl IntoIterator<Item = usize>) -> Option<Vec<u8>> {
        let [count, width] = self.data.shape[..] else {
            return None;
        };
        if self.axes != [0, 1] {
            return None;
        }
        let row = width * self.element.byte_size();
        let bytes = self.data.as_bytes();
        let mut out = Vec::new();
        for r in rows {
            if r >= count {
                return None;
            }
            out.extend_from_slice(&bytes[r * row..(r + 1) * row]);
        }
        Some(out)
    }

    /// The stored element type.
    pub(crate) fn element(&self) -> ElementType {
        self.element
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

    /// Copies the logical tensor, or partition `p`'s part of it under `layout` on `mesh`, to
    /// `device` through [`host_view`](Self::host_view). Returns the buffer and the bytes copied.
    pub(crate) fn upload(
        &self,
        client: &Client,
        device: &Device,
        part: Option<(&Layout, &Mesh, usize)>,
    ) -> pjrt::Result<(Buffer, usize)> {
        let view = self.host_view(part);
        let dims: Vec<i64> = view.dims.iter().map(|&d| d as i64).collect();
        let strides: Vec<i64> = view.strides.iter().map(|&s| s as i64).collect();
        let shape = pjrt::Shape::new(self.element, dims);
        let bytes = view.dims.iter().product::<usize>() * self.element.byte_size();
        let buffer =
            client.buffer_from_strided_host(&view.bytes, view.offset, &shape, &strides, device)?;
        Ok((buffer, bytes))
    }

    /// What [`upload`](Self::upload) hands the plugin for the logical tensor, or partition
    /// `p`'s part of it: a strided view of the stored bytes (the plugin transposes and slices
    /// while it copies), or, where the part is not one view (packed splits), a copy of its
    /// elements gathered in the stored order (whole runs of the stored rows, copied as they
    /// lie), read through the view's permutation.
    fn host_view(&self, part: Option<(&Layout, &Mesh, usize)>) -> HostView<'_> {
        let dims = self.dims();
        let elem = self.element.byte_size();
        let indices: Vec<Vec<usize>> = match part {
            Some((layout, mesh, p)) => (0..dims.len())
                .map(|i| layout.source_indices(mesh, p, &dims, i))
                .collect(),
            None => dims.iter().map(|&n| (0..n).collect()).collect(),
        };
        let part_dims: Vec<usize> = indices.iter().map(Vec::len).collect();
        let stored_stride = |j: usize| self.data.shape[j + 1..].iter().product::<usize>() * elem;
        let contiguous = indices
            .iter()
            .all(|ix| ix.windows(2).all(|w| w[1] == w[0] + 1));
        if contiguous {
            let strides: Vec<usize> = self.axes.iter().map(|&j| stored_stride(j)).collect();
            let offset = indices
                .iter()
                .zip(&strides)
                .map(|(ix, s)| ix.first().copied().unwrap_or(0) * s)
                .sum();
            return HostView {
                bytes: Cow::Borrowed(self.data.as_bytes()),
                offset,
                dims: part_dims,
                strides,
            };
        }
        let rank = dims.len();
        let mut logical_of = vec![0; rank];
        for (i, &a) in self.axes.iter().enumerate() {
            logical_of[a] = i;
        }
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
        let strides = self
            .axes
            .iter()
            .map(|&j| compact[j + 1..].iter().product::<usize>() * elem)
            .collect();
        HostView {
            bytes: Cow::Owned(gathered),
            offset: 0,
            dims: part_dims,
            strides,
        }
    }
}

/// Host bytes as a PJRT upload reads them: element `[i0, i1, ...]` of `dims` at byte
/// `offset + Σ i_k * strides[k]`.
struct HostView<'a> {
    bytes: Cow<'a, [u8]>,
    offset: usize,
    dims: Vec<usize>,
    strides: Vec<usize>,
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

    /// The f32 elements of `view`, row-major, read through its strides as the plugin does.
    fn read(view: &HostView) -> Vec<f32> {
        let count: usize = view.dims.iter().product();
        (0..count)
            .map(|mut flat| {
                let mut at = view.offset;
                for (&d, &s) in view.dims.iter().zip(&view.strides).rev() {
                    at += (flat % d) * s;
                    flat /= d;
                }
                f32::from_ne_bytes(view.bytes[at..at + 4].try_into().unwrap())
            })
            .collect()
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn a_transposed_view_reads_the_transpose_without_a_copy() {
        // [2, 3] stored, seen as [3, 2].
        let t = staged((0..6).map(|v| v as f32).collect(), vec![2, 3]);
        let tt = t.swapped(0, 1).unwrap();
        assert_eq!(tt.dims(), vec![3, 2]);
        let view = tt.host_view(None);
        assert!(matches!(view.bytes, Cow::Borrowed(_)), "a view, not a copy");
        assert_eq!(read(&view), vec![0., 3., 1., 4., 2., 5.]);
        // Swapping back is the stored tensor again: dense strides.
        assert_eq!(
            tt.swapped(1, 0).unwrap().host_view(None).strides,
            vec![12, 4]
        );
        // A 3-d permutation against the index arithmetic.
        let t = staged((0..24).map(|v| v as f32).collect(), vec![2, 3, 4]);
        let p = t.permuted(&[2, 0, 1]).unwrap();
        assert_eq!(p.dims(), vec![4, 2, 3]);
        let got = read(&p.host_view(None));
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
        let dense: Vec<u8> = read(&view.host_view(None))
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let dims = view.dims();
        let mesh = Mesh::new(1, 2);
        for layout in [
            Layout::TensorSplit(0),
            Layout::TensorSplit(1),
            Layout::PackedTensorSplit(1, 3),
            Layout::Replicated,
        ] {
            for p in 0..2 {
                let part = view.host_view(Some((&layout, &mesh, p)));
                assert_eq!(
                    read(&part),
                    floats(&layout.part_of(&mesh, p, &dense, &dims, 4)),
                    "{layout:?} {p}"
                );
                assert_eq!(part.dims, layout.part_dims(&mesh, &dims));
                // Only the packed split needs a gathered copy.
                let packed = matches!(layout, Layout::PackedTensorSplit(..));
                assert_eq!(matches!(part.bytes, Cow::Owned(_)), packed, "{layout:?}");
            }
        }
        // On dp 2 x tp 2, a batch split of the stored (not permuted) tensor.
        let mesh = Mesh::new(2, 2);
        let bytes = stored.data.as_bytes().to_vec();
        for p in 0..4 {
            let part = stored.host_view(Some((&Layout::BatchSplit(0), &mesh, p)));
            assert_eq!(
                read(&part),
                floats(&Layout::BatchSplit(0).part_of(&mesh, p, &bytes, &[6, 4], 4))
            );
        }
    }
}

/// `madvise(MADV_DONTNEED)` on the whole pages inside `bytes` (a part of a read-only file
/// mapping); the partial pages at either end are kept, as they may hold a neighbour's bytes that
/// are still in use. Advice only: a failure changes nothing and is ignored.
#[cfg(unix)]
fn release_pages(bytes: &[u8]) {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let Ok(page) = usize::try_from(page) else {
        return;
    };
    if page == 0 {
        return;
    }
    let start = (bytes.as_ptr() as usize).next_multiple_of(page);
    let end = (bytes.as_ptr() as usize + bytes.len()) / page * page;
    if end <= start {
        return;
    }
    // SAFETY: [start, end) lies within `bytes`, memory of a live file mapping; MADV_DONTNEED
    // on a read-only file mapping drops the resident pages only, and later reads fault them
    // back in with the file's contents, so no reference into it sees other data.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
    }
}

#[cfg(not(unix))]
fn release_pages(_bytes: &[u8]) {}

#[cfg(all(test, target_os = "linux"))]
mod release_tests {
    use super::release_pages;

    /// The `Rss:` of the mapping that starts at `addr`, in kB, from /proc/self/smaps.
    fn mapping_rss_kb(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(line) = lines.next() {
            let Some(range) = line.split_whitespace().next() else {
                continue;
            };
            let Some((start, _)) = range.split_once('-') else {
                continue;
            };
            if usize::from_str_radix(start, 16).ok() != Some(addr) {
                continue;
            }
            for field in lines.by_ref() {
                if let Some(kb) = field.strip_prefix("Rss:") {
                    return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                }
            }
        }
        panic!("no mapping at {addr:#x}");
    }

    /// A read file mapping's pages leave the process's resident memory when released, and
    /// reading again gives the same bytes.
    #[test]
    fn released_file_pages_leave_resident_memory_and_read_back_unchanged() {
        use std::io::Write;
        let len = 8 << 20;
        let mut file = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        file.write_all(&data).unwrap();
        file.flush().unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh read-only private mapping of the whole file, unmapped below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        // SAFETY: the mapping is `len` readable bytes and lives until munmap below.
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        assert_eq!(bytes, &data[..]);
        let touched = mapping_rss_kb(ptr as usize);
        assert!(touched >= 7 << 10, "{touched} kB resident after reading");
        // A tensor starting mid-page: the first and last partial pages stay.
        release_pages(&bytes[100..len - 100]);
        let released = mapping_rss_kb(ptr as usize);
        assert!(released <= 8, "{released} kB resident after releasing");
        assert_eq!(bytes, &data[..], "the bytes read back after releasing");
        // SAFETY: mapped above; `bytes` is not used after this.
        unsafe { libc::munmap(ptr, len) };
    }
}
