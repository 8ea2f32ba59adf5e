//! The CPU kernels in half precision (`cpu::half_gemm`, and bf16/f16 through `cpu::conv`,
//! `cpu::attention`, `cpu::linear`, `cpu::elementwise`) against references computed here in
//! f64 from the same (rounded) inputs, on odd shapes: sizes that are no multiple of the AMX
//! tiles (16 rows, 32 values of k), several column chunks, stride 2, 1x1 and 5x5 kernels.
//!
//! Tolerances:
//! - the products in f32 (`half_gemm`): each element within `k * 2^-23` of the sum of the
//!   magnitudes of its terms (the bound of f32 summation; the bf16 products are exact in f32);
//! - bf16 outputs: `2^-8` of the largest expected magnitude (one rounding to bf16 is at most
//!   `2^-9` of the value, plus the f32 sums); attention `2^-7` (its probabilities are rounded to
//!   bf16 before `p v`, as torch's CPU flash attention does);
//! - f16 outputs (widened to f32 and rounded once): `2^-10`.
//!
//! Which path the tensor kernels take depends on the CPU: `half_gemm` on AMX, else on
//! AVX512-BF16, else the bf16 tensors widened to the f32 kernels. `half_gemm` is tested where
//! the CPU has either; the `bf16_products_*` tests run conv, linear and attention in bf16 on
//! the kernel detected here, with AMX turned off (`OXIDIFF_CPU_AMX=off`: AVX512-BF16 where the
//! CPU has it), and on the widened fallback (`OXIDIFF_CPU_AVX512BF16=off` too), in child
//! processes for the switches.

use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use half::bf16;
use oxidiff_models::cpu::attention::{attention, masked_attention, Masking};
use oxidiff_models::cpu::avx512_bf16;
use oxidiff_models::cpu::conv::{conv2d_with, ConvGeometry, ConvPath};
use oxidiff_models::cpu::elementwise::{geglu, group_norm, layer_norm, transpose};
use oxidiff_models::cpu::half_gemm::{self, gemm, HalfKernel, PackedB};
use oxidiff_models::cpu::linear::linear;
use oxidiff_test_support::reference::attention as attention_f64;

type B = Flex;

/// Deterministic values in `[-amp, amp)` from a 64-bit LCG.
fn values(len: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect()
}

/// A tensor of `dtype` with random values, and those values (after rounding) in f64.
fn tensor<const D: usize>(
    shape: [usize; D],
    seed: u64,
    amp: f32,
    dtype: FloatDType,
) -> (Tensor<B, D>, Vec<f64>) {
    let data = values(shape.iter().product(), seed, amp);
    let t =
        Tensor::<B, D>::from_data(TensorData::new(data, shape), &Default::default()).cast(dtype);
    let rounded = t
        .clone()
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    (t, rounded.into_iter().map(f64::from).collect())
}

fn data<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
}

/// Whether this machine runs `half_gemm` (AMX or AVX512-BF16); elsewhere the bf16 kernels
/// widen to f32 and only the tensor-level tests below apply.
fn has_half_gemm() -> bool {
    match half_gemm::kernel() {
        Some(kernel) => eprintln!("half_gemm runs on {kernel:?} here"),
        None => eprintln!(
            "neither AMX nor AVX512-BF16 here (or both switched off): half_gemm is not used on \
             this CPU, its tests do not apply"
        ),
    }
    half_gemm::available()
}

/// `C = A B` with `b` packed from rows or (`transposed`) from the rows of `B^T`, each element
/// against f64 within the f32 summation bound.
fn check_gemm(m: usize, n: usize, k: usize, transposed: bool) {
    let seed = (m * 10_000 + n * 100 + k) as u64;
    let round = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    // Row strides wider than the rows, so the kernels must honour them.
    let (lda, ldb) = (k + 3, n + 5);
    let a = round(values(m * lda, seed, 1.0));
    let b = round(values(k * ldb, seed + 1, 1.0));
    let packed = if transposed {
        let ldbt = k + 1;
        let mut bt = vec![bf16::ZERO; n * ldbt];
        for kk in 0..k {
            for j in 0..n {
                bt[j * ldbt + kk] = b[kk * ldb + j];
            }
        }
        PackedB::from_transposed(&bt, ldbt, k, n)
    } else {
        PackedB::from_rows(&b, ldb, k, n)
    };
    let c = std::sync::Mutex::new(vec![f32::NAN; m * n]);
    let seen = std::sync::Mutex::new(vec![0u8; m * n]);
    gemm(&a, lda, m, &packed, |block| {
        let (mut c, mut seen) = (c.lock().unwrap(), seen.lock().unwrap());
        for i in 0..block.rows {
            for (j, v) in block.row(i).iter().enumerate() {
                let at = (block.row0 + i) * n + block.col0 + j;
                c[at] = *v;
                seen[at] += 1;
            }
        }
    });
    let (c, seen) = (c.into_inner().unwrap(), seen.into_inner().unwrap());
    assert!(
        seen.iter().all(|&s| s == 1),
        "{m}x{n}x{k}: every element of C exactly once"
    );
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
            for kk in 0..k {
                let p = a[i * lda + kk].to_f64() * b[kk * ldb + j].to_f64();
                exact += p;
                magnitude += p.abs();
            }
            let got = c[i * n + j];
            let bound = k as f64 * f64::from(f32::EPSILON) * magnitude + 1e-30;
            assert!(
                got.is_finite() && (f64::from(got) - exact).abs() <= bound,
                "{m}x{n}x{k} (transposed {transposed}) at ({i}, {j}): {got} against {exact} (bound {bound:e})"
            );
        }
    }
}

#[test]
fn half_gemm_matches_f64_on_odd_shapes() {
    if !has_half_gemm() {
        return;
    }
    for &(m, n, k) in &[
        (1, 1, 1),
        (33, 17, 5),
        (31, 45, 67),
        (64, 64, 64),
        (100, 70, 130),
        (7, 300, 33),
        (40, 600, 96),
        // k over several of AMX's 512-value slices, the last one partial.
        (35, 70, 1100),
        (33, 290, 2880),
        // Whole tiles (m and k multiples of 32), which AMX reads in place: strided rows, k
        // over two slices.
        (96, 40, 1024),
    ] {
        check_gemm(m, n, k, false);
        check_gemm(m, n, k, true);
    }
}

#[test]
fn half_gemm_of_nothing_calls_no_epilogue() {
    if !has_half_gemm() {
        return;
    }
    let b = vec![bf16::ONE; 12];
    let packed = PackedB::from_rows(&b, 4, 3, 4);
    gemm(&[], 3, 0, &packed, |_| panic!("no rows, no blocks"));
}

/// Convolution of rounded inputs in f64.
#[allow(clippy::too_many_arguments)]
fn conv_ref(
    x: &[f64],
    [n, c_in, h, w]: [usize; 4],
    weight: &[f64],
    bias: &[f64],
    c_out: usize,
    k: usize,
    s: usize,
    p: usize,
) -> Vec<f64> {
    let h_out = (h + 2 * p - k) / s + 1;
    let w_out = (w + 2 * p - k) / s + 1;
    let mut out = vec![0.0; n * c_out * h_out * w_out];
    for b in 0..n {
        for co in 0..c_out {
            for oy in 0..h_out {
                for ox in 0..w_out {
                    let mut acc = bias[co];
                    for ci in 0..c_in {
                        for ky in 0..k {
                            for kx in 0..k {
                                let iy = (oy * s + ky) as isize - p as isize;
                                let ix = (ox * s + kx) as isize - p as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                acc += x[((b * c_in + ci) * h + iy as usize) * w + ix as usize]
                                    * weight[((co * c_in + ci) * k + ky) * k + kx];
                            }
                        }
                    }
                    out[((b * c_out + co) * h_out + oy) * w_out + ox] = acc;
                }
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn check_conv(
    dtype: FloatDType,
    dims: [usize; 4],
    c_out: usize,
    k: usize,
    s: usize,
    p: usize,
    tol: f64,
) {
    check_conv_on(ConvPath::Winograd, dtype, dims, c_out, k, s, p, tol);
}

/// The bound of a bf16 convolution on the Winograd path (3x3, stride 1, padding 1, at least
/// 512 positions for two samples) relative to a direct one's: its transformed weights and
/// tiles are rounded to bf16, one rounding each that the direct product's inputs do not take,
/// so its error reaches about one bf16 rounding of the output's scale.
const WINOGRAD_BF16_FACTOR: f64 = 2.0;

#[allow(clippy::too_many_arguments)]
fn check_conv_on(
    path: ConvPath,
    dtype: FloatDType,
    dims: [usize; 4],
    c_out: usize,
    k: usize,
    s: usize,
    p: usize,
    tol: f64,
) {
    let seed = dims.iter().sum::<usize>() as u64 * 31 + (c_out * 7 + k * 3 + s + p) as u64;
    let (x, xv) = tensor(dims, seed, 1.0, dtype);
    let (weight, wv) = tensor([c_out, dims[1], k, k], seed + 1, 0.5, dtype);
    let (bias, bv) = tensor([c_out], seed + 2, 1.0, dtype);
    let geometry = ConvGeometry {
        stride: s,
        padding: p,
    };
    let got = conv2d_with(x, weight, Some(bias), geometry, path)
        .unwrap_or_else(|_| panic!("{dtype:?} takes the CPU kernel"));
    let expected = conv_ref(&xv, dims, &wv, &bv, c_out, k, s, p);
    oxidiff_test_support::assert_close(
        &format!("{dtype:?} conv {dims:?} -> {c_out} k{k} s{s} p{p} ({path:?})"),
        &data(got),
        &expected,
        tol,
    );
}

#[test]
fn bf16_and_f16_convolutions_match_f64() {
    for (dtype, tol) in [
        (FloatDType::BF16, 2f64.powi(-8)),
        (FloatDType::F16, 2f64.powi(-10)),
    ] {
        check_conv(dtype, [1, 3, 9, 11], 7, 3, 1, 1, tol);
        check_conv(dtype, [2, 5, 13, 10], 33, 3, 2, 1, tol);
        check_conv(dtype, [2, 40, 7, 9], 17, 1, 1, 0, tol);
        check_conv(dtype, [1, 6, 12, 12], 5, 5, 1, 2, tol);
        // More output positions than one tile (512), k = 288 (a multiple of 32), 64 channels;
        // large enough for Winograd, so both paths.
        check_conv_on(ConvPath::Im2col, dtype, [1, 32, 30, 30], 64, 3, 1, 1, tol);
        let winograd_tol = if dtype == FloatDType::BF16 {
            WINOGRAD_BF16_FACTOR * tol
        } else {
            tol
        };
        check_conv(dtype, [1, 32, 30, 30], 64, 3, 1, 1, winograd_tol);
    }
}

#[test]
fn bf16_and_f16_attention_match_f64() {
    for (dtype, tol) in [
        (FloatDType::BF16, 2f64.powi(-7)),
        (FloatDType::F16, 2f64.powi(-10)),
    ] {
        // Head sizes 40 and 8 (no multiple of 32), queries across several blocks of 64,
        // cross-attention with 77 keys.
        for shape in [
            [2, 70, 70, 2, 40],
            [1, 77, 77, 3, 8],
            [1, 130, 77, 3, 8],
            [1, 5, 300, 1, 64],
            // Causal over several blocks of queries (64 each), one block of keys (256).
            [1, 200, 200, 2, 40],
            // Several blocks of keys, causal too: AMX's key-blocked kernel takes over 2048 keys.
            [1, 2100, 2100, 1, 8],
        ] {
            let [b, s_q, s_kv, heads, d] = shape;
            let seed = shape.iter().sum::<usize>() as u64;
            let (q, qv) = tensor([b, s_q, heads * d], seed, 2.0, dtype);
            let (k, kv) = tensor([b, s_kv, heads * d], seed + 1, 2.0, dtype);
            let (v, vv) = tensor([b, s_kv, heads * d], seed + 2, 1.0, dtype);
            let got = attention(q.clone(), k.clone(), v.clone(), heads)
                .unwrap_or_else(|_| panic!("{dtype:?} takes the CPU kernel"));
            oxidiff_test_support::assert_close(
                &format!("{dtype:?} attention {shape:?}"),
                &data(got),
                &attention_f64(&qv, &kv, &vv, shape, false),
                tol,
            );
            if s_q == s_kv {
                let got = masked_attention(q, k, v, heads, Masking::Causal)
                    .unwrap_or_else(|_| panic!("{dtype:?} causal takes the CPU kernel"));
                oxidiff_test_support::assert_close(
                    &format!("{dtype:?} causal attention {shape:?}"),
                    &data(got),
                    &attention_f64(&qv, &kv, &vv, shape, true),
                    tol,
                );
            }
        }
    }
}

#[test]
fn bf16_linear_matches_f64_and_follows_a_changed_weight() {
    let (d_in, d_out) = (70, 45);
    let (x, xv) = tensor([2, 9, d_in], 1, 1.0, FloatDType::BF16);
    let (weight, wv) = tensor([d_in, d_out], 2, 0.5, FloatDType::BF16);
    let (bias, bv) = tensor([d_out], 3, 1.0, FloatDType::BF16);
    let reference = |wv: &[f64]| -> Vec<f64> {
        (0..18)
            .flat_map(|r| {
                let row = &xv[r * d_in..(r + 1) * d_in];
                (0..d_out)
                    .map(|j| bv[j] + (0..d_in).map(|i| row[i] * wv[i * d_out + j]).sum::<f64>())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let Ok(got) = linear(x.clone(), weight.clone(), Some(bias.clone())) else {
        // Without half_gemm, bf16 products are Burn's (its matmul widens to f32).
        assert!(!half_gemm::available(), "half_gemm takes bf16 linears");
        return;
    };
    let tol = 2f64.powi(-8);
    oxidiff_test_support::assert_close("bf16 linear", &data(got), &reference(&wv), tol);
    // A second call reads the packed weight from the cache: the same values.
    let again = linear(x.clone(), weight.clone(), Some(bias.clone()))
        .ok()
        .unwrap();
    oxidiff_test_support::assert_close("bf16 linear, cached", &data(again), &reference(&wv), tol);
    // A weight changed in place (the one owner adds to it, as a fused LoRA does) must not
    // meet the old packing.
    let changed = weight + 0.25;
    let changed_v: Vec<f64> = wv
        .iter()
        .map(|w| f64::from(bf16::from_f64(w + 0.25).to_f32()))
        .collect();
    let got = linear(x, changed, Some(bias)).ok().unwrap();
    oxidiff_test_support::assert_close(
        "bf16 linear, changed weight",
        &data(got),
        &reference(&changed_v),
        tol,
    );
}

/// Winograd's transformed weights are kept while the weight lives: a second call gives the
/// same values, and a weight changed in place (its one owner adds to it, as a fused LoRA does)
/// is transformed again; in bf16 and in f32 (there within 2e-6 of f64).
#[test]
fn winograd_weights_are_cached_and_follow_a_changed_weight() {
    let (dims, c_out) = ([2, 6, 17, 16], 9);
    for (dtype, tol) in [
        (FloatDType::BF16, WINOGRAD_BF16_FACTOR * 2f64.powi(-8)),
        (FloatDType::F32, 2e-6),
    ] {
        let (x, xv) = tensor(dims, 21, 1.0, dtype);
        let (weight, wv) = tensor([c_out, dims[1], 3, 3], 22, 0.5, dtype);
        let (bias, bv) = tensor([c_out], 23, 1.0, dtype);
        let geometry = ConvGeometry {
            stride: 1,
            padding: 1,
        };
        let conv = |weight: Tensor<B, 4>| {
            conv2d_with(
                x.clone(),
                weight,
                Some(bias.clone()),
                geometry,
                ConvPath::Winograd,
            )
            .unwrap_or_else(|_| panic!("{dtype:?} takes the CPU kernel"))
        };
        let expected = conv_ref(&xv, dims, &wv, &bv, c_out, 3, 1, 1);
        for call in ["first", "cached"] {
            oxidiff_test_support::assert_close(
                &format!("{dtype:?} winograd, {call}"),
                &data(conv(weight.clone())),
                &expected,
                tol,
            );
        }
        let changed = weight + 0.25;
        let changed_v: Vec<f64> = data(changed.clone()).iter().map(|&v| v as f64).collect();
        assert!(changed_v
            .iter()
            .zip(&wv)
            .all(|(c, w)| (c - w - 0.25).abs() < 0.01));
        oxidiff_test_support::assert_close(
            &format!("{dtype:?} winograd, changed weight"),
            &data(conv(changed)),
            &conv_ref(&xv, dims, &changed_v, &bv, c_out, 3, 1, 1),
            tol,
        );
    }
}

#[test]
fn bf16_and_f16_norms_geglu_and_transpose_match_f64() {
    for (dtype, tol) in [
        (FloatDType::BF16, 2f64.powi(-8)),
        (FloatDType::F16, 2f64.powi(-10)),
    ] {
        // Group norm over [2, 6, 35] in 3 groups, with SiLU.
        let (x, xv) = tensor([2, 6, 35], 11, 2.0, dtype);
        let (w, wv) = tensor([6], 12, 1.0, dtype);
        let (b, bv) = tensor([6], 13, 1.0, dtype);
        let got = group_norm(x, &w, &b, 3, 1e-5, true)
            .unwrap_or_else(|_| panic!("{dtype:?} group norm takes the CPU kernel"));
        let mut expected = vec![0.0; xv.len()];
        for n in 0..2 {
            for g in 0..3 {
                let start = (n * 6 + g * 2) * 35;
                let group = &xv[start..start + 70];
                let mean = group.iter().sum::<f64>() / 70.0;
                let var = group.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 70.0;
                for (i, v) in group.iter().enumerate() {
                    let ch = g * 2 + i / 35;
                    let y = (v - mean) / (var + 1e-5).sqrt() * wv[ch] + bv[ch];
                    expected[start + i] = y / (1.0 + (-y).exp());
                }
            }
        }
        oxidiff_test_support::assert_close(
            &format!("{dtype:?} group norm"),
            &data(got),
            &expected,
            tol,
        );

        // Layer norm over rows of 37, without affine.
        let (x, xv) = tensor([3, 5, 37], 14, 3.0, dtype);
        let got = layer_norm(x, None, 1e-6).unwrap_or_else(|_| panic!("{dtype:?} layer norm"));
        let expected: Vec<f64> = xv
            .chunks(37)
            .flat_map(|row| {
                let mean = row.iter().sum::<f64>() / 37.0;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 37.0;
                row.iter().map(move |v| (v - mean) / (var + 1e-6).sqrt())
            })
            .collect();
        oxidiff_test_support::assert_close(
            &format!("{dtype:?} layer norm"),
            &data(got),
            &expected,
            tol,
        );

        // GEGLU over rows of 2 x 21.
        let (x, xv) = tensor([2, 3, 42], 15, 2.0, dtype);
        let got = geglu(x).unwrap_or_else(|_| panic!("{dtype:?} geglu"));
        let expected: Vec<f64> = xv
            .chunks(42)
            .flat_map(|row| {
                let (value, gate) = row.split_at(21);
                value
                    .iter()
                    .zip(gate)
                    .map(|(v, g)| v * 0.5 * g * (1.0 + libm::erf(g / std::f64::consts::SQRT_2)))
                    .collect::<Vec<_>>()
            })
            .collect();
        oxidiff_test_support::assert_close(&format!("{dtype:?} geglu"), &data(got), &expected, tol);

        // Transposes are exact.
        let (x, xv) = tensor([2, 33, 35], 16, 1.0, dtype);
        let got = transpose(x).unwrap_or_else(|_| panic!("{dtype:?} transpose"));
        let expected: Vec<f64> = (0..2)
            .flat_map(|n| {
                let xv = &xv;
                (0..35).flat_map(move |j| (0..33).map(move |i| xv[(n * 33 + i) * 35 + j]))
            })
            .collect();
        oxidiff_test_support::assert_close(
            &format!("{dtype:?} transpose"),
            &data(got),
            &expected,
            0.0,
        );
    }
}

#[test]
fn bf16_rounding_equals_the_half_crate() {
    use oxidiff_models::cpu::common::round_bf16;
    // Every 65521st bit pattern (all exponents, signs and mantissas, ties included by the
    // specials below), infinities, NaNs, subnormals and the largest finite values.
    let specials = [
        0x0000_0000u32,
        0x8000_0000,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xffff_ffff,
        0x0000_8000,
        0x0001_8000,
        0x3f80_8000,
        0x3f81_8000,
        0x7f7f_ffff,
        0x7f7f_8000,
        0x0000_0001,
        0x807f_ffff,
    ];
    for bits in (0..=u32::MAX).step_by(65521).chain(specials) {
        let x = f32::from_bits(bits);
        let (got, want) = (round_bf16(x), bf16::from_f32(x));
        if x.is_nan() {
            assert!(got.is_nan(), "{bits:#x}: NaN stays NaN");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#x} ({x:e})");
        }
    }
}

#[test]
fn activations_match_f64_in_f32_bf16_and_f16() {
    use oxidiff_models::nn::Activation;
    let erf_gelu = |x: f64| 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
    let tanh_gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    let cases: [(Activation, &dyn Fn(f64) -> f64); 5] = [
        (Activation::Silu, &|x| x / (1.0 + (-x).exp())),
        (Activation::Gelu, &erf_gelu),
        (Activation::GeluTanh, &tanh_gelu),
        (Activation::QuickGelu, &|x| x / (1.0 + (-1.702 * x).exp())),
        (Activation::Relu, &|x| x.max(0.0)),
    ];
    for (dtype, tol) in [
        (FloatDType::F32, 2e-6),
        (FloatDType::BF16, 2f64.powi(-8)),
        (FloatDType::F16, 2f64.powi(-10)),
    ] {
        for (act, reference) in &cases {
            // Values to +-12 (the exponentials' tails), a shape that is no multiple of anything.
            let (x, xv) = tensor([3, 7, 41], 21, 12.0, dtype);
            let expected: Vec<f64> = xv.iter().map(|&v| reference(v)).collect();
            // A shared input is read, not overwritten; one held by nobody else is mapped in place.
            let shared = act.forward(x.clone());
            assert_eq!(
                data(x.clone()),
                xv.iter().map(|&v| v as f32).collect::<Vec<_>>()
            );
            let got = act.forward(x);
            assert_eq!(got.dtype(), dtype.into(), "{act:?} keeps the dtype");
            for (how, got) in [("shared", shared), ("owned", got)] {
                oxidiff_test_support::assert_close(
                    &format!("{act:?} {dtype:?} ({how})"),
                    &data(got),
                    &expected,
                    tol,
                );
            }
        }
    }
}

/// `linear` in bf16 against f64, `x` `[rows, d_in]`, the weight either in the checkpoint's
/// layout (a transposed view of `[d_out, d_in]`, the product computed transposed) or
/// contiguous `[d_in, d_out]`; where `linear` hands its inputs back, Burn's own matmul is
/// checked instead.
fn check_linear(rows: usize, d_in: usize, d_out: usize, checkpoint_layout: bool) {
    let seed = (rows * 1000 + d_in * 10 + d_out) as u64;
    let (x, xv) = tensor([rows, d_in], seed, 1.0, FloatDType::BF16);
    let (weight, wv) = if checkpoint_layout {
        let (w, wv) = tensor([d_out, d_in], seed + 1, 0.5, FloatDType::BF16);
        let transposed = (0..d_in * d_out)
            .map(|at| wv[(at % d_out) * d_in + at / d_out])
            .collect::<Vec<_>>();
        (w.transpose(), transposed)
    } else {
        tensor([d_in, d_out], seed + 1, 0.5, FloatDType::BF16)
    };
    let (bias, bv) = tensor([d_out], seed + 2, 1.0, FloatDType::BF16);
    let expected: Vec<f64> = (0..rows * d_out)
        .map(|at| {
            let (r, j) = (at / d_out, at % d_out);
            bv[j]
                + (0..d_in)
                    .map(|i| xv[r * d_in + i] * wv[i * d_out + j])
                    .sum::<f64>()
        })
        .collect();
    // One rounding to bf16 on half_gemm; Burn's path rounds the product, then the sum with the
    // bias: twice the tolerance.
    let (got, tol) = match linear(x, weight, Some(bias)) {
        Ok(got) => {
            assert!(
                half_gemm::available(),
                "linear takes bf16 only on half_gemm"
            );
            (got, 2f64.powi(-8))
        }
        Err((x, weight, bias)) => {
            assert!(!half_gemm::available(), "half_gemm takes bf16 linears");
            (
                x.matmul(weight) + bias.unwrap().unsqueeze::<2>(),
                2f64.powi(-7),
            )
        }
    };
    oxidiff_test_support::assert_close(
        &format!("bf16 linear {rows}x{d_in} -> {d_out} (checkpoint layout {checkpoint_layout})"),
        &data(got),
        &expected,
        tol,
    );
}

/// Conv, linear and attention in bf16 against f64 on odd shapes (no multiple of 16 or 32,
/// odd k, several column chunks of 256), on `expected`, the kernel the switches leave.
fn check_bf16_products(expected: Option<HalfKernel>) {
    assert_eq!(
        half_gemm::kernel(),
        expected,
        "the kernel these switches leave"
    );
    eprintln!("bf16 products on {expected:?} (None: widened to f32)");
    if expected.is_some() {
        check_gemm(45, 300, 77, false);
        check_gemm(70, 530, 33, true);
    }
    let tol = 2f64.powi(-8);
    // k = 5 * 9 = 45 (odd), 300 positions over two column chunks, 19 output channels (on
    // im2col: a plane this large takes Winograd, below).
    check_conv_on(
        ConvPath::Im2col,
        FloatDType::BF16,
        [1, 5, 15, 20],
        19,
        3,
        1,
        1,
        tol,
    );
    // 1x1: k = 37, 720 positions.
    check_conv(FloatDType::BF16, [1, 37, 24, 30], 50, 1, 1, 0, tol);
    // Stride 2, 2 samples.
    check_conv(FloatDType::BF16, [2, 7, 21, 19], 33, 3, 2, 1, tol);
    // Small planes: every sample's columns in one product, a block of columns spanning
    // samples (3 x 35 positions), 3x3 and 1x1.
    check_conv(FloatDType::BF16, [3, 9, 5, 7], 21, 3, 1, 1, tol);
    check_conv(FloatDType::BF16, [2, 13, 4, 4], 40, 1, 1, 0, tol);
    // Winograd: odd channels in (7, 5) and out (35, 19), odd sides (odd tiles at the right and
    // bottom edges), three chunks of tile rows of which the last is partial, two samples.
    let winograd_tol = WINOGRAD_BF16_FACTOR * tol;
    check_conv(FloatDType::BF16, [1, 7, 47, 45], 35, 3, 1, 1, winograd_tol);
    check_conv(FloatDType::BF16, [2, 5, 23, 25], 19, 3, 1, 1, winograd_tol);
    for checkpoint_layout in [false, true] {
        check_linear(37, 77, 300, checkpoint_layout);
        check_linear(290, 45, 33, checkpoint_layout);
    }
    // Odd head sizes (k of `q k^T`), odd key counts (k of `p v`) over two column chunks.
    for shape in [[1, 67, 301, 2, 13], [2, 33, 77, 3, 40], [1, 300, 300, 1, 9]] {
        let [b, s_q, s_kv, heads, d] = shape;
        let seed = shape.iter().product::<usize>() as u64;
        let (q, qv) = tensor([b, s_q, heads * d], seed, 2.0, FloatDType::BF16);
        let (k, kv) = tensor([b, s_kv, heads * d], seed + 1, 2.0, FloatDType::BF16);
        let (v, vv) = tensor([b, s_kv, heads * d], seed + 2, 1.0, FloatDType::BF16);
        let got = attention(q, k, v, heads).unwrap_or_else(|_| panic!("bf16 attention"));
        oxidiff_test_support::assert_close(
            &format!("bf16 attention {shape:?}"),
            &data(got),
            &attention_f64(&qv, &kv, &vv, shape, false),
            2f64.powi(-7),
        );
    }
}

#[test]
fn bf16_products_match_f64_on_the_detected_kernel() {
    check_bf16_products(half_gemm::kernel());
}

#[test]
fn bf16_products_match_f64_with_amx_switched_off() {
    if oxidiff_test_support::isolated(
        "bf16_products_match_f64_with_amx_switched_off",
        &[("OXIDIFF_CPU_AMX", "off")],
    ) {
        // AVX512-BF16 where the CPU has it (and its own switch leaves it on), else none.
        check_bf16_products(avx512_bf16::available().then_some(HalfKernel::Avx512Bf16));
    }
}

#[test]
fn bf16_products_match_f64_on_the_widened_fallback() {
    if oxidiff_test_support::isolated(
        "bf16_products_match_f64_on_the_widened_fallback",
        &[
            ("OXIDIFF_CPU_AMX", "off"),
            ("OXIDIFF_CPU_AVX512BF16", "off"),
        ],
    ) {
        check_bf16_products(None);
    }
}

#[test]
fn bf16_products_match_f64_at_the_baseline_vector_width() {
    // The products keep their kernel; the softmax and the rounding around them take the
    // portable arithmetic instead of AVX512-BF16's instructions.
    if oxidiff_test_support::isolated(
        "bf16_products_match_f64_at_the_baseline_vector_width",
        &[("OXIDIFF_CPU_SIMD", "baseline")],
    ) {
        check_bf16_products(half_gemm::kernel());
    }
}

/// A sample's bf16 convolution is bit for bit the same alone as in a batch of 2, 3 or 4, for
/// planes small enough that the batch's columns go into one product and for larger ones.
#[test]
fn bf16_convolutions_give_a_sample_the_same_values_in_any_batch() {
    // (channels in, out, side, kernel, stride, padding)
    for (c_in, c_out, side, k, s, p) in [
        (24, 40, 4, 3, 1, 1),
        (24, 40, 8, 1, 1, 0),
        (7, 9, 5, 3, 2, 1),
        (8, 16, 24, 3, 1, 1),
    ] {
        let (x, _) = tensor(
            [4, c_in, side, side],
            40 + side as u64,
            1.0,
            FloatDType::BF16,
        );
        let (weight, _) = tensor([c_out, c_in, k, k], 41, 0.5, FloatDType::BF16);
        let (bias, _) = tensor([c_out], 42, 1.0, FloatDType::BF16);
        let geometry = ConvGeometry {
            stride: s,
            padding: p,
        };
        let run = |n: usize| {
            let out = conv2d_with(
                x.clone().narrow(0, 0, n),
                weight.clone(),
                Some(bias.clone()),
                geometry,
                ConvPath::Winograd,
            )
            .unwrap_or_else(|_| panic!("bf16 takes the CPU kernel"));
            data(out.narrow(0, n - 1, 1))
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        for n in [2, 3, 4] {
            // The batch's last sample, against that sample alone.
            let alone = {
                let out = conv2d_with(
                    x.clone().narrow(0, n - 1, 1),
                    weight.clone(),
                    Some(bias.clone()),
                    geometry,
                    ConvPath::Winograd,
                )
                .unwrap_or_else(|_| panic!("bf16 takes the CPU kernel"));
                data(out).iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            assert!(
                run(n) == alone,
                "{c_in}->{c_out} {k}x{k}/{s} on {side}x{side}: sample {} of a batch of {n} \
                 differs from it alone",
                n - 1
            );
        }
    }
}
