//! Numerical faults: NaN or Inf in the middle of a generation is stopped at once with the step,
//! the component and the usual fix named, and no image.

mod common;

use burn::module::Param;
use burn::tensor::Tensor;
use common::{model_dir, B};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};

fn pipeline() -> StableDiffusionPipeline<B> {
    StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

fn request() -> GenerateRequest<B> {
    GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        num_inference_steps: 3,
        guidance_scale: 7.5,
        seed: 3,
        ..Default::default()
    }
}

/// `bias` with one entry set to `value`.
fn poisoned(bias: &Param<Tensor<B, 1>>, value: f32) -> Param<Tensor<B, 1>> {
    let t = bias.val();
    let [n] = t.dims();
    let mask: Vec<f32> = (0..n).map(|i| if i == 0 { value } else { 0.0 }).collect();
    Param::from_tensor(t + Tensor::from_floats(mask.as_slice(), &Default::default()))
}

#[test]
fn nan_in_the_unet_names_the_denoiser_and_step() {
    let mut pipe = pipeline();
    let bias = pipe.unet.conv_out.bias.as_ref().unwrap();
    pipe.unet.conv_out.bias = Some(poisoned(bias, f32::NAN));
    let err = pipe.generate(&request()).unwrap_err().to_string();
    assert!(
        err.contains("NaN or Inf in the denoiser's output at step 0"),
        "{err}"
    );
    assert!(
        err.contains("damaged or badly converted checkpoint"),
        "{err}"
    );
}

#[test]
fn overflow_in_the_vae_names_the_decoder_and_the_fp32_fix() {
    let mut pipe = pipeline();
    let bias = pipe.vae.decoder.conv_out.bias.as_ref().unwrap();
    pipe.vae.decoder.conv_out.bias = Some(poisoned(bias, f32::INFINITY));
    let err = pipe.generate(&request()).unwrap_err().to_string();
    assert!(
        err.contains("NaN or Inf in the VAE decoder's output"),
        "{err}"
    );
    assert!(err.contains("fp32 VAE"), "{err}");
}

#[test]
fn a_healthy_run_passes_the_checks() {
    let out = pipeline().generate(&request()).unwrap();
    assert_eq!(out.images.unwrap().count, 1);
}
