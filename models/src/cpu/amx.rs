//! Intel AMX (Advanced Matrix Extensions) for bf16 products: detection, the per-process
//! permission Linux asks for, and the microkernel [`super::half_gemm`] runs where the CPU has
//! AMX.
//!
//! AMX multiplies 16x32 bf16 tiles into 16x16 f32 accumulators (`tdpbf16ps`), eight tile
//! registers of up to 1 KiB each. Stable Rust has no AMX intrinsics, so the kernel is inline
//! assembly; the tile registers are named in the assembly text and used by nothing else.
//! Linux keeps the tile state off until a process asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`); until that succeeds no tile instruction may run.

use std::sync::OnceLock;

/// Rows of one tile (and of one accumulator), bf16 pairs along k in a row of the right-hand
/// tile: the hardware's shape.
pub const TILE_ROWS: usize = 16;
/// bf16 values along k in one left-hand tile row (64 bytes).
pub const TILE_K: usize = 32;
/// The microkernel's output block: 2x2 accumulator tiles.
pub const BLOCK: usize = 2 * TILE_ROWS;

/// Whether this process may use AMX bf16: the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7),
/// Linux granted the tile state, and `OXIDIFF_CPU_AMX=off` does not turn it off. Asked once.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if std::env::var_os("OXIDIFF_CPU_AMX").is_some_and(|v| v == "off") {
            return false;
        }
        cpu_has_amx_bf16() && request_tile_state()
    })
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID leaf 7 is read only when the maximum leaf allows.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let amx_bf16 = edx & (1 << 22) != 0;
    let amx_tile = edx & (1 << 24) != 0;
    amx_bf16 && amx_tile
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_amx_bf16() -> bool {
    false
}

/// Asks Linux for the AMX tile data state for the whole process (threads included).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the arch_prctl system call with these arguments only changes which extended
    // states the process may use; rcx and r11 are clobbered by `syscall`.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_state() -> bool {
    false
}

/// The tile configuration every kernel here uses: palette 1, eight tiles of 16 rows x 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1;
    let mut tile = 0;
    while tile < 8 {
        bytes[16 + 2 * tile] = 64;
        bytes[48 + tile] = TILE_ROWS as u8;
        tile += 1;
    }
    TileConfig(bytes)
};

/// Loads the tile configuration on the calling thread (tiles are per-thread state), before
/// [`block_2x2`] runs there.
///
/// # Safety
/// [`available`] returned true.
#[cfg(target_arch = "x86_64")]
pub unsafe fn configure_thread() {
    std::arch::asm!("ldtilecfg [{cfg}]", cfg = in(reg) CONFIG.0.as_ptr(), options(nostack));
}

/// Where the microkernel reads its 32 rows of `A`: two tiles (rows 0..16 and 16..32) of
/// 16 rows of 32 bf16 values for each step of k.
#[derive(Debug, Clone, Copy)]
pub struct LeftTiles {
    /// The first step's tile of rows 0..16.
    pub top: *const u16,
    /// The first step's tile of rows 16..32.
    pub bottom: *const u16,
    /// Bytes from one row of a tile to the next.
    pub row_bytes: usize,
    /// Bytes from one step's tiles to the next's.
    pub step_bytes: usize,
}

/// One 32x32 f32 block `out = A B` over `k_steps * 32` values of k, written row-major into
/// `out` (`out_row_bytes` from one row to the next); with `accumulate`, `out += A B` (the
/// block's earlier sums loaded into the accumulators first), so a product can run over k in
/// slices.
///
/// - `a`: the 32 rows of `A`, in tiles as [`LeftTiles`] says.
/// - `b`: two right-hand panels in the pair layout ([`super::half_gemm::PackedB`]), the second
///   `panel_bytes` after the first: for each pair of k rows, 16 columns of two bf16 values.
/// - `out`: 32 rows of 32 floats, `out_row_bytes` apart (rows on cache lines load and store
///   fastest).
///
/// # Safety
/// [`configure_thread`] ran on this thread; every byte read or written lies inside its buffer.
#[cfg(target_arch = "x86_64")]
pub unsafe fn block_2x2(
    a: LeftTiles,
    b: *const u16,
    panel_bytes: usize,
    k_steps: usize,
    out: *mut f32,
    out_row_bytes: usize,
    accumulate: bool,
) {
    debug_assert!(k_steps > 0);
    let b_right = b.cast::<u8>().add(panel_bytes);
    let out = out.cast::<u8>();
    let (c1, c2, c3) = (
        out.add(64),
        out.add(TILE_ROWS * out_row_bytes),
        out.add(TILE_ROWS * out_row_bytes + 64),
    );
    if accumulate {
        std::arch::asm!(
            "tileloadd tmm0, [{c} + {row}*1]",
            "tileloadd tmm1, [{c1} + {row}*1]",
            "tileloadd tmm2, [{c2} + {row}*1]",
            "tileloadd tmm3, [{c3} + {row}*1]",
            c = in(reg) out,
            c1 = in(reg) c1,
            c2 = in(reg) c2,
            c3 = in(reg) c3,
            row = in(reg) out_row_bytes,
            options(nostack, readonly),
        );
    } else {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem),
        );
    }
    // The accumulators stay in tmm0..tmm3 between the two statements: nothing else in this
    // process uses the tile registers (see the module's note).
    std::arch::asm!(
        "2:",
        "tileloadd tmm4, [{a} + {lda}*1]",
        "tileloadd tmm6, [{b} + {pair_row}*1]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "tileloadd tmm7, [{b2} + {pair_row}*1]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "tileloadd tmm5, [{a2} + {lda}*1]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "add {a}, {a_step}",
        "add {a2}, {a_step}",
        "add {b}, 1024",
        "add {b2}, 1024",
        "dec {steps}",
        "jnz 2b",
        "tilestored [{c} + {row}*1], tmm0",
        "tilestored [{c1} + {row}*1], tmm1",
        "tilestored [{c2} + {row}*1], tmm2",
        "tilestored [{c3} + {row}*1], tmm3",
        a = inout(reg) a.top => _,
        a2 = inout(reg) a.bottom => _,
        b = inout(reg) b => _,
        b2 = inout(reg) b_right => _,
        steps = inout(reg) k_steps => _,
        lda = in(reg) a.row_bytes,
        a_step = in(reg) a.step_bytes,
        pair_row = in(reg) 64usize,
        row = in(reg) out_row_bytes,
        c = in(reg) out,
        c1 = in(reg) c1,
        c2 = in(reg) c2,
        c3 = in(reg) c3,
        options(nostack),
    );
}

// Elsewhere [`available`] is false, so nothing calls these; they keep `half_gemm` portable.

/// # Safety
/// Never called: [`available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
pub unsafe fn configure_thread() {
    unreachable!("AMX exists only on x86_64")
}

/// # Safety
/// Never called: [`available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
pub unsafe fn block_2x2(
    _a: LeftTiles,
    _b: *const u16,
    _panel_bytes: usize,
    _k_steps: usize,
    _out: *mut f32,
    _out_row_bytes: usize,
    _accumulate: bool,
) {
    unreachable!("AMX exists only on x86_64")
}
