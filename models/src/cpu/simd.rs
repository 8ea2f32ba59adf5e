//! Wider vectors for the CPU kernels' own loops, chosen at run time.
//!
//! The crate is built for baseline x86-64 (SSE2), so the compiler vectorizes the kernels' loops
//! (softmax, rounding to bf16, packing, norms, activations, epilogues) four floats wide, even on
//! a CPU with AVX-512. [`vectorized`] runs a closure inside a function compiled for AVX-512 or
//! AVX2 when this CPU has it: the closure is inlined there, so its loops are vectorized for
//! that instruction set. Results do not depend on the width: Rust never fuses a multiply and
//! an add unless asked (`mul_add`), and the kernels keep their own summation order, so every
//! width gives the same bits.
//!
//! `OXIDIFF_CPU_SIMD=avx2` or `=baseline` (read once) caps the width, to compare.

use std::sync::OnceLock;

/// The vector instructions [`vectorized`] compiles its closure for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum VectorWidth {
    /// SSE2, 128 bits: every x86-64 CPU (and every other architecture's default).
    Baseline,
    /// AVX2 and FMA, 256 bits.
    Avx2,
    /// AVX-512 (F, BW, VL, DQ), 512 bits.
    Avx512,
}

impl VectorWidth {
    /// The width's name, as `OXIDIFF_CPU_SIMD` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}

/// The widest [`VectorWidth`] this CPU runs, capped by `OXIDIFF_CPU_SIMD`. Asked once.
pub fn width() -> VectorWidth {
    static WIDTH: OnceLock<VectorWidth> = OnceLock::new();
    *WIDTH.get_or_init(|| {
        let cap = match std::env::var("OXIDIFF_CPU_SIMD").as_deref() {
            Ok("baseline") => VectorWidth::Baseline,
            Ok("avx2") => VectorWidth::Avx2,
            _ => VectorWidth::Avx512,
        };
        detected().min(cap)
    })
}

#[cfg(target_arch = "x86_64")]
fn detected() -> VectorWidth {
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
        && avx2_detected()
    {
        VectorWidth::Avx512
    } else if avx2_detected() {
        VectorWidth::Avx2
    } else {
        VectorWidth::Baseline
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_detected() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("bmi2")
}

#[cfg(not(target_arch = "x86_64"))]
fn detected() -> VectorWidth {
    VectorWidth::Baseline
}

/// Runs `f` compiled for this process's [`width`]. Only code inlined into `f` gets the wider
/// vectors, so pass `f` as `#[inline(always)] || ...` (what [`vectorize!`] writes): a closure
/// the compiler chose not to inline would run at the baseline width. Work handed to rayon from
/// inside `f` runs elsewhere, at the baseline width.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    vectorized_for(width(), f)
}

/// Runs `f` compiled for `width`, or for [`width`] where `width` is wider than this process
/// allows (tests compare the widths' results through it).
#[inline(always)]
pub fn vectorized_for<R>(width: VectorWidth, f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        match width.min(self::width()) {
            // SAFETY: `width` returns these only where the CPU has the features they enable.
            VectorWidth::Avx512 => unsafe { avx512(f) },
            VectorWidth::Avx2 => unsafe { avx2(f) },
            VectorWidth::Baseline => f(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        f()
    }
}

/// `simd::vectorize!(expression)`: the expression evaluated by [`vectorized`], as an
/// always-inlined closure.
macro_rules! vectorize {
    ($body:expr) => {
        $crate::cpu::simd::vectorized(
            #[inline(always)]
            || $body,
        )
    };
}
pub(crate) use vectorize;

/// # Safety
/// The CPU has every feature enabled here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// # Safety
/// The CPU has every feature enabled here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
