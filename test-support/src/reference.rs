//! Reference computations in f64 that several crates' tests hold their kernels against.

/// Softmax attention in f64 of `q` `[b, s_q, heads * d]` over `k`, `v` `[b, s_kv, heads * d]`
/// (`shape` = `[b, s_q, s_kv, heads, d]`), scaled by `1 / sqrt(d)`, heads merged back; with
/// `causal`, query `i` sees keys `0..=i`.
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    [b, s_q, s_kv, heads, d]: [usize; 5],
    causal: bool,
) -> Vec<f64> {
    let inner = heads * d;
    let mut out = vec![0.0; b * s_q * inner];
    for n in 0..b {
        for h in 0..heads {
            for i in 0..s_q {
                let qi = &q[(n * s_q + i) * inner + h * d..][..d];
                let seen = if causal { (i + 1).min(s_kv) } else { s_kv };
                let scores: Vec<f64> = (0..seen)
                    .map(|j| {
                        let kj = &k[(n * s_kv + j) * inner + h * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for c in 0..d {
                    out[(n * s_q + i) * inner + h * d + c] = (0..seen)
                        .map(|j| e[j] * v[(n * s_kv + j) * inner + h * d + c])
                        .sum::<f64>()
                        / sum;
                }
            }
        }
    }
    out
}
