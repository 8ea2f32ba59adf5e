//! Where stochastic schedulers (and pipelines) get their Gaussian noise.
//!
//! Schedulers never draw noise themselves: `step` takes a [`NoiseSource`], so a pipeline
//! can share one generator between the initial latents and the step noise, and tests can
//! inject noise recorded from diffusers.

use std::collections::VecDeque;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::error::{Result, SchedulerError};

/// A source of standard normal noise.
pub trait NoiseSource<B: Backend> {
    /// A `shape` tensor of independent N(0, 1) samples on `device`.
    fn randn(&mut self, shape: [usize; 4], device: &B::Device) -> Result<Tensor<B, 4>>;
}

/// PyTorch's CPU generator: `torch.Generator().manual_seed(seed)` followed by
/// `torch.randn(shape, generator=g)` (f32), reimplemented on the host.
///
/// The algorithm (ATen `CPUGeneratorImpl`, `normal_fill`, `normal_distribution`):
/// * MT19937 seeded with the low 32 bits of `seed`;
/// * 16 values or more: every value first gets a uniform `(u32 & 0xFFFFFF) / 2^24`; each
///   block of 16 then becomes Box-Muller normals, `r = sqrt(-2 ln(1 - u[j]))`,
///   `theta = 2 pi u[j + 8]`, `out[j] = r cos(theta)`, `out[j + 8] = r sin(theta)`, in f32
///   (see `normal_fill_16`);
///   when the count is not a multiple of 16 the last 16 values are drawn again and redone;
/// * fewer than 16 values: one f64 Box-Muller pair per two values from 53-bit uniforms,
///   the sine half cached in the generator for the next draw.
///
/// Draws therefore match diffusers run on the CPU with the same seed, so initial latents
/// and ancestral/DDIM noise equal diffusers'. The 16-value blocks follow torch's x86-64
/// kernel (avx_mathfun log/sincos with fused multiply-adds), bit for bit; torch builds that
/// use the scalar libm kernel instead (other CPUs) differ by an ulp or two.
#[derive(Clone, Debug)]
pub struct TorchCpuGenerator {
    mt: Mt19937,
    next_double_normal: Option<f64>,
}

impl TorchCpuGenerator {
    /// `torch.Generator().manual_seed(seed)`.
    pub fn new(seed: u64) -> Self {
        Self {
            mt: Mt19937::new(seed as u32),
            next_double_normal: None,
        }
    }

    /// `torch.randn(n, generator=self)` as host f32 values.
    pub fn randn_vec(&mut self, n: usize) -> Vec<f32> {
        if n >= 16 {
            let mut data: Vec<f32> = (0..n).map(|_| self.uniform_f32()).collect();
            let mut i = 0;
            while i + 16 <= n {
                normal_fill_16(&mut data[i..i + 16]);
                i += 16;
            }
            if !n.is_multiple_of(16) {
                let tail = &mut data[n - 16..];
                for v in tail.iter_mut() {
                    *v = self.uniform_f32();
                }
                normal_fill_16(tail);
            }
            data
        } else {
            (0..n).map(|_| self.normal_f64() as f32).collect()
        }
    }

    fn uniform_f32(&mut self) -> f32 {
        (self.mt.next_u32() & 0x00FF_FFFF) as f32 * (1.0 / 16_777_216.0)
    }

    fn uniform_f64(&mut self) -> f64 {
        let hi = self.mt.next_u32() as u64;
        let lo = self.mt.next_u32() as u64;
        (((hi << 32) | lo) & ((1u64 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.next_double_normal.take() {
            return v;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_double_normal = Some(r * theta.sin());
        r * theta.cos()
    }
}

/// Box-Muller on 16 uniforms in place, as ATen's x86-64 `NormalFill16` (AVX2): f32
/// throughout, with avx_mathfun's `log256_ps` and `sincos256_ps` (Cephes polynomials) and
/// the multiply-adds the compiler fuses into FMAs. Reproduces `torch.randn` bit for bit.
fn normal_fill_16(data: &mut [f32]) {
    const TWO_PI: f32 = (2.0 * std::f64::consts::PI) as f32;
    for j in 0..8 {
        let u1 = 1.0f32 - data[j];
        let u2 = data[j + 8];
        let radius = (-2.0f32 * cephes_logf(u1)).sqrt();
        let (sin, cos) = cephes_sincosf(TWO_PI * u2);
        data[j] = radius * cos;
        data[j + 8] = radius * sin;
    }
}

/// avx_mathfun's `log256_ps` for one positive normal f32 (its constants verbatim).
#[allow(clippy::excessive_precision)]
fn cephes_logf(x: f32) -> f32 {
    const P: [f32; 9] = [
        7.0376836292E-2,
        -1.1514610310E-1,
        1.1676998740E-1,
        -1.2420140846E-1,
        1.4249322787E-1,
        -1.6668057665E-1,
        2.0000714765E-1,
        -2.4999993993E-1,
        3.3333331174E-1,
    ];
    let x = x.max(f32::MIN_POSITIVE);
    let bits = x.to_bits();
    let mut e = ((bits >> 23) as i32 - 0x7f) as f32 + 1.0;
    // The mantissa in [0.5, 1).
    let m = f32::from_bits((bits & !0x7f80_0000) | 0x3f00_0000);
    let below = m < std::f32::consts::FRAC_1_SQRT_2;
    let mut x = m - 1.0;
    if below {
        e -= 1.0;
        x += m;
    }
    let z = x * x;
    let mut y = P[0];
    for p in &P[1..] {
        y = y.mul_add(x, *p);
    }
    y *= x;
    y = y.mul_add(z, e * -2.12194440e-4);
    y -= z * 0.5;
    x += y;
    e.mul_add(0.693359375, x)
}

/// avx_mathfun's `sincos256_ps` for one f32 (its constants verbatim): (sin, cos).
#[allow(clippy::excessive_precision)]
fn cephes_sincosf(x: f32) -> (f32, f32) {
    const FOPI: f32 = 1.27323954473516; // 4 / pi
    let sign_in = x < 0.0;
    let x = x.abs();
    let j = (((x * FOPI) as i32) + 1) & !1;
    let y = j as f32;
    let swap = j & 4 != 0;
    let poly_cos_first = j & 2 == 0;
    // x - y * pi/4 in three parts.
    let x = y.mul_add(-0.785_156_25, x);
    let x = y.mul_add(-2.4187564849853515625e-4, x);
    let x = y.mul_add(-3.77489497744594108e-8, x);
    let z = x * x;
    let mut c = 2.443315711809948E-005f32;
    c = c.mul_add(z, -1.388731625493765E-003);
    c = c.mul_add(z, 4.166664568298827E-002);
    c *= z;
    c = c.mul_add(z, -(z * 0.5));
    c += 1.0;
    let mut s = -1.9515295891E-4f32;
    s = s.mul_add(z, 8.3321608736E-3);
    s = s.mul_add(z, -1.6666654611E-1);
    s *= z;
    s = s.mul_add(x, x);
    let (sin, cos) = if poly_cos_first { (s, c) } else { (c, s) };
    let sin = if swap != sign_in { -sin } else { sin };
    let cos = if (j - 2) & 4 == 0 { -cos } else { cos };
    (sin, cos)
}

impl<B: Backend> NoiseSource<B> for TorchCpuGenerator {
    fn randn(&mut self, shape: [usize; 4], device: &B::Device) -> Result<Tensor<B, 4>> {
        let values = self.randn_vec(shape.iter().product());
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }
}

/// The 32-bit Mersenne Twister (`std::mt19937`), as ATen's `at::mt19937`.
#[derive(Clone, Debug)]
struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    fn new(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Self { state, index: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            for i in 0..624 {
                let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7FFF_FFFF);
                let mut v = self.state[(i + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    v ^= 0x9908_B0DF;
                }
                self.state[i] = v;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9D2C_5680;
        y ^= (y << 15) & 0xEFC6_0000;
        y ^ (y >> 18)
    }
}

/// Noise given in advance (recorded from diffusers, or drawn elsewhere), handed out in order.
pub struct RecordedNoise<B: Backend> {
    queue: VecDeque<Tensor<B, 4>>,
}

impl<B: Backend> RecordedNoise<B> {
    pub fn new(noise: impl IntoIterator<Item = Tensor<B, 4>>) -> Self {
        Self {
            queue: noise.into_iter().collect(),
        }
    }

    /// How many tensors are left.
    pub fn remaining(&self) -> usize {
        self.queue.len()
    }
}

impl<B: Backend> NoiseSource<B> for RecordedNoise<B> {
    fn randn(&mut self, shape: [usize; 4], device: &B::Device) -> Result<Tensor<B, 4>> {
        let next = self
            .queue
            .pop_front()
            .ok_or_else(|| SchedulerError::Noise("recorded noise exhausted".into()))?;
        if next.dims() != shape {
            return Err(SchedulerError::Noise(format!(
                "recorded noise has shape {:?} but {shape:?} was requested",
                next.dims()
            )));
        }
        Ok(next.to_device(device))
    }
}

/// For deterministic schedulers: any request for noise is an error.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoNoise;

impl<B: Backend> NoiseSource<B> for NoNoise {
    fn randn(&mut self, _shape: [usize; 4], _device: &B::Device) -> Result<Tensor<B, 4>> {
        Err(SchedulerError::Noise(
            "this scheduler needs noise but was given NoNoise".into(),
        ))
    }
}

/// One [`TorchCpuGenerator`] per batch row, as diffusers' `generator=[g0, g1, ...]`: row `i`
/// of every draw comes from generator `i`, so image `i` of a batch gets the noise it gets
/// alone with that generator's seed (batched and one-by-one runs draw the same values).
#[derive(Clone, Debug)]
pub struct TorchCpuGenerators {
    generators: Vec<TorchCpuGenerator>,
}

impl TorchCpuGenerators {
    /// `torch.Generator().manual_seed(s)` for each seed.
    pub fn new(seeds: &[u64]) -> Self {
        Self {
            generators: seeds.iter().map(|&s| TorchCpuGenerator::new(s)).collect(),
        }
    }
}

impl<B: Backend> NoiseSource<B> for TorchCpuGenerators {
    fn randn(&mut self, shape: [usize; 4], device: &B::Device) -> Result<Tensor<B, 4>> {
        let [rows, c, h, w] = shape;
        if rows != self.generators.len() {
            return Err(SchedulerError::Noise(format!(
                "{} generators for a batch of {rows}: give one generator per image",
                self.generators.len()
            )));
        }
        let mut values = Vec::with_capacity(rows * c * h * w);
        for generator in &mut self.generators {
            values.extend(generator.randn_vec(c * h * w));
        }
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }
}
