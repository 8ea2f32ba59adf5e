//! diffusers' own f32, bf16 and f16 runs of the half-precision tests' requests
//! (`tools/golden/make_half.py`, `golden/half.*`) and the bounds derived from them.

use burn::tensor::FloatDType;

use super::Golden;

/// Headroom on [`DiffusersHalf::bound`]: burn-flex, too, picks its SIMD kernels by CPU (the
/// bounds must hold on AVX2-only CI machines too), and the recorded distances come from one
/// seed of each request.
pub const HEADROOM: f32 = 1.5;

/// diffusers' runs of `tests/dtype.rs`'s requests in f32, bf16 and f16 (`golden/half.*`).
pub struct DiffusersHalf(Golden);

impl DiffusersHalf {
    pub fn load() -> Self {
        Self(Golden::load("half"))
    }

    pub fn values(&self, case: &str, dtype: &str, part: &str) -> Vec<f32> {
        self.0.host(&format!("{case}.{dtype}.{part}")).0
    }

    /// A distance `make_half.py` recorded (`distance_to_f32`, `distance_to_f32_avx2`).
    pub fn recorded(&self, table: &str, case: &str, dtype: &str, part: &str) -> f32 {
        self.0.json[table][case][dtype][part]
            .as_f64()
            .unwrap_or_else(|| panic!("golden/half.json: no {table}.{case}.{dtype}.{part}"))
            as f32
    }

    /// How far oxidiff's half run may be from diffusers' half run (`part`: latents or image).
    pub fn bound(&self, case: &str, dtype: &str, part: &str, how: HalfBound) -> f32 {
        match how {
            // Both round the same f32 computation: by the triangle inequality they differ by
            // at most diffusers' distance to f32 plus oxidiff's, and oxidiff's is asked to be
            // no worse than diffusers' with either of torch's kernel sets (AVX-512/AMX where
            // the data was made, AVX2 as on CPUs without them; torch's two bf16 runs differ by
            // as much as bf16 differs from f32, so bit equality would hold on one CPU only).
            HalfBound::FromF32Distance => {
                let default = self.recorded("distance_to_f32", case, dtype, part);
                let avx2 = self.recorded("distance_to_f32_avx2", case, dtype, part);
                HEADROOM * (default + default.max(avx2))
            }
            // oxidiff's kernels may differ from torch's default ones as much as torch's AVX2
            // ones do, and from those again: twice the spread.
            HalfBound::FromCpuSpread => {
                2.0 * HEADROOM * self.recorded("cpu_variation", case, dtype, part)
            }
        }
    }
}

/// How a half run's distance to diffusers' run of the same dtype is bounded.
#[derive(Debug, Clone, Copy)]
pub enum HalfBound {
    /// From diffusers' distance to its own f32 run (the general case).
    FromF32Distance,
    /// From the spread of diffusers' own runs between torch's two kernel sets
    /// (`cpu_variation`): for a run whose distance to f32 is a rounding both implementations
    /// make alike, so that distance says nothing about how far apart they may be.
    FromCpuSpread,
}

pub fn dtype_name(dtype: FloatDType) -> &'static str {
    match dtype {
        FloatDType::BF16 => "bf16",
        FloatDType::F16 => "f16",
        other => panic!("no half-precision golden data for {other:?}"),
    }
}
