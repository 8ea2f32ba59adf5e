//! `cpu::attention`, the burn-flex f32 fast path of `multi_head_attention`, against Burn's own
//! `attention` on the same backend (heads split and merged by hand): self- and cross-attention,
//! several heads, a partial last query block, batch > 1, long key sequences and large logits;
//! its exponential against libm's; and the fallback for what it does not cover.
//!
//! Tolerance against f64: 2e-6 relative to the output's largest magnitude (products and sums
//! in f32, an exponential within 4 ulp). Against Burn's f32 attention, whose own error is of
//! the same size: 4e-6.
//!
//! Unmasked f32 attention takes the key-blocked kernel (`cpu::attention_f32_flash`) where the
//! CPU has AVX2 or AVX-512, the gemm crate's products elsewhere: the f64 tests below run each
//! (AVX2 and the baseline width in child processes), and AVX2's bits against AVX-512's.

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::cpu::attention::{attention, masked_attention, Masking};
use oxidiff_models::cpu::common::{exp_nonpositive, exp_nonpositive_fused};
use oxidiff_models::cpu::simd::{self, VectorWidth};
use oxidiff_test_support::reference::attention as attention_f64;

type B = Flex;

/// Deterministic values in [-amp, amp) from a 64-bit LCG.
fn tensor(shape: [usize; 3], seed: u64, amp: f32) -> Tensor<B, 3> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let values: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// Burn's attention with the heads split and merged as `multi_head_attention` did before.
fn reference(q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>, heads: usize) -> Tensor<B, 3> {
    reference_masked(q, k, v, heads, false)
}

fn reference_masked(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
    is_causal: bool,
) -> Tensor<B, 3> {
    let [b, s_q, inner] = q.dims();
    let s_kv = k.dims()[1];
    let d = inner / heads;
    let split = |t: Tensor<B, 3>, s: usize| t.reshape([b, s, heads, d]).swap_dims(1, 2);
    burn_attention(
        split(q, s_q),
        split(k, s_kv),
        split(v, s_kv),
        None,
        None,
        AttentionModuleOptions {
            scale: Some(1.0 / (d as f64).sqrt()),
            softcap: None,
            is_causal,
        },
    )
    .swap_dims(1, 2)
    .reshape([b, s_q, inner])
}

fn check(b: usize, s_q: usize, s_kv: usize, heads: usize, d: usize, amp: f32) {
    let seed = (b * 1000 + s_q * 10 + s_kv) as u64;
    let q = tensor([b, s_q, heads * d], seed, amp);
    let k = tensor([b, s_kv, heads * d], seed + 1, amp);
    let v = tensor([b, s_kv, heads * d], seed + 2, 1.0);
    let expected: Vec<f32> = reference(q.clone(), k.clone(), v.clone(), heads)
        .into_data()
        .to_vec()
        .unwrap();
    let actual: Vec<f32> = attention(q, k, v, heads)
        .unwrap_or_else(|_| panic!("burn-flex f32 takes the fast path"))
        .into_data()
        .to_vec()
        .unwrap();
    oxidiff_test_support::assert_close(
        &format!("b {b} s_q {s_q} s_kv {s_kv} heads {heads} d {d} amp {amp}"),
        &actual,
        &expected,
        4e-6,
    );
}

#[test]
fn self_attention_matches_burn() {
    check(1, 64, 64, 1, 8, 1.0);
    check(2, 100, 100, 4, 16, 1.0);
    check(1, 300, 300, 8, 40, 2.0);
}

#[test]
fn cross_attention_and_long_keys_match_burn() {
    // Text cross-attention (77 keys), the VAE's single 512-wide head, 1030 keys.
    check(2, 130, 77, 8, 40, 1.0);
    check(1, 70, 1030, 1, 64, 1.0);
    check(3, 1, 5, 2, 4, 1.0);
}

#[test]
fn large_logits_stay_finite_and_match_burn() {
    // Logits up to about 30 * 30 * 16 / 4: the max shift keeps the exponentials in range.
    check(1, 65, 90, 2, 16, 30.0);
}

#[test]
fn exponential_is_within_four_ulp_of_libm() {
    let mut x = -87.0f32;
    while x <= 0.0 {
        let (ours, libm) = (exp_nonpositive(x), x.exp());
        assert!(
            (ours - libm).abs() <= 4.0 * f32::EPSILON * libm,
            "exp({x}): {ours} vs {libm}"
        );
        x += 0.001;
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert!(exp_nonpositive(-1000.0) < 1e-37);
}

#[test]
fn other_dtypes_and_mismatched_shapes_are_handed_back() {
    let q = tensor([1, 8, 16], 1, 1.0);
    let k = tensor([1, 8, 16], 2, 1.0);
    let v = tensor([1, 8, 16], 3, 1.0);
    // f64 is left to Burn, as are mixed dtypes.
    let wide = |t: &Tensor<B, 3>| t.clone().cast(FloatDType::F64);
    assert!(attention(wide(&q), wide(&k), wide(&v), 2).is_err());
    let half = |t: &Tensor<B, 3>| t.clone().cast(FloatDType::BF16);
    assert!(attention(half(&q), k.clone(), half(&v), 2).is_err());
    // Heads that do not divide the width, and values of another length than the keys.
    assert!(attention(q.clone(), k.clone(), v.clone(), 3).is_err());
    let short_v = tensor([1, 7, 16], 4, 1.0);
    assert!(attention(q, k, short_v, 2).is_err());
}

#[test]
fn causal_attention_matches_burn() {
    // CLIP's shape (77 tokens, 12 heads of 64 would be slow in the reference; 3 heads of 16
    // keep the block edges: 77 queries are a block of 64 and one of 13).
    let (q, k, v) = (
        tensor([2, 77, 48], 5, 1.0),
        tensor([2, 77, 48], 6, 1.0),
        tensor([2, 77, 48], 7, 1.0),
    );
    let expected: Vec<f32> = reference_masked(q.clone(), k.clone(), v.clone(), 3, true)
        .into_data()
        .to_vec()
        .unwrap();
    let actual: Vec<f32> = masked_attention(q.clone(), k.clone(), v.clone(), 3, Masking::Causal)
        .unwrap_or_else(|_| panic!("causal self-attention takes the fast path"))
        .into_data()
        .to_vec()
        .unwrap();
    oxidiff_test_support::assert_close("causal attention", &actual, &expected, 2e-6);
    // Unmasked differs (the mask is applied at all).
    let unmasked: Vec<f32> = attention(q, k, v, 3)
        .ok()
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    assert!(oxidiff_test_support::relative_error("unmasked", &unmasked, &expected) > 1e-2);
    // Causal masks need as many queries as keys.
    let (q, k) = (tensor([1, 5, 8], 1, 1.0), tensor([1, 6, 8], 2, 1.0));
    assert!(masked_attention(q, k.clone(), k, 2, Masking::Causal).is_err());
}

#[test]
fn fused_exponential_is_within_two_ulp_of_libm() {
    // Where the CPU has FMA (the kernels using it run nowhere else), at its vector width.
    if simd::width() < VectorWidth::Avx2 {
        eprintln!("no AVX2 here: the fused exponential is not used");
        return;
    }
    let xs: Vec<f32> = (0..=87_000)
        .map(|i| (-(i as f32) * 0.001).max(-87.0))
        .collect();
    let ours: Vec<f32> = simd::vectorized_for(VectorWidth::Avx2, || {
        xs.iter().map(|&x| exp_nonpositive_fused(x)).collect()
    });
    for (&x, &e) in xs.iter().zip(&ours) {
        let libm = x.exp();
        assert!(
            (e - libm).abs() <= 2.0 * f32::EPSILON * libm,
            "exp({x}): {e} vs {libm}"
        );
    }
    assert_eq!(exp_nonpositive_fused(0.0), 1.0);
    assert!(exp_nonpositive_fused(-1000.0) < 1e-37);
    assert!(exp_nonpositive_fused(f32::NEG_INFINITY) < 1e-37);
}

/// Odd shapes for the f64 checks: head sizes that are no multiple of the tiles (6 keys, 6
/// value columns, 16 or 64 query lanes), a partial last block of queries, keys over several
/// blocks of 120 with a partial last one, one query, the VAE's single wide head.
const ODD_SHAPES: [[usize; 5]; 8] = [
    [2, 70, 70, 2, 40],
    [1, 130, 77, 3, 8],
    [2, 100, 241, 2, 13],
    [1, 5, 300, 1, 64],
    [1, 1, 5, 2, 4],
    [1, 65, 130, 1, 136],
    [1, 64, 121, 4, 7],
    [1, 70, 1030, 1, 64],
];

/// Every odd shape's attention on this process's kernel, checked against f64; the outputs'
/// bits, concatenated.
fn odd_shapes_match_f64() -> Vec<u32> {
    let mut bits = Vec::new();
    for shape in ODD_SHAPES {
        let [b, s_q, s_kv, heads, d] = shape;
        let seed = shape.iter().sum::<usize>() as u64;
        let (q, k, v) = (
            tensor([b, s_q, heads * d], seed, 2.0),
            tensor([b, s_kv, heads * d], seed + 1, 2.0),
            tensor([b, s_kv, heads * d], seed + 2, 1.0),
        );
        let values = |t: &Tensor<B, 3>| -> Vec<f64> {
            let v: Vec<f32> = t.clone().into_data().to_vec().unwrap();
            v.into_iter().map(f64::from).collect()
        };
        let expected = attention_f64(&values(&q), &values(&k), &values(&v), shape, false);
        let got: Vec<f32> = attention(q, k, v, heads)
            .unwrap_or_else(|_| panic!("burn-flex f32 takes the fast path"))
            .into_data()
            .to_vec()
            .unwrap();
        let expected: Vec<f32> = expected.iter().map(|&x| x as f32).collect();
        oxidiff_test_support::assert_close(
            &format!("{shape:?} at {}", simd::width().name()),
            &got,
            &expected,
            2e-6,
        );
        bits.extend(got.iter().map(|x| x.to_bits()));
    }
    bits
}

#[test]
fn f32_attention_matches_f64_at_this_cpus_width() {
    odd_shapes_match_f64();
}

#[test]
fn f32_attention_matches_f64_at_the_baseline_width() {
    // The gemm crate's products: the key-blocked kernel needs FMA.
    if oxidiff_test_support::isolated(
        "f32_attention_matches_f64_at_the_baseline_width",
        &[("OXIDIFF_CPU_SIMD", "baseline")],
    ) {
        assert_eq!(simd::width(), VectorWidth::Baseline);
        odd_shapes_match_f64();
    }
}

/// Where the CPU has AVX-512: the key-blocked kernel at AVX2 width (16 query lanes a tile, in
/// a child process) matches f64 and gives the bits it gives at AVX-512 width (64 lanes).
#[test]
fn f32_attention_gives_the_same_bits_at_avx2_and_avx512_width() {
    const NAME: &str = "f32_attention_gives_the_same_bits_at_avx2_and_avx512_width";
    const OUT: &str = "OXIDIFF_TEST_ATTENTION_BITS";
    if std::env::var_os(OUT).is_some() {
        if oxidiff_test_support::isolated(NAME, &[("OXIDIFF_CPU_SIMD", "avx2")]) {
            assert_eq!(simd::width(), VectorWidth::Avx2);
            let bits: Vec<u8> = odd_shapes_match_f64()
                .iter()
                .flat_map(|b| b.to_le_bytes())
                .collect();
            std::fs::write(std::env::var_os(OUT).unwrap(), bits).unwrap();
        }
        return;
    }
    if simd::width() < VectorWidth::Avx512 {
        eprintln!("no AVX-512 here: nothing to compare AVX2's bits with");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("avx2-bits");
    assert!(!oxidiff_test_support::isolated(
        NAME,
        &[
            ("OXIDIFF_CPU_SIMD", std::ffi::OsStr::new("avx2")),
            (OUT, path.as_os_str())
        ],
    ));
    let avx2: Vec<u32> = std::fs::read(&path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(avx2, odd_shapes_match_f64(), "AVX2 and AVX-512 bits differ");
}
