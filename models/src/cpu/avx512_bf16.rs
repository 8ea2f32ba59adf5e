//! The AVX512-BF16 microkernel for bf16 products on CPUs without AMX (AMD Zen 4 and later,
//! Intel Cooper Lake): [`super::half_gemm`]'s 32x32 f32 block from the same pair layout.
//!
//! `vdpbf16ps` adds to each of 16 f32 lanes the dot product of one bf16 pair from each side:
//! a broadcast pair `(A[i][2r], A[i][2r + 1])` against a row of [`super::half_gemm::PackedB`],
//! 16 columns of pairs `(B[2r][j], B[2r + 1][j])`, is one step of row `i` of `C` over two
//! values of k. A block keeps groups of rows of `C` (two zmm registers, 32 columns, a row) in
//! registers while it walks down k, reading `A`'s pairs in place from its rows.

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

/// The same for a block of at most 16 columns (one zmm a row): the last block of a product
/// whose columns end past a multiple of 32 (attention's `p v` at head size 40 or 80).
const NARROW_GROUPS: [usize; 2] = [16, 16];

/// One 32x32 f32 block `out = A B` over `2 * pairs` values of k, row-major with a row stride
/// of 32 floats; when `cols <= 16`, only the block's first 16 columns are computed and written.
///
/// - `a`: the first of 32 rows of bf16, `lda_bytes` apart, each holding `2 * pairs` values.
/// - `b`: two right-hand panels in the pair layout, the second `panel_bytes` after the first:
///   for each pair of k, 16 columns of two bf16 values.
///
/// # Safety
/// [`available`] returned true; every byte read or written lies inside its buffer.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn block(
    a: *const u16,
    lda_bytes: usize,
    b: *const u16,
    panel_bytes: usize,
    pairs: usize,
    cols: usize,
    out: &mut [f32; BLOCK * BLOCK],
) {
    let panels = [b.cast::<u32>(), b.byte_add(panel_bytes).cast::<u32>()];
    let a = a.cast::<u8>();
    let out = out.as_mut_ptr();
    let groups: &[usize] = if cols <= 16 { &NARROW_GROUPS } else { &GROUPS };
    let mut r0 = 0;
    while r0 < pairs {
        let n = PASS_PAIRS.min(pairs - r0);
        let first = r0 == 0;
        let a = a.add(r0 * 4);
        let panels = panels.map(|p| p.add(r0 * 16));
        let mut row = 0;
        for &rows in groups {
            let (a, out) = (a.add(row * lda_bytes), out.add(row * BLOCK));
            match (rows, cols <= 16) {
                (8, false) => group::<8, 2>(a, lda_bytes, panels, n, first, out),
                (12, false) => group::<12, 2>(a, lda_bytes, panels, n, first, out),
                (16, true) => group::<16, 1>(a, lda_bytes, panels, n, first, out),
                _ => unreachable!("a group size without a kernel"),
            }
            row += rows;
        }
        r0 += n;
    }
}

/// Rows `0..R` and zmm columns `0..W` (16 columns each, from `panels[w]`) of the block, from
/// the rows at `a` (`lda_bytes` apart) and `out`, over `pairs` pairs of k: added to what `out` holds, or (`first`) written
/// over it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn group<const R: usize, const W: usize>(
    a: *const u8,
    lda_bytes: usize,
    panels: [*const u32; 2],
    pairs: usize,
    first: bool,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); W]; R];
    if !first {
        for (i, row) in acc.iter_mut().enumerate() {
            for (w, lanes) in row.iter_mut().enumerate() {
                *lanes = _mm512_loadu_ps(out.add(i * BLOCK + 16 * w));
            }
        }
    }
    for r in 0..pairs {
        // SAFETY (of the transmutes): `__m512i` and `__m512bh` are both 64 bytes of plain
        // lanes; the bits are reinterpreted as 32 bf16 values.
        let b: [__m512bh; W] = std::array::from_fn(|w| {
            std::mem::transmute(_mm512_loadu_si512(panels[w].add(r * 16).cast()))
        });
        let a = a.add(r * 4);
        for (i, row) in acc.iter_mut().enumerate() {
            let pair = a.add(i * lda_bytes).cast::<i32>().read_unaligned();
            let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
            for (lanes, b) in row.iter_mut().zip(&b) {
                *lanes = _mm512_dpbf16_ps(*lanes, pair, *b);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (w, lanes) in row.iter().enumerate() {
            _mm512_storeu_ps(out.add(i * BLOCK + 16 * w), *lanes);
        }
    }
}

/// # Safety
/// Never called: [`available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
pub unsafe fn block(
    _a: *const u16,
    _lda_bytes: usize,
    _b: *const u16,
    _panel_bytes: usize,
    _pairs: usize,
    _cols: usize,
    _out: &mut [f32; BLOCK * BLOCK],
) {
    unreachable!("AVX512-BF16 exists only on x86_64")
}
