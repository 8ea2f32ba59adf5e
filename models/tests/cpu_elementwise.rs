//! `cpu::elementwise`, the burn-flex f32 kernels for group norm (with fused SiLU), layer norm,
//! GEGLU and the sequence transpose, against references computed here in f64 from the same
//! inputs: contiguous, permuted and shared inputs (a shared input must stay unchanged), large
//! offsets, partial tiles; its SiLU, erf and GELU against libm's; and the fallback for what it
//! does not cover.
//!
//! Tolerance: 2e-6 relative to the output's largest magnitude for the norms and the transpose
//! (exact), 1e-6 absolute for erf (the approximation is within 1.5e-7, plus f32 rounding).

use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::cpu::common::exp_nonpositive;
use oxidiff_models::cpu::elementwise::{
    add, add_per_channel, erf, geglu, gelu, gelu_tanh, group_norm, layer_norm, quick_gelu, silu,
    tanh, transpose,
};
use oxidiff_models::cpu::simd::{self, VectorWidth};

type B = Flex;

/// Deterministic values in `offset + [-amp, amp)` from a 64-bit LCG.
fn values(len: usize, seed: u64, amp: f32, offset: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            offset + (((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: u64, amp: f32, offset: f32) -> Tensor<B, D> {
    let data = values(shape.iter().product(), seed, amp, offset);
    Tensor::from_data(TensorData::new(data, shape), &Default::default())
}

fn data<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// Within `tol` of the largest expected magnitude; NaN or infinity on either side fails.
fn assert_close(got: &[f32], expected: &[f64], tol: f64, what: &str) {
    oxidiff_test_support::assert_close_with_floor(what, got, expected, tol, 1e-30);
}

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn gelu64(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

/// Group norm of `x` `[n, c, rest]` in f64, then SiLU if asked.
fn group_norm_ref(
    x: &[f32],
    dims: [usize; 3],
    w: &[f32],
    b: &[f32],
    g: usize,
    silu: bool,
) -> Vec<f64> {
    let [n, c, rest] = dims;
    let per = c / g * rest;
    let mut out = vec![0.0f64; x.len()];
    for s in 0..n {
        for grp in 0..g {
            let start = (s * c + grp * (c / g)) * rest;
            let block = &x[start..start + per];
            let mean = block.iter().map(|&v| v as f64).sum::<f64>() / per as f64;
            let var = block
                .iter()
                .map(|&v| (v as f64 - mean).powi(2))
                .sum::<f64>()
                / per as f64;
            for i in 0..per {
                let ch = grp * (c / g) + i / rest;
                let y = (x[start + i] as f64 - mean) / (var + 1e-6).sqrt() * w[ch] as f64
                    + b[ch] as f64;
                out[start + i] = if silu { silu64(y) } else { y };
            }
        }
    }
    out
}

#[test]
fn group_norm_matches_f64_with_and_without_silu() {
    for (dims, g, offset) in [
        ([2, 64, 64], 32, 0.0),
        ([1, 6, 35], 3, 0.0),
        ([3, 32, 1024], 32, 50.0),
    ] {
        let [n, c, rest] = dims;
        let x = tensor([n, c, rest], (c + rest) as u64, 2.0, offset);
        let w = tensor([c], 1, 1.0, 1.0);
        let b = tensor([c], 2, 0.5, 0.0);
        let (xv, wv, bv) = (data(x.clone()), data(w.clone()), data(b.clone()));
        for fuse in [false, true] {
            let out = group_norm(x.clone(), &w, &b, g, 1e-6, fuse).expect("flex f32 applies");
            assert_eq!(out.dims(), [n, c, rest]);
            let expected = group_norm_ref(&xv, dims, &wv, &bv, g, fuse);
            assert_close(
                &data(out),
                &expected,
                2e-6,
                &format!("group norm {dims:?} silu {fuse}"),
            );
        }
        // x was shared (cloned above): it must be unchanged.
        assert_eq!(data(x), xv, "the input of group norm was overwritten");
    }
}

#[test]
fn group_norm_of_a_4d_permuted_input() {
    // [1, 8, 4, 6] built as a permuted view of [1, 4, 6, 8].
    let base = tensor([1, 4, 6, 8], 9, 1.0, 0.3);
    let x = base.permute([0, 3, 1, 2]);
    let contiguous: Vec<f32> = data(x.clone());
    let w = tensor([8], 3, 1.0, 1.0);
    let b = tensor([8], 4, 0.5, 0.0);
    let expected = group_norm_ref(
        &contiguous,
        [1, 8, 24],
        &data(w.clone()),
        &data(b.clone()),
        4,
        true,
    );
    let out = group_norm(x, &w, &b, 4, 1e-6, true).unwrap();
    assert_eq!(out.dims(), [1, 8, 4, 6]);
    assert_close(&data(out), &expected, 2e-6, "group norm of a permuted view");
}

#[test]
fn layer_norm_matches_f64_affine_and_plain() {
    for (rows, width, offset) in [(2048, 320, 0.0), (7, 33, 100.0), (1, 1280, 0.0)] {
        let x = tensor([1, rows, width], (rows + width) as u64, 3.0, offset);
        let xv = data(x.clone());
        let w = tensor([width], 5, 1.0, 1.0);
        let b = tensor([width], 6, 0.5, 0.0);
        let (wv, bv) = (data(w.clone()), data(b.clone()));
        for affine in [true, false] {
            let mut expected = vec![0.0f64; xv.len()];
            for r in 0..rows {
                let row = &xv[r * width..(r + 1) * width];
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                let var =
                    row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                for i in 0..width {
                    let y = (row[i] as f64 - mean) / (var + 1e-5).sqrt();
                    expected[r * width + i] = if affine {
                        y * wv[i] as f64 + bv[i] as f64
                    } else {
                        y
                    };
                }
            }
            let params = affine.then_some((&w, &b));
            let out = layer_norm(x.clone(), params, 1e-5).unwrap();
            assert_close(
                &data(out),
                &expected,
                2e-6,
                &format!("layer norm {rows}x{width} affine {affine}"),
            );
        }
        assert_eq!(data(x), xv, "the input of layer norm was overwritten");
    }
}

#[test]
fn layer_norm_of_a_transposed_view() {
    let base = tensor([2, 40, 24], 11, 1.0, 0.0);
    let x = base.swap_dims(1, 2); // [2, 24, 40], not contiguous
    let xv = data(x.clone());
    let mut expected = vec![0.0f64; xv.len()];
    for (r, row) in xv.chunks(40).enumerate() {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / 40.0;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 40.0;
        for (i, v) in row.iter().enumerate() {
            expected[r * 40 + i] = (*v as f64 - mean) / (var + 1e-6).sqrt();
        }
    }
    let out = layer_norm(x, None, 1e-6).unwrap();
    assert_close(
        &data(out),
        &expected,
        2e-6,
        "layer norm of a transposed view",
    );
}

#[test]
fn geglu_matches_f64() {
    for (rows, inner) in [(2048, 1280), (5, 3)] {
        let x = tensor([1, rows, 2 * inner], rows as u64, 4.0, 0.0);
        let xv = data(x.clone());
        let mut expected = Vec::with_capacity(rows * inner);
        for row in xv.chunks(2 * inner) {
            for i in 0..inner {
                expected.push(row[i] as f64 * gelu64(row[inner + i] as f64));
            }
        }
        let out = geglu(x).unwrap();
        assert_eq!(out.dims(), [1, rows, inner]);
        assert_close(
            &data(out),
            &expected,
            2e-6,
            &format!("geglu {rows}x{inner}"),
        );
    }
}

#[test]
fn transpose_is_exact_for_partial_tiles() {
    for [b, m, n] in [[2, 320, 1024], [3, 33, 70], [1, 1, 5], [2, 64, 1]] {
        let x = tensor([b, m, n], (m * n) as u64, 1.0, 0.0);
        let expected = data(x.clone().swap_dims(1, 2));
        let out = transpose(x).unwrap();
        assert_eq!(out.dims(), [b, n, m]);
        assert_eq!(data(out), expected, "transpose of [{b}, {m}, {n}]");
    }
    // A view in, too.
    let view = tensor([2, 10, 12], 1, 1.0, 0.0).swap_dims(1, 2);
    let expected = data(view.clone().swap_dims(1, 2));
    assert_eq!(data(transpose(view).unwrap()), expected);
}

#[test]
fn scalar_functions_match_libm() {
    let mut worst = [0.0f64; 3];
    for i in -200_000..=200_000 {
        let x = i as f32 * 1e-4; // [-20, 20]
                                 // `f64::max` would skip a NaN.
        assert!(
            erf(x).is_finite() && silu(x).is_finite() && gelu(x).is_finite(),
            "non-finite at {x}: erf {}, silu {}, gelu {}",
            erf(x),
            silu(x),
            gelu(x)
        );
        let e = (erf(x) as f64 - libm::erf(x as f64)).abs();
        worst[0] = worst[0].max(e);
        let s = silu64(x as f64);
        worst[1] = worst[1].max((silu(x) as f64 - s).abs() / s.abs().max(1e-3));
        let g = gelu64(x as f64);
        worst[2] = worst[2].max((gelu(x) as f64 - g).abs() / g.abs().max(1.0));
    }
    assert!(worst[0] < 1e-6, "erf off by {:e}", worst[0]);
    assert!(worst[1] < 1e-6, "silu off by {:e} relative", worst[1]);
    assert!(worst[2] < 1e-6, "gelu off by {:e}", worst[2]);
}

/// The scalar functions the kernels vectorize give the same bits at every vector width this
/// CPU runs (`simd::vectorized_for`), on values across their ranges and at the edges
/// (`exp_nonpositive` below -87 and at 0, huge inputs, infinities, NaN).
#[test]
fn every_vector_width_gives_the_same_bits() {
    let mut xs = values(100_003, 9, 30.0, 0.0);
    xs.extend([
        0.0,
        -0.0,
        -87.0,
        -87.5,
        -100.0,
        1e30,
        -1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    let run = |width: VectorWidth| {
        simd::vectorized_for(
            width,
            #[inline(always)]
            || {
                xs.iter()
                    .map(|&x| {
                        [
                            exp_nonpositive(-x.abs()),
                            silu(x),
                            gelu(x),
                            erf(x),
                            tanh(x),
                            gelu_tanh(x),
                            quick_gelu(x),
                        ]
                        .map(f32::to_bits)
                    })
                    .collect::<Vec<_>>()
            },
        )
    };
    let baseline = run(VectorWidth::Baseline);
    eprintln!("widths up to {:?}", simd::width());
    for width in [VectorWidth::Avx2, VectorWidth::Avx512] {
        if width <= simd::width() {
            let got = run(width);
            let differ = got.iter().zip(&baseline).position(|(a, b)| a != b);
            assert!(
                differ.is_none(),
                "{width:?} differs from the baseline at x = {}",
                xs[differ.unwrap()]
            );
        }
    }
}

/// `exp_nonpositive` builds `2^n` from the rounding constant's bits: the same value as from
/// `n` converted to an integer, over the whole input range.
#[test]
fn exp_nonpositive_scale_equals_the_integer_construction() {
    for i in 0..=870_000 {
        let x = -(i as f32) * 1e-4;
        let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
        let by_int = f32::from_bits(((n as i32 + 127) as u32) << 23);
        let by_bits = f32::from_bits(
            (x * std::f32::consts::LOG2_E + 12_582_912.0)
                .to_bits()
                .wrapping_add(127)
                << 23,
        );
        assert_eq!(by_int.to_bits(), by_bits.to_bits(), "2^n at x = {x}");
    }
}

/// `add` and `add_per_channel` give Burn's sums bit for bit in f32, bf16 and f16, whether
/// their inputs are shared (left unchanged) or not; other shapes are handed back.
#[test]
fn adds_equal_burns_bit_for_bit() {
    for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
        let a = tensor([2, 3, 7, 5], 11, 3.0, 0.5).cast(dtype);
        let b = tensor([2, 3, 7, 5], 12, 3.0, -0.5).cast(dtype);
        let t = tensor([2, 3], 13, 2.0, 0.0).cast(dtype);
        let expected = bits(a.clone() + b.clone());
        let (a_before, b_before) = (bits(a.clone()), bits(b.clone()));
        // Both shared: a new buffer, neither input changed.
        let shared = add(a.clone(), b.clone()).ok().unwrap();
        assert_eq!(bits(shared), expected, "{dtype:?} add of shared inputs");
        assert_eq!(
            bits(a.clone()),
            a_before,
            "{dtype:?}: a shared input changed"
        );
        assert_eq!(
            bits(b.clone()),
            b_before,
            "{dtype:?}: a shared input changed"
        );
        // Only the second one unique: written into it.
        let owned = add(a.clone(), b.clone() * 1.0).ok().unwrap();
        assert_eq!(bits(owned), expected, "{dtype:?} add into the second input");
        let per_channel = add_per_channel(a.clone(), t.clone()).ok().unwrap();
        let burn = a.clone() + t.clone().unsqueeze_dim::<3>(2).unsqueeze_dim(3);
        assert_eq!(bits(per_channel), bits(burn), "{dtype:?} add_per_channel");
        assert!(add(a.clone(), b.narrow(3, 0, 4)).is_err());
        assert!(add_per_channel(a, t.narrow(1, 0, 2)).is_err());
    }
}

fn bits<const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    t.cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn other_dtypes_and_shapes_are_handed_back() {
    let x = tensor([1, 6, 4], 1, 1.0, 0.0);
    let w = tensor([6], 2, 1.0, 1.0);
    let b = tensor([6], 3, 1.0, 0.0);
    // 6 channels do not split into 4 groups.
    assert!(group_norm(x.clone(), &w, &b, 4, 1e-6, false).is_err());
    // f64 is left to Burn, and so are mixed dtypes (half precision alone: `cpu_half.rs`).
    let wide = x.clone().cast(FloatDType::F64);
    assert!(layer_norm(wide.clone(), None, 1e-6).is_err());
    assert!(geglu(wide.clone()).is_err());
    assert!(transpose(wide).is_err());
    let half = x.clone().cast(FloatDType::F16);
    assert!(group_norm(half, &w, &b, 3, 1e-6, false).is_err());
    // An odd width has no GEGLU halves.
    assert!(geglu(tensor([1, 2, 5], 4, 1.0, 0.0)).is_err());
}
