//! bf16 matrix products with f32 accumulation for the CPU kernels in bf16: `C = A B` with `A`
//! `[m, k]` row-major bf16 and `B` `[k, n]` packed once ([`PackedB`]), every 32x32 block of `C`
//! handed in f32 to the caller's epilogue (bias, rounding, layout). One driver, two
//! microkernels chosen at run time ([`HalfKernel`]): AMX tiles ([`super::amx`]) where the CPU
//! has them, else AVX512-BF16 ([`super::avx512_bf16`]). Callers check [`available`] first;
//! without either they widen to f32 and use the f32 kernels instead.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

pub use super::amx::BLOCK;

use super::aligned::Aligned;
use super::amx::{self, TILE_K, TILE_ROWS};
use super::avx512_bf16;
use super::common::OutPtr;
use super::simd;

/// The microkernel behind [`gemm`] on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfKernel {
    /// Intel AMX tiles (`tdpbf16ps`), Xeon since Sapphire Rapids.
    Amx,
    /// AVX-512 `vdpbf16ps` on zmm registers: AMD Zen 4 and later, Intel Cooper Lake.
    Avx512Bf16,
}

/// The kernel this process uses for bf16 products: AMX where [`amx::available`], else
/// AVX512-BF16 where [`avx512_bf16::available`] (each turned off by its environment switch,
/// `OXIDIFF_CPU_AMX=off` and `OXIDIFF_CPU_AVX512BF16=off`), else none. Asked once.
pub fn kernel() -> Option<HalfKernel> {
    static KERNEL: OnceLock<Option<HalfKernel>> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        if amx::available() {
            Some(HalfKernel::Amx)
        } else if avx512_bf16::available() {
            Some(HalfKernel::Avx512Bf16)
        } else {
            None
        }
    })
}

/// Whether [`gemm`] runs on this CPU (some [`kernel`] is there).
pub fn available() -> bool {
    kernel().is_some()
}

/// Values of k in one slice of an AMX product ([`Tiles::job`]): 32 rows of `A` over it are
/// 32 KiB, which stay in the L1 cache.
const K_SLICE: usize = 512;

/// Columns of `B` whose packed panels one job reads: about 1 MiB of `B` at k = 1024, so the
/// panels stay in the L2 cache while the job walks down the rows of `A`.
const COLUMN_CHUNK: usize = 256;

/// The right-hand side of a product in AMX's pair layout: panels of 16 columns; in a panel, for
/// each pair of k rows `(2r, 2r + 1)`, 16 columns of the two values `(B[2r][j], B[2r + 1][j])`
/// in one `u32`, 64 bytes; k padded with zeros to a multiple of 32 and n to a multiple of 32.
pub struct PackedB {
    k: usize,
    n: usize,
    k_pad: usize,
    values: Aligned<u32>,
}

impl PackedB {
    /// Packs `B[kk][j] = b[kk * ldb + j]`, `k` rows of `n` columns.
    pub fn from_rows(b: &[bf16], ldb: usize, k: usize, n: usize) -> Self {
        assert!(
            k == 0 || n == 0 || b.len() >= (k - 1) * ldb + n,
            "B is shorter than its shape"
        );
        Self::pairs(
            k,
            n,
            #[inline(always)]
            |j0, cols, panel| {
                for (r, pairs) in panel.chunks_exact_mut(TILE_ROWS).enumerate() {
                    let kk = 2 * r;
                    if kk >= k {
                        break;
                    }
                    let even = &b[kk * ldb + j0..kk * ldb + j0 + cols];
                    if kk + 1 < k {
                        let odd = &b[(kk + 1) * ldb + j0..(kk + 1) * ldb + j0 + cols];
                        for ((pair, e), o) in pairs.iter_mut().zip(even).zip(odd) {
                            pair.write(pair_of(*e, *o));
                        }
                    } else {
                        for (pair, e) in pairs.iter_mut().zip(even) {
                            pair.write(pair_of(*e, bf16::ZERO));
                        }
                    }
                }
            },
        )
    }

    /// Packs `B[kk][j] = bt[j * ldbt + kk]`: the transpose of `bt`, `n` rows of `k` values (the
    /// keys of an attention head, for `q k^T`).
    pub fn from_transposed(bt: &[bf16], ldbt: usize, k: usize, n: usize) -> Self {
        assert!(
            k == 0 || n == 0 || bt.len() >= (n - 1) * ldbt + k,
            "B^T is shorter than its shape"
        );
        Self::pairs(
            k,
            n,
            #[inline(always)]
            |j0, cols, panel| {
                // Whole steps of 16 pairs of 16 full columns as 16x16 transposes of pairs,
                // the rest a value at a time.
                let mut done = 0;
                #[cfg(target_arch = "x86_64")]
                if cols == TILE_ROWS && simd::width() == simd::VectorWidth::Avx512 {
                    done = k / 32 * 16;
                    // SAFETY: AVX-512 F is there; the 16 rows hold `k >= 2 * done` values.
                    unsafe { transposed_pairs_avx512(&bt[j0 * ldbt..], ldbt, done, panel) };
                }
                for j in 0..cols {
                    let src = &bt[(j0 + j) * ldbt + 2 * done..(j0 + j) * ldbt + k];
                    for (r, two) in src.chunks(2).enumerate() {
                        let odd = two.get(1).copied().unwrap_or(bf16::ZERO);
                        panel[(done + r) * TILE_ROWS + j].write(pair_of(two[0], odd));
                    }
                }
            },
        )
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn n(&self) -> usize {
        self.n
    }

    /// k padded to whole steps of 32, the rows of every panel.
    pub(crate) fn k_pad(&self) -> usize {
        self.k_pad
    }

    /// The panels (16 columns each, `k_pad / 2` pairs of k rows of 16 `u32`), one after another,
    /// for kernels that drive [`amx::block_2x2`] themselves.
    pub(crate) fn panels(&self) -> &[u32] {
        self.values.as_slice()
    }

    /// The pair layout for `k` rows and `n` columns, zero-padded, each panel of 16 columns
    /// filled (in parallel) by `fill(first column, columns in it, panel)`, which must write
    /// every pair `r < k.div_ceil(2)` of those columns (`panel[r * 16 + j]`, `j < columns`);
    /// the padding is zeroed here, and nothing is written twice.
    fn pairs(
        k: usize,
        n: usize,
        fill: impl Fn(usize, usize, &mut [MaybeUninit<u32>]) + Sync,
    ) -> Self {
        let k_pad = k.next_multiple_of(TILE_K);
        let panels = n.next_multiple_of(BLOCK) / TILE_ROWS;
        let panel_len = k_pad / 2 * TILE_ROWS;
        let filled_rows = k.div_ceil(2) * TILE_ROWS;
        let fill_all = |all: &mut [MaybeUninit<u32>]| {
            all.par_chunks_mut(panel_len)
                .enumerate()
                .for_each(|(p, panel)| {
                    let j0 = p * TILE_ROWS;
                    let cols = n.saturating_sub(j0).min(TILE_ROWS);
                    let padding = if cols < TILE_ROWS { 0 } else { filled_rows };
                    panel[padding..].fill(MaybeUninit::new(0));
                    if cols > 0 {
                        simd::vectorize!(fill(j0, cols, panel));
                    }
                })
        };
        // SAFETY: every value is written: a panel's rows past `k` (and all of a panel with
        // fewer than 16 columns) are zeroed above, and `fill` writes the rest, as its contract
        // asks.
        let values = unsafe { Aligned::from_uninit(panels * panel_len, fill_all) };
        Self {
            k,
            n,
            k_pad,
            values,
        }
    }
}

/// The first `pairs` (a multiple of 16) pairs of 16 rows of `bt` (`ldbt` values apart) in the
/// pair layout: `panel[r * 16 + j]` = pair `r` of row `j`, two neighbouring values that already
/// lie together in the row, so 16 rows of 16 pairs are one 16x16 transpose.
///
/// # Safety
/// The CPU has AVX-512 F; `bt` holds 16 rows of `2 * pairs` values and `panel` 16 `pairs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transposed_pairs_avx512(
    bt: &[bf16],
    ldbt: usize,
    pairs: usize,
    panel: &mut [MaybeUninit<u32>],
) {
    use std::arch::x86_64::*;
    debug_assert!(pairs.is_multiple_of(16) && panel.len() >= pairs * TILE_ROWS);
    debug_assert!(pairs == 0 || bt.len() >= 15 * ldbt + 2 * pairs);
    let (src, dst) = (bt.as_ptr(), panel.as_mut_ptr().cast::<__m512i>());
    for step in 0..pairs / 16 {
        let rows = std::array::from_fn(|j| {
            _mm512_loadu_si512(src.add(j * ldbt + step * 32).cast::<__m512i>())
        });
        for (c, column) in super::common::transpose_16x16(rows).into_iter().enumerate() {
            _mm512_storeu_si512(dst.add(step * 16 + c), column);
        }
    }
}

/// The two bf16 values of one k pair as the tiles read them: the even row's in the low half.
#[inline(always)]
fn pair_of(even: bf16, odd: bf16) -> u32 {
    u32::from(even.to_bits()) | (u32::from(odd.to_bits()) << 16)
}

/// One block of the product handed to the epilogue: rows `row0..row0 + rows` and columns
/// `col0..col0 + cols` of `C`, element `(i, j)` at `values[i * BLOCK + j]`.
pub struct Block<'a> {
    pub row0: usize,
    pub col0: usize,
    pub rows: usize,
    pub cols: usize,
    pub values: &'a [f32; BLOCK * BLOCK],
}

impl Block<'_> {
    /// Row `i` of the block (its `cols` values).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * BLOCK..i * BLOCK + self.cols]
    }
}

/// `C = A B` for `A[i][kk] = a[i * lda + kk]` (`m` rows, `b.k()` columns), every block of `C`
/// passed to `epilogue` exactly once, in parallel on rayon's pool.
///
/// # Panics
/// When [`available`] is false, or `a` is shorter than its shape.
pub fn gemm(a: &[bf16], lda: usize, m: usize, b: &PackedB, epilogue: impl Fn(Block<'_>) + Sync) {
    run(a, lda, m, b, &epilogue, Threads::Pool);
}

/// [`gemm`] on the calling thread alone, for callers that already run in parallel jobs (one
/// attention head each).
pub fn gemm_on_this_thread(
    a: &[bf16],
    lda: usize,
    m: usize,
    b: &PackedB,
    epilogue: impl Fn(Block<'_>) + Sync,
) {
    run(a, lda, m, b, &epilogue, Threads::Caller);
}

/// `C = A B` written as f32 into `out` (`ldc` values from one row to the next) on the calling
/// thread, for a caller that reads the sums as they are (attention's scores): no epilogue, on
/// AMX the accumulator tiles stored straight into `out`. Rows `0..m` and columns `0..n` hold
/// the product; the rest of the first `m` rounded up to 32 rows and `n` rounded up to 32
/// columns may be overwritten (with the products of the zero padding).
///
/// # Panics
/// When [`available`] is false, `a` is shorter than its shape, `ldc` is under `n` rounded up
/// to 32 or `out` under `m` rounded up to 32 rows of `ldc`.
pub fn gemm_f32_on_this_thread(
    a: &[bf16],
    lda: usize,
    m: usize,
    b: &PackedB,
    out: &mut [f32],
    ldc: usize,
) {
    let (k, n) = (b.k, b.n);
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= (m - 1) * lda + k, "A is shorter than its shape");
    assert!(
        ldc >= n.next_multiple_of(BLOCK),
        "C's rows are shorter than B's padded columns"
    );
    assert!(
        out.len() >= m.next_multiple_of(BLOCK) * ldc,
        "C is shorter than its padded shape"
    );
    let kernel = kernel().expect("half_gemm needs AMX or AVX512-BF16: check available() first");
    if kernel != HalfKernel::Amx {
        let ptr = OutPtr(out.as_mut_ptr());
        run(
            a,
            lda,
            m,
            b,
            &|block: Block<'_>| {
                for i in 0..block.rows {
                    let at = (block.row0 + i) * ldc + block.col0;
                    // SAFETY: blocks are disjoint parts of `out`, whose length was checked.
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptr.add(at).0, block.cols) };
                    dst.copy_from_slice(block.row(i));
                }
            },
            Threads::Caller,
        );
        return;
    }
    let k_pad = b.k_pad;
    let tiled = TiledA::new(a, lda, m, k, k_pad, Threads::Caller);
    let panel_len = k_pad / 2 * TILE_ROWS;
    let steps = k_pad / TILE_K;
    let pairs = b.values.as_slice();
    // SAFETY: the kernel is AMX only where `amx::available()` granted the tiles.
    unsafe { amx::configure_thread() };
    // Columns outside, rows inside: for the short k of attention's `q k^T` the rows' tiles
    // stay in the L1 cache, and each block of `B`'s columns is read from the L2 cache once.
    for col0 in (0..n).step_by(BLOCK) {
        for row0 in (0..m).step_by(BLOCK) {
            let panel = col0 / TILE_ROWS;
            let c = out[row0 * ldc + col0..].as_mut_ptr();
            let mut step0 = 0;
            while step0 < steps {
                let slice = (steps - step0).min(K_SLICE / TILE_K);
                // SAFETY: as in `Tiles::job`; the 32 rows of 32 floats at `c` lie inside `out`,
                // whose length (32-row blocks of `ldc >= n` rounded up to 32) was checked.
                unsafe {
                    amx::block_2x2(
                        tiled.tiles(row0, step0),
                        pairs[panel * panel_len + step0 * TILE_ROWS * TILE_ROWS..]
                            .as_ptr()
                            .cast::<u16>(),
                        panel_len * 4,
                        slice,
                        c,
                        ldc * 4,
                        step0 > 0,
                    );
                }
                step0 += slice;
            }
        }
    }
}

/// Where a product's jobs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Threads {
    Pool,
    Caller,
}

fn run(
    a: &[bf16],
    lda: usize,
    m: usize,
    b: &PackedB,
    epilogue: &(impl Fn(Block<'_>) + Sync),
    threads: Threads,
) {
    let (k, n) = (b.k, b.n);
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= (m - 1) * lda + k, "A is shorter than its shape");
    let kernel = kernel().expect("half_gemm needs AMX or AVX512-BF16: check available() first");
    let product = Tiles {
        kernel,
        a,
        lda,
        m,
        k,
        k_pad: b.k_pad,
        n,
        pairs: b.values.as_slice(),
    };
    product.run(epilogue, threads)
}

/// One product.
struct Tiles<'a> {
    kernel: HalfKernel,
    a: &'a [bf16],
    lda: usize,
    m: usize,
    k: usize,
    k_pad: usize,
    n: usize,
    pairs: &'a [u32],
}

/// `A` as the [`HalfKernel::Amx`] kernel reads it: in place where its rows hold whole steps of
/// k and whole blocks of 32 rows, else copied into tile order.
///
/// Copying costs a pass over `A` on every call, which for the weights of a layer (the left
/// side of the convolutions and linear layers) is more than the product gains from it. So
/// weights are read in place, and run at full speed where their rows start on cache lines
/// (bf16 weights converted at load are allocated so, [`crate::cpu::aligned`]); a misaligned
/// tile row reads two lines.
enum TiledA<'a> {
    /// `A` itself, `lda` values a row: k a whole number of steps and m a whole number of
    /// blocks of 32 rows.
    InPlace { a: &'a [bf16], lda: usize },
    /// For each block of 32 rows and each step of 32 values of k, the tile of the block's rows
    /// 0..16 and then the tile of its rows 16..32, each 16 rows of 32 values in 1 KiB, zero-padded
    /// past `m` and `k`: every tile one contiguous, aligned load.
    Packed {
        values: Aligned<u16>,
        /// Values per block of 32 rows (`32 * k_pad`).
        block_len: usize,
    },
}

impl<'a> TiledA<'a> {
    /// Values in one tile (16 rows of 32).
    const TILE: usize = TILE_ROWS * TILE_K;

    fn new(a: &'a [bf16], lda: usize, m: usize, k: usize, k_pad: usize, threads: Threads) -> Self {
        if k == k_pad && m.is_multiple_of(BLOCK) {
            return Self::InPlace { a, lda };
        }
        let block_len = BLOCK * k_pad;
        let mut values = Aligned::zeroed(m.div_ceil(BLOCK) * block_len);
        match threads {
            Threads::Pool => values
                .as_mut_slice()
                .par_chunks_mut(block_len)
                .enumerate()
                .for_each(|(block, tiles)| {
                    simd::vectorize!(Self::fill(a, lda, m, k, block, tiles))
                }),
            Threads::Caller => simd::vectorize!(values
                .as_mut_slice()
                .chunks_mut(block_len)
                .enumerate()
                .for_each(|(block, tiles)| Self::fill(a, lda, m, k, block, tiles))),
        }
        Self::Packed { values, block_len }
    }

    /// Block `block` of 32 rows of `A` in tile order into `tiles` (zeroed). Always inlined, so
    /// it runs at the vector width of the caller's [`simd::vectorize!`].
    #[inline(always)]
    fn fill(a: &[bf16], lda: usize, m: usize, k: usize, block: usize, tiles: &mut [u16]) {
        let row0 = block * BLOCK;
        for i in 0..(m - row0).min(BLOCK) {
            let row = &a[(row0 + i) * lda..(row0 + i) * lda + k];
            let (half, r) = (i / TILE_ROWS, i % TILE_ROWS);
            for (step, src) in row.chunks(TILE_K).enumerate() {
                let at = (step * 2 + half) * Self::TILE + r * TILE_K;
                tiles[at..at + src.len()].copy_from_slice(bytemuck::cast_slice(src));
            }
        }
    }

    /// The tiles of the block of rows starting at `row0`, from step `step` of k on.
    fn tiles(&self, row0: usize, step: usize) -> amx::LeftTiles {
        match self {
            Self::InPlace { a, lda } => {
                let top = a[row0 * lda + step * TILE_K..].as_ptr().cast::<u16>();
                amx::LeftTiles {
                    top,
                    bottom: top.wrapping_add(TILE_ROWS * lda),
                    row_bytes: lda * 2,
                    step_bytes: TILE_K * 2,
                }
            }
            Self::Packed { values, block_len } => {
                let top =
                    values.as_slice()[row0 / BLOCK * block_len + step * 2 * Self::TILE..].as_ptr();
                amx::LeftTiles {
                    top,
                    bottom: top.wrapping_add(Self::TILE),
                    row_bytes: TILE_K * 2,
                    step_bytes: 2 * Self::TILE * 2,
                }
            }
        }
    }
}

/// A job's buffers: `A`'s rows padded where needed (for the AVX512-BF16 kernel; AMX reads
/// [`TiledA`]), and the blocks of `C` of its chunk.
struct Scratch {
    rows: Vec<u16>,
    /// One block of `C` per 32 columns of a job's chunk: the AMX kernel's sums between slices
    /// of k (the AVX512-BF16 kernel uses the first alone).
    out: Vec<Sums>,
}

/// One block of sums, on a cache line (the AMX kernel loads and stores it as tiles).
#[derive(Clone)]
#[repr(C, align(64))]
struct Sums([f32; BLOCK * BLOCK]);

impl Tiles<'_> {
    /// Jobs of (chunk of columns, block of 32 rows), chunk by chunk.
    fn run(&self, epilogue: &(impl Fn(Block<'_>) + Sync), threads: Threads) {
        let jobs = self.n.div_ceil(COLUMN_CHUNK) * self.m.div_ceil(BLOCK);
        let tiled = (self.kernel == HalfKernel::Amx)
            .then(|| TiledA::new(self.a, self.lda, self.m, self.k, self.k_pad, threads));
        let tiled = tiled.as_ref();
        let init = || {
            if self.kernel == HalfKernel::Amx {
                // SAFETY: the AMX kernel is chosen only when `amx::available()` granted the tiles.
                unsafe { amx::configure_thread() };
            }
            Scratch {
                rows: match self.kernel {
                    HalfKernel::Amx => Vec::new(),
                    HalfKernel::Avx512Bf16 => vec![0u16; BLOCK * self.k_pad],
                },
                out: vec![Sums([0.0; BLOCK * BLOCK]); COLUMN_CHUNK / BLOCK],
            }
        };
        match threads {
            Threads::Pool => (0..jobs)
                .into_par_iter()
                .for_each_init(init, |scratch, job| {
                    simd::vectorize!(self.job(job, tiled, scratch, epilogue))
                }),
            Threads::Caller => {
                let mut scratch = init();
                simd::vectorize!((0..jobs).for_each(|job| self.job(
                    job,
                    tiled,
                    &mut scratch,
                    epilogue
                )));
            }
        }
    }

    /// One job: the blocks of a chunk of columns for 32 rows of `A` (on AMX read from
    /// `tiled`, else made readable in `scratch` first). Inlined into [`simd::vectorized`]'s
    /// closure, with the epilogue.
    #[inline(always)]
    fn job(
        &self,
        job: usize,
        tiled: Option<&TiledA<'_>>,
        scratch: &mut Scratch,
        epilogue: &(impl Fn(Block<'_>) + Sync),
    ) {
        let (m, k, k_pad, n) = (self.m, self.k, self.k_pad, self.n);
        let row_blocks = m.div_ceil(BLOCK);
        let panel_len = k_pad / 2 * TILE_ROWS;
        let (chunk, block) = (job / row_blocks, job % row_blocks);
        let row0 = block * BLOCK;
        let rows = (m - row0).min(BLOCK);
        let col_end = ((chunk + 1) * COLUMN_CHUNK).min(n);
        let col_start = chunk * COLUMN_CHUNK;
        let finish = |col0: usize, values: &[f32; BLOCK * BLOCK]| {
            epilogue(Block {
                row0,
                col0,
                rows,
                cols: (n - col0).min(BLOCK),
                values,
            })
        };
        match (self.kernel, tiled) {
            (HalfKernel::Amx, Some(tiled)) => {
                // k in slices of K_SLICE: the slice of A's 32 rows stays in the L1 cache while
                // every block of the chunk's columns is multiplied with it, each block's sums
                // kept in `out` between slices.
                let steps = k_pad / TILE_K;
                let mut step0 = 0;
                while step0 < steps {
                    let slice = (steps - step0).min(K_SLICE / TILE_K);
                    for col0 in (col_start..col_end).step_by(BLOCK) {
                        let panel = col0 / TILE_ROWS;
                        // SAFETY: `tiled` holds `k_pad / 32` steps of tiles for every block
                        // of rows, of which this slice reads `slice` from `step0`; panels `panel` and
                        // `panel + 1` exist because the panels cover n rounded up to 32
                        // columns, each `k_pad / 2` pairs (1 KiB per step of k) long; AMX is
                        // what `kernel()` found.
                        unsafe {
                            let b = self.pairs[panel * panel_len + step0 * TILE_ROWS * TILE_ROWS..]
                                .as_ptr()
                                .cast::<u16>();
                            amx::block_2x2(
                                tiled.tiles(row0, step0),
                                b,
                                panel_len * 4,
                                slice,
                                scratch.out[(col0 - col_start) / BLOCK].0.as_mut_ptr(),
                                BLOCK * 4,
                                step0 > 0,
                            );
                        }
                    }
                    step0 += slice;
                }
                for col0 in (col_start..col_end).step_by(BLOCK) {
                    finish(col0, &scratch.out[(col0 - col_start) / BLOCK].0);
                }
            }
            _ => {
                let (a, lda_bytes) = self.rows(row0, rows, scratch);
                for col0 in (col_start..col_end).step_by(BLOCK) {
                    let panel = col0 / TILE_ROWS;
                    let b = self.pairs[panel * panel_len..].as_ptr().cast::<u16>();
                    // SAFETY: as for AMX, over the whole of k in whole pairs (see `rows`).
                    unsafe {
                        avx512_bf16::block(
                            a,
                            lda_bytes,
                            b,
                            panel_len * 4,
                            k.div_ceil(2),
                            (n - col0).min(BLOCK),
                            &mut scratch.out[0].0,
                        )
                    };
                    finish(col0, &scratch.out[0].0);
                }
            }
        }
    }

    /// `A`'s rows `row0..row0 + rows` as the AVX512-BF16 kernel reads them, (first row, row
    /// stride in bytes): 32 rows of `k` rounded up to even (whole pairs). Read in place where
    /// `a` holds them; otherwise (k odd, or the last rows of `A`) copied into a zero-padded
    /// block first, so no load reads past `a` or takes the next row's values (which, even times
    /// a zero of the padded `B`, could be a NaN).
    fn rows(&self, row0: usize, rows: usize, scratch: &mut Scratch) -> (*const u16, usize) {
        let (k, k_pad, lda) = (self.k, self.k_pad, self.lda);
        if k % 2 == 0 && rows == BLOCK {
            return (self.a[row0 * lda..].as_ptr().cast::<u16>(), lda * 2);
        }
        let padded = &mut scratch.rows[..BLOCK * k_pad];
        padded.fill(0);
        for i in 0..rows {
            let src = &self.a[(row0 + i) * lda..(row0 + i) * lda + k];
            let dst = &mut padded[i * k_pad..i * k_pad + k];
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_bits();
            }
        }
        (padded.as_ptr(), k_pad * 2)
    }
}
