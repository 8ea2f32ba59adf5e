//! What image-to-image adds to a denoising loop, shared by the SD and SDXL image-to-image and
//! inpainting pipelines: the strength checks, the strength-cut schedule and the VAE-encoded
//! start.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::AutoencoderKL;
use oxidiff_schedulers::{NoiseSource, Scheduler};

use crate::error::{PipelineError, Result};

/// Checks that `strength` is in (0, 1].
pub(crate) fn check_strength(strength: f64) -> Result<()> {
    if !(strength > 0.0 && strength <= 1.0) {
        return Err(PipelineError::InvalidInput(format!(
            "strength must be in (0, 1], got {strength}"
        )));
    }
    Ok(())
}

/// Checks that `strength` leaves at least one of `steps` steps to run.
pub(crate) fn check_strength_steps(strength: f64, steps: usize) -> Result<()> {
    if ((steps as f64 * strength) as usize).min(steps) == 0 {
        return Err(PipelineError::InvalidInput(format!(
            "strength {strength} with {steps} steps runs no step; raise the strength or the \
             number of steps"
        )));
    }
    Ok(())
}

/// diffusers' `get_timesteps` for a strength: the last `int(steps * strength)` steps of the
/// scheduler's schedule (already set for `steps`), with the scheduler's begin index set to
/// where they start.
pub(crate) fn strength_timesteps<B: Backend>(
    scheduler: &mut dyn Scheduler<B>,
    steps: usize,
    strength: f64,
) -> Result<Vec<f64>> {
    check_strength_steps(strength, steps)?;
    let init_steps = ((steps as f64 * strength) as usize).min(steps);
    let t_start = (steps - init_steps) * scheduler.order();
    let timesteps = scheduler.timesteps()[t_start..].to_vec();
    scheduler.set_begin_index(t_start);
    Ok(timesteps)
}

/// diffusers' `_encode_vae_image` / `retrieve_latents`: a sample of the VAE's latent
/// distribution for `image` (one draw from `noise`), times the scaling factor, repeated to
/// `batch` rows, on `device`.
pub(crate) fn encode_image_latents<B: Backend>(
    vae: &AutoencoderKL<B>,
    image: Tensor<B, 4>,
    batch: usize,
    noise: &mut dyn NoiseSource<B>,
    device: &B::Device,
) -> Result<Tensor<B, 4>> {
    let dist = vae.encode(image);
    let sample_noise = noise.randn(dist.mean.dims(), &dist.mean.device())?;
    let latents = dist
        .sample(sample_noise)
        .mul_scalar(vae.scaling_factor)
        .to_device(device);
    let rows = latents.dims()[0];
    Ok(if batch > rows {
        latents.repeat_dim(0, batch / rows)
    } else {
        latents
    })
}
