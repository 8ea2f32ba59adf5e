//! The AVX512-BF16 microkernel for bf16 products on CPUs without AMX (AMD Zen 4 and later,
//! Intel Cooper Lake): [`super::half_gemm`]'s 32x32 f32 block from the same pair layout.
//!
//! `vdpbf16ps` adds to each of 16 f32 lanes the dot product of one bf16 pair from each side:
//! a broadcast pair `(A[i][2r], A[i][2r + 1])` against a row of [`super::half_gemm::PackedB`],
//! 16 columns of pairs `(B[2r][j], B[2r + 1][j])`, is one step of row `i` of `C` over two
//! values of k. A block keeps groups of rows of `C` (two zmm registers, 32 columns, a row) in
//! registers while it walks down k; `A` arrives pair-major (for each pair of k, the 32 rows'
//! pairs side by side), so each group reads its broadcasts from one moving pointer.

use std::sync::OnceLock;

use super::amx::BLOCK;

/// Whether this process uses the AVX512-BF16 kernel: the CPU has AVX-512 F, BW, VL and BF16,
/// and `OXIDIFF_CPU_AVX512BF16=off` does not turn it off. Asked once.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if std::env::var_os("OXIDIFF_CPU_AVX512BF16").is_some_and(|v| v == "off") {
            return false;
        }
        cpu_has_avx512_bf16()
    })
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_avx512_bf16() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_avx512_bf16() -> bool {
    false
}

/// Pairs of k per pass over the block's rows: the pass's slices of `A` and `B` (8 KiB each)
/// stay in the L1 cache while every group of rows reads them.
const PASS_PAIRS: usize = 64;

/// Rows of `C` each group keeps in registers (two zmm accumulators a row, 24 of 32 registers).
const GROUPS: [usize; 3] = [12, 12, 8];

/// One 32x32 f32 block `out = A B` over `2 * pairs` values of k, row-major with a row stride
/// of 32 floats.
///
/// - `a`: pair-major `A`, `pairs * 32` values: `a[r * 32 + i]` is `(A[i][2r], A[i][2r + 1])`,
///   the even one in the low half.
/// - `b`: two right-hand panels in the pair layout, the second `panel_bytes` after the first:
///   for each pair of k, 16 columns of two bf16 values.
///
/// # Safety
/// [`available`] returned true; every byte read or written lies inside its buffer.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn block(
    a: *const u32,
    b: *const u32,
    panel_bytes: usize,
    pairs: usize,
    out: &mut [f32; BLOCK * BLOCK],
) {
    let b_right = b.byte_add(panel_bytes);
    let out = out.as_mut_ptr();
    let mut r0 = 0;
    while r0 < pairs {
        let n = PASS_PAIRS.min(pairs - r0);
        let first = r0 == 0;
        let (a, b, b_right) = (a.add(r0 * BLOCK), b.add(r0 * 16), b_right.add(r0 * 16));
        let mut row = 0;
        for rows in GROUPS {
            let (a, out) = (a.add(row), out.add(row * BLOCK));
            match rows {
                8 => group::<8>(a, b, b_right, n, first, out),
                12 => group::<12>(a, b, b_right, n, first, out),
                _ => unreachable!("a group size without a kernel"),
            }
            row += rows;
        }
        r0 += n;
    }
}

/// Rows `0..R` (of the block, from `a` and `out`) over `pairs` pairs of k: added to what `out`
/// holds, or (`first`) written over it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn group<const R: usize>(
    a: *const u32,
    b_left: *const u32,
    b_right: *const u32,
    pairs: usize,
    first: bool,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if !first {
        for (i, row) in acc.iter_mut().enumerate() {
            row[0] = _mm512_loadu_ps(out.add(i * BLOCK));
            row[1] = _mm512_loadu_ps(out.add(i * BLOCK + 16));
        }
    }
    for r in 0..pairs {
        // SAFETY (of the transmutes): `__m512i` and `__m512bh` are both 64 bytes of plain
        // lanes; the bits are reinterpreted as 32 bf16 values.
        let left: __m512bh = std::mem::transmute(_mm512_loadu_si512(b_left.add(r * 16).cast()));
        let right: __m512bh = std::mem::transmute(_mm512_loadu_si512(b_right.add(r * 16).cast()));
        let a = a.add(r * BLOCK);
        for (i, row) in acc.iter_mut().enumerate() {
            let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(a.add(i).read() as i32));
            row[0] = _mm512_dpbf16_ps(row[0], pair, left);
            row[1] = _mm512_dpbf16_ps(row[1], pair, right);
        }
    }
    for (i, row) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(i * BLOCK), row[0]);
        _mm512_storeu_ps(out.add(i * BLOCK + 16), row[1]);
    }
}

/// # Safety
/// Never called: [`available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
pub unsafe fn block(
    _a: *const u32,
    _b: *const u32,
    _panel_bytes: usize,
    _pairs: usize,
    _out: &mut [f32; BLOCK * BLOCK],
) {
    unreachable!("AVX512-BF16 exists only on x86_64")
}
