//! The bf16 product ([`oxidiff_models::cpu::half_gemm`], on whichever kernel this CPU has)
//! against the `gemm` crate's f32 product of the same shape, in GFLOP/s, on a few SD 1.5 UNet
//! shapes; rounds alternate so drift of a shared machine hits both sides. Run it pinned, e.g.
//! `RAYON_NUM_THREADS=1 taskset -c 0 cargo run --release -p oxidiff-models --example
//! half_gemm_bench -- [rounds]`.

use std::time::Instant;

use half::bf16;
use oxidiff_models::cpu::aligned::Aligned;
use oxidiff_models::cpu::half_gemm::{self, PackedB};

/// `(m, k, n)`, `C[m, n] = A[m, k] B[k, n]`, and what it stands for.
const SHAPES: [(usize, usize, usize, &str); 7] = [
    (320, 2880, 4096, "conv 3x3 320->320 at 64x64"),
    (2048, 320, 320, "linear 320->320, 2048 rows"),
    (512, 640, 5120, "linear 640->5120 (GEGLU), 512 rows"),
    (
        4096,
        40,
        4096,
        "q k^T, head 40, 4096 queries and keys at once",
    ),
    (
        64,
        40,
        4096,
        "q k^T of one 64-query block, head 40, 4096 keys",
    ),
    (
        64,
        4096,
        40,
        "p v of one 64-query block, 4096 keys, head 40",
    ),
    (
        64,
        1024,
        80,
        "p v of one 64-query block, 1024 keys, head 80",
    ),
];

fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1 << 24) as f32 - 0.5
        })
        .collect()
}

/// `C`'s first element, written by the epilogues of several threads.
#[derive(Clone, Copy)]
struct Out(*mut f32);

// SAFETY: the epilogues write disjoint blocks through it.
unsafe impl Sync for Out {}

impl Out {
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Best seconds of `repeat` runs of `f`.
fn best(repeat: usize, mut f: impl FnMut()) -> f64 {
    (0..repeat)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let kernel = half_gemm::kernel();
    println!(
        "bf16 kernel: {kernel:?}; threads: {}",
        rayon::current_num_threads()
    );
    if kernel.is_none() {
        println!("no bf16 kernel on this CPU: nothing to compare");
        return;
    }
    for (m, k, n, what) in SHAPES {
        let a = values(m * k, 1);
        let b = values(k * n, 2);
        // On a cache line, as bf16 weights converted at load are.
        let mut a16 = Aligned::<bf16>::zeroed(m * k);
        for (d, &v) in a16.as_mut_slice().iter_mut().zip(&a) {
            *d = bf16::from_f32(v);
        }
        let a16 = a16.as_slice();
        let b16: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
        let packed = PackedB::from_rows(&b16, n, k, n);
        let mut c = vec![0.0f32; m * n];
        let flops = 2.0 * (m * k * n) as f64;
        let repeat = (2e10 / flops).clamp(1.0, 500.0) as usize;
        let (mut t16, mut t32) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..rounds {
            let out = Out(c.as_mut_ptr());
            t16 = t16.min(best(repeat, || {
                // The epilogue stores the block into `C`, as the f32 product does.
                half_gemm::gemm(a16, k, m, &packed, |block| {
                    for i in 0..block.rows {
                        let at = (block.row0 + i) * n + block.col0;
                        // SAFETY: blocks are disjoint parts of `c` [m, n].
                        let dst = unsafe { std::slice::from_raw_parts_mut(out.at(at), block.cols) };
                        dst.copy_from_slice(block.row(i));
                    }
                });
            }));
            t32 = t32.min(best(repeat, || {
                // SAFETY: the pointers and strides describe `c` [m, n], `a` [m, k] and
                // `b` [k, n], row-major, all inside their vectors.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        1,
                        k as isize,
                        b.as_ptr(),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(0),
                    )
                }
            }));
        }
        let (g16, g32) = (flops / t16 / 1e9, flops / t32 / 1e9);
        println!(
            "{m:>5} x {k:>5} x {n:>5}  bf16 {g16:7.1} GFLOP/s  f32 {g32:7.1} GFLOP/s  bf16/f32 {:5.2}x  ({what})",
            g16 / g32
        );
        assert!(c[0].is_finite());
    }
}
