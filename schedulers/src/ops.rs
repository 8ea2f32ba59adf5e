//! Tensor helpers shared by the schedulers: linear combinations with host coefficients,
//! per-batch-item scaling for `add_noise`, and dynamic thresholding of the predicted clean
//! sample.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::{Result, SchedulerError};

/// Checks that `timesteps` has one entry, or one per batch item of `original`, and that
/// `noise` has `original`'s shape.
pub(crate) fn check_add_noise<B: Backend>(
    class: &'static str,
    original: &Tensor<B, 4>,
    noise: &Tensor<B, 4>,
    timesteps: &[f64],
) -> Result<()> {
    let batch = original.dims()[0];
    if original.dims() != noise.dims() {
        return Err(SchedulerError::Shape {
            class,
            op: "add_noise",
            message: format!(
                "noise shape {:?} differs from sample shape {:?}",
                noise.dims(),
                original.dims()
            ),
        });
    }
    if timesteps.len() != 1 && timesteps.len() != batch {
        return Err(SchedulerError::Shape {
            class,
            op: "add_noise",
            message: format!(
                "{} timesteps for a batch of {batch}; give one, or one per item",
                timesteps.len()
            ),
        });
    }
    Ok(())
}

/// `x[i] * coefs[i]` for each batch item (one coefficient scales the whole batch).
pub(crate) fn scale_per_item<B: Backend>(x: Tensor<B, 4>, coefs: &[f64]) -> Tensor<B, 4> {
    match coefs {
        [c] => x.mul_scalar(*c),
        _ if coefs.windows(2).all(|w| w[0] == w[1]) => x.mul_scalar(coefs[0]),
        _ => Tensor::cat(
            coefs
                .iter()
                .enumerate()
                .map(|(i, &c)| x.clone().narrow(0, i, 1).mul_scalar(c))
                .collect(),
            0,
        ),
    }
}

/// The DDPM forward process `sqrt(a_t) x0 + sqrt(1 - a_t) noise` for PNDM and DDIM.
pub(crate) fn alpha_add_noise<B: Backend>(
    original: Tensor<B, 4>,
    noise: Tensor<B, 4>,
    alphas: &[f64],
) -> Tensor<B, 4> {
    let sqrt_a: Vec<f64> = alphas.iter().map(|a| a.sqrt()).collect();
    let sqrt_1ma: Vec<f64> = alphas.iter().map(|a| (1.0 - a).sqrt()).collect();
    scale_per_item(original, &sqrt_a) + scale_per_item(noise, &sqrt_1ma)
}

/// diffusers' `_threshold_sample`: per batch item, `s` is the `dynamic_thresholding_ratio`
/// quantile of `|x|` (torch.quantile's linear interpolation), clamped to
/// `[1, sample_max_value]`; `x` is clamped to `[-s, s]` and divided by `s`.
pub(crate) fn dynamic_threshold<B: Backend>(
    x: Tensor<B, 4>,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
) -> Tensor<B, 4> {
    let [b, c, h, w] = x.dims();
    let n = c * h * w;
    let flat = x.reshape([b, n]);
    let sorted = flat.clone().abs().sort(1);
    // torch computes the rank in the tensor's dtype (f32) and lerps from the lower value
    // for weights below one half, from the upper value otherwise.
    let rank = dynamic_thresholding_ratio as f32 * (n - 1) as f32;
    let lo = rank.floor() as usize;
    let hi = (rank.ceil() as usize).min(n - 1);
    let weight = (rank - lo as f32) as f64;
    let below = sorted.clone().narrow(1, lo, 1);
    let above = sorted.narrow(1, hi, 1);
    let s = if weight < 0.5 {
        below.clone() + (above - below).mul_scalar(weight)
    } else {
        above.clone() - (above - below).mul_scalar(1.0 - weight)
    };
    let s = s.clamp_min(1.0).clamp_max(sample_max_value).expand([b, n]);
    flat.max_pair(s.clone().neg())
        .min_pair(s.clone())
        .div(s)
        .reshape([b, c, h, w])
}

/// The `x0` clean-up of DDIM, DDPM and LCM: [`dynamic_threshold`] when `thresholding` is
/// `Some((dynamic_thresholding_ratio, sample_max_value))`, else a clamp to `[-r, r]` when
/// `clip_sample_range` is `Some(r)`, else `x0` as it is.
pub(crate) fn threshold_or_clip<B: Backend>(
    x0: Tensor<B, 4>,
    thresholding: Option<(f64, f64)>,
    clip_sample_range: Option<f64>,
) -> Tensor<B, 4> {
    match (thresholding, clip_sample_range) {
        (Some((ratio, max)), _) => dynamic_threshold(x0, ratio, max),
        (None, Some(r)) => x0.clamp(-r, r),
        (None, None) => x0,
    }
}

/// `x * a`, skipping the multiplication when `a` is 1.
pub(crate) fn scaled<B: Backend>(x: Tensor<B, 4>, a: f64) -> Tensor<B, 4> {
    if a == 1.0 {
        x
    } else {
        x.mul_scalar(a)
    }
}

/// `first.0 * first.1 + sum of x * c over rest`, skipping the terms of `rest` whose
/// coefficient is zero.
pub(crate) fn lincomb<B: Backend>(
    first: (Tensor<B, 4>, f64),
    rest: impl IntoIterator<Item = (Tensor<B, 4>, f64)>,
) -> Tensor<B, 4> {
    rest.into_iter()
        .filter(|(_, c)| *c != 0.0)
        .fold(scaled(first.0, first.1), |acc, (x, c)| acc + scaled(x, c))
}
