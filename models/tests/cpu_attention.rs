//! `cpu::attention`, the burn-flex f32 fast path of `multi_head_attention`, against Burn's own
//! `attention` on the same backend (heads split and merged by hand): self- and cross-attention,
//! several heads, a partial last query block, batch > 1, long key sequences and large logits;
//! its exponential against libm's; and the fallback for what it does not cover.
//!
//! Tolerance 2e-6 relative to the output's largest magnitude (the same products in f32, summed
//! in another order, and an exponential within 4 ulp).

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::cpu::attention::{attention, masked_attention, Masking};
use oxidiff_models::cpu::common::exp_nonpositive;

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
        2e-6,
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
