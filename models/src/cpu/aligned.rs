//! Zeroed buffers that start on a cache line, for the operands of AMX tile loads and stores.
//!
//! A tile row that starts on a 64-byte boundary is one cache line; one that does not is split
//! over two, and a tile load then reads twice the lines at about half the speed. Vectors of
//! `u16`, `u32` or `f32` are only aligned to their element, so the AMX product keeps its packed
//! operands and its blocks of sums in these.

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

/// `len` zeroed values of `T` whose first value starts a cache line.
pub struct Aligned<T> {
    lines: Vec<Line>,
    len: usize,
    values: PhantomData<T>,
}

impl<T: Pod> Aligned<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len * size_of::<T>();
        Self {
            lines: vec![Line([0; 64]); bytes.div_ceil(size_of::<Line>())],
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
            lines: buf,
            len,
            values: PhantomData,
        }
    }

    pub fn as_slice(&self) -> &[T] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
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
}
