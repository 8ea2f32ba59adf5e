//! Buffers that start on a cache line, for the operands of AMX tile loads and stores.
//!
//! A tile row that starts on a 64-byte boundary is one cache line; one that does not is split
//! over two, and a tile load then reads twice the lines at about half the speed. Vectors of
//! `u16`, `u32` or `f32` are only aligned to their element, so the AMX product keeps its packed
//! operands and its blocks of sums in these, and weights converted at load are allocated so.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use bytemuck::{Pod, Zeroable};

/// The bytes of one cache line, aligned to one.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

// SAFETY: `Line` is 64 bytes with no padding (size equals alignment), any bit pattern is a valid
// value and all zeros is one.
unsafe impl Zeroable for Line {}
// SAFETY: as above; it holds no pointers and is `Copy`.
unsafe impl Pod for Line {}

/// `len` values of `T` (zeros, or what a fill wrote) whose first value starts a cache line.
pub struct Aligned<T> {
    storage: Storage,
    len: usize,
    values: PhantomData<T>,
}

/// Where an [`Aligned`] buffer's bytes live.
enum Storage {
    /// Whole lines from the allocator.
    Heap(Vec<Line>),
    /// An anonymous mapping (page-aligned, zeroed by the kernel), asked for huge pages where
    /// Linux gives them: a large buffer then faults in once every 2 MiB, not every 4 KiB.
    Mapped(memmap2::MmapMut),
}

/// The smallest buffer [`Aligned::from_uninit_mapped`] maps: below it a mapping's system calls
/// cost more than the page faults they save.
const MAPPED_MIN_BYTES: usize = 4 << 20;

impl<T: Pod> Aligned<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len * size_of::<T>();
        Self {
            storage: Storage::Heap(vec![Line([0; 64]); bytes.div_ceil(size_of::<Line>())]),
            len,
            values: PhantomData,
        }
    }

    /// `len` values written by `fill`, with no zeroing pass first (bytes past the last value,
    /// up to the end of its cache line, are zeros).
    ///
    /// # Safety
    /// `fill` writes every one of the `len` values it is handed.
    pub unsafe fn from_uninit(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Self {
        let lines = (len * size_of::<T>()).div_ceil(size_of::<Line>());
        let mut buf: Vec<Line> = Vec::with_capacity(lines);
        if let Some(last) = buf.spare_capacity_mut()[..lines].last_mut() {
            last.write(Line([0; 64]));
        }
        // SAFETY: the spare capacity holds `lines` lines, at least `len` values of `T` (whose
        // alignment divides 64, as `Pod` types here do); `MaybeUninit` asks nothing of them.
        let values = unsafe {
            std::slice::from_raw_parts_mut(
                buf.spare_capacity_mut()
                    .as_mut_ptr()
                    .cast::<MaybeUninit<T>>(),
                len,
            )
        };
        fill(values);
        // SAFETY: `fill` wrote the first `len` values (the caller's promise) and the rest of the
        // last line was zeroed above, so all `lines` lines are initialized.
        unsafe { buf.set_len(lines) };
        Self {
            storage: Storage::Heap(buf),
            len,
            values: PhantomData,
        }
    }

    /// [`Self::from_uninit`] for a large buffer that lives long (weights converted at load):
    /// from 4 MiB on, an anonymous mapping asked for huge pages, so filling it takes one page
    /// fault a 2 MiB page; smaller, or when the mapping fails, from the allocator.
    ///
    /// # Safety
    /// As for [`Self::from_uninit`]: `fill` writes every one of the `len` values it is handed.
    pub unsafe fn from_uninit_mapped(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Self {
        let bytes = len * size_of::<T>();
        let map = (bytes >= MAPPED_MIN_BYTES)
            .then(|| memmap2::MmapMut::map_anon(bytes).ok())
            .flatten();
        let Some(mut map) = map else {
            // SAFETY: the caller's promise, passed on.
            return unsafe { Self::from_uninit(len, fill) };
        };
        // Only a hint: without transparent huge pages the mapping works as it is.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        // The mapping is page-aligned and zeroed, so it holds `len` valid values of `T`.
        let values: &mut [T] = bytemuck::cast_slice_mut(&mut map[..]);
        // SAFETY: `MaybeUninit<T>` has `T`'s layout; every value is initialized now and `fill`
        // writes initialized values only (the caller's promise), so they stay valid `T`s.
        let values = unsafe {
            std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<MaybeUninit<T>>(), len)
        };
        fill(values);
        Self {
            storage: Storage::Mapped(map),
            len,
            values: PhantomData,
        }
    }

    fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Heap(lines) => bytemuck::cast_slice(lines),
            Storage::Mapped(map) => map,
        }
    }

    pub fn as_slice(&self) -> &[T] {
        &bytemuck::cast_slice(self.bytes())[..self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        let bytes: &mut [u8] = match &mut self.storage {
            Storage::Heap(lines) => bytemuck::cast_slice_mut(lines),
            Storage::Mapped(map) => map,
        };
        &mut bytemuck::cast_slice_mut(bytes)[..self.len]
    }
}

/// The values' bytes, so the buffer can back shared tensor storage
/// (`bytes::Bytes::from_owner`).
impl<T: Pod> AsRef<[u8]> for Aligned<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_cache_line_and_holds_len_zeros() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let mut buf = Aligned::<u16>::zeroed(len);
            assert_eq!(buf.as_slice().as_ptr() as usize % 64, 0);
            assert_eq!(buf.as_slice().len(), len);
            assert!(buf.as_slice().iter().all(|&v| v == 0));
            buf.as_mut_slice().fill(7);
            assert!(buf.as_slice().iter().all(|&v| v == 7));
        }
        assert_eq!(Aligned::<f32>::zeroed(3).as_slice(), [0.0; 3]);
    }

    #[test]
    fn from_uninit_holds_what_fill_wrote() {
        for len in [0, 1, 31, 32, 33] {
            // SAFETY: the closure writes every value.
            let buf = unsafe {
                Aligned::<u16>::from_uninit(len, |values| {
                    for (i, v) in values.iter_mut().enumerate() {
                        v.write(i as u16 + 1);
                    }
                })
            };
            assert_eq!(buf.as_slice().as_ptr() as usize % 64, 0);
            let expected: Vec<u16> = (1..=len as u16).collect();
            assert_eq!(buf.as_slice(), expected);
            assert_eq!(buf.as_ref().len(), 2 * len);
        }
    }

    #[test]
    fn a_mapped_buffer_holds_what_fill_wrote_on_a_cache_line() {
        // Above the size that maps, and an odd length.
        let len = MAPPED_MIN_BYTES / 4 + 17;
        // SAFETY: the closure writes every value.
        let buf = unsafe {
            Aligned::<f32>::from_uninit_mapped(len, |values| {
                for (i, v) in values.iter_mut().enumerate() {
                    v.write(i as f32);
                }
            })
        };
        assert!(matches!(buf.storage, Storage::Mapped(_)));
        assert_eq!(buf.as_slice().as_ptr() as usize % 64, 0);
        assert_eq!(buf.as_slice().len(), len);
        assert!(buf
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &v)| v == i as f32));
    }
}
