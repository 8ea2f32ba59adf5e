//! Tensor helpers shared by the schedulers: per-batch-item scaling for `add_noise`.

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
