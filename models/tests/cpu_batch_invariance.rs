//! Batch invariance of the CPU backend's f32 kernels: a sample's result is bit for bit the
//! same alone as in a batch of 2, 3 or 4, for linear layers (few rows through many), 3x3
//! convolutions on both sides of the Winograd threshold and their row tiling, 1x1 and strided
//! convolutions, and attention. This is what lets `txt2img --batch-size` and the server's
//! shared batches give each image exactly as made alone (0 levels, not "within a level").

use burn::tensor::{Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::cpu::attention::attention;
use oxidiff_models::cpu::conv::{conv2d, ConvGeometry};
use oxidiff_models::cpu::linear::linear;

type B = Flex;

/// Deterministic values in [-1, 1) from a 64-bit LCG.
fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let values: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn bits<const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    t.into_data()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn linear_rows_round_the_same_whatever_the_row_count() {
    // Output widths on both sides of gemm's small-product kernels (`m * n <= 256`, both sides
    // at most 64 with more than 512 inputs), and one-row products (its matrix-vector kernel).
    for (d_in, d_out) in [(32, 128), (64, 32), (768, 32), (320, 1280), (16, 16)] {
        let x = random([70, d_in], 1);
        let weight = random([d_out, d_in], 2).transpose();
        let bias = random([d_out], 3);
        let all = linear(x.clone(), weight.clone(), Some(bias.clone()))
            .ok()
            .unwrap();
        for rows in [1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65] {
            let some = linear(
                x.clone().narrow(0, 0, rows),
                weight.clone(),
                Some(bias.clone()),
            )
            .ok()
            .unwrap();
            assert!(
                bits(all.clone().narrow(0, 0, rows)) == bits(some),
                "{d_in}->{d_out}: {rows} rows differ from the same rows among 70"
            );
        }
    }
}

/// The f32 linear layer splits short products by outputs over rayon's threads: the bits must
/// not depend on how many there are, and the values must be the product's.
#[test]
fn linear_bits_do_not_depend_on_the_thread_count() {
    // CLIP's shapes (77 and 154 tokens), an output count that splits unevenly, and a product
    // too small to split.
    for (rows, d_in, d_out) in [
        (154, 768, 768),
        (77, 768, 3072),
        (20, 1280, 333),
        (5, 64, 150),
    ] {
        let x = random([rows, d_in], 4);
        let weight = random([d_out, d_in], 5).transpose();
        let bias = random([d_out], 6);
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| {
                    linear(x.clone(), weight.clone(), Some(bias.clone()))
                        .ok()
                        .unwrap()
                })
        };
        let one = on(1);
        for threads in [2, 3, 8] {
            assert!(
                bits(one.clone()) == bits(on(threads)),
                "{rows}x{d_in}->{d_out}: {threads} threads differ from one"
            );
        }
        // Against an f64 product: within f32 summation's bound, `d_in * 2^-23` of the sum of
        // the terms' magnitudes (each at most 1 here) plus the bias.
        let (xs, ws, bs) = (
            x.into_data().to_vec::<f32>().unwrap(),
            weight.transpose().into_data().to_vec::<f32>().unwrap(),
            bias.into_data().to_vec::<f32>().unwrap(),
        );
        let got = one.into_data().to_vec::<f32>().unwrap();
        for r in 0..rows {
            for o in 0..d_out {
                let exact: f64 = (0..d_in)
                    .map(|k| xs[r * d_in + k] as f64 * ws[o * d_in + k] as f64)
                    .sum::<f64>()
                    + bs[o] as f64;
                let bound = (d_in + 1) as f64 * f32::EPSILON as f64;
                let err = (got[r * d_out + o] as f64 - exact).abs();
                assert!(
                    err <= bound,
                    "{rows}x{d_in}->{d_out} [{r}, {o}]: off by {err}"
                );
            }
        }
    }
}

#[test]
fn convolutions_give_a_sample_the_same_values_in_any_batch() {
    let cases = [
        // (channels in, out, side, kernel, stride, padding)
        (8, 8, 16, 3, 1, 1), // im2col alone, Winograd by the real batch's positions at 4
        (8, 16, 32, 3, 1, 1), // Winograd, tiles chosen by the batch before
        (16, 8, 8, 3, 1, 1), // deep layers: one gemm per sample
        (8, 8, 16, 1, 1, 0), // 1x1
        (8, 8, 16, 3, 2, 1), // stride 2 (downsampling)
        (4, 8, 64, 3, 1, 1), // many row tiles
    ];
    for (c_in, c_out, side, k, stride, padding) in cases {
        let x = random([4, c_in, side, side], 4);
        let weight = random([c_out, c_in, k, k], 5);
        let bias = random([c_out], 6);
        let geometry = ConvGeometry { stride, padding };
        let run = |n: usize| {
            conv2d(
                x.clone().narrow(0, 0, n),
                weight.clone(),
                Some(bias.clone()),
                geometry,
            )
            .ok()
            .unwrap()
            .narrow(0, 0, 1)
        };
        let alone = bits(run(1));
        for n in [2, 3, 4] {
            assert!(
                bits(run(n)) == alone,
                "{c_in}->{c_out} {k}x{k}/{stride} on {side}x{side}: the first sample of a \
                 batch of {n} differs from it alone"
            );
        }
    }
}

#[test]
fn attention_gives_a_sample_the_same_values_in_any_batch() {
    for (s_q, s_kv, inner, heads) in [(64, 77, 32, 2), (256, 256, 64, 4), (16, 16, 40, 5)] {
        let (q, k, v) = (
            random([4, s_q, inner], 7),
            random([4, s_kv, inner], 8),
            random([4, s_kv, inner], 9),
        );
        let run = |n: usize| {
            let take = |t: &Tensor<B, 3>| t.clone().narrow(0, 0, n);
            attention(take(&q), take(&k), take(&v), heads)
                .ok()
                .unwrap()
                .narrow(0, 0, 1)
        };
        let alone = bits(run(1));
        for n in [2, 4] {
            assert!(
                bits(run(n)) == alone,
                "attention {s_q}x{s_kv}: batch of {n} differs"
            );
        }
    }
}
