//! Times attention (`cpu::attention::attention`; bf16, or the dtype of the second argument) on
//! the SD 1.5 UNet's shapes with guidance (batch 2, 8 heads): self-attention over 4096, 1024
//! and 256 tokens (a 512x512 image's levels, heads of 40, 80 and 160), over 1024 tokens with
//! heads of 40 (a 256x256 image's outer level), cross-attention of 4096 queries over 77 text
//! tokens, and the VAE's one-head self-attention over 1024 tokens of 512 channels (its middle
//! block at 256x256). Set RAYON_NUM_THREADS and pin with `taskset` to compare builds.
//!
//!     cargo run --release -p oxidiff-models --example attention_bench [ROUNDS] [bf16|f16|f32]

use std::time::Instant;

use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::cpu::attention::attention;

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005) | 1;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn tensor(shape: [usize; 3], seed: u64, dtype: FloatDType) -> Tensor<Flex, 3> {
    let data = values(shape.iter().product(), seed);
    let t = Tensor::<Flex, 3>::from_data(TensorData::new(data, shape), &Default::default());
    if dtype == FloatDType::F32 {
        t
    } else {
        t.cast(dtype)
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let dtype = match std::env::args().nth(2).as_deref() {
        None | Some("bf16") => FloatDType::BF16,
        Some("f32") => FloatDType::F32,
        Some("f16") => FloatDType::F16,
        Some(other) => panic!("dtype {other}: f32, bf16 or f16"),
    };
    for (tokens, keys, channels, heads) in [
        (4096, 4096, 320, 8),
        (1024, 1024, 640, 8),
        (256, 256, 1280, 8),
        (1024, 1024, 320, 8),
        (4096, 77, 320, 8),
        (1024, 1024, 512, 1),
    ] {
        let (q, k, v) = (
            tensor([2, tokens, channels], 1, dtype),
            tensor([2, keys, channels], 2, dtype),
            tensor([2, keys, channels], 3, dtype),
        );
        let mut best = f64::INFINITY;
        for _ in 0..rounds {
            let start = Instant::now();
            let out = attention(q.clone(), k.clone(), v.clone(), heads)
                .unwrap_or_else(|_| panic!("attention takes the CPU kernel"));
            let _ = out.into_primitive();
            best = best.min(start.elapsed().as_secs_f64());
        }
        let flops = 4.0 * 2.0 * (tokens * keys * channels) as f64;
        println!(
            "{tokens} queries, {keys} keys, {channels} channels, {heads} heads: {:.2} ms, {:.0} GFLOP/s",
            best * 1e3,
            flops / best / 1e9
        );
    }
}
