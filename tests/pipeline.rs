//! The whole Stable Diffusion pipeline against diffusers, step by step, for each scheduler.
//!
//! diffusers ran with the same initial latents (and, for Euler ancestral, the noise it drew is
//! replayed). Latents and float images within 1e-4 relative (f32 on both sides; see
//! tests/models.rs); 8-bit PNG pixels within 2 levels of diffusers' PNG.

mod common;

use std::cell::RefCell;

use common::{assert_close, model_dir, relative_error, Golden, B};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::schedulers::{NoNoise, NoiseSource, RecordedNoise};

const TOL: f32 = 1e-4;

fn run(name: &str, scheduler: &str) {
    let golden = Golden::load(name);
    let options = LoadOptions {
        scheduler: Some(scheduler.to_string()),
        ..Default::default()
    };
    let device = Default::default();
    let mut pipe =
        StableDiffusionPipeline::<B>::from_dir(&model_dir(name), &options, &device).unwrap();
    let settings = &golden.json["pipeline"];
    let request = GenerateRequest {
        prompts: vec![settings["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![settings["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: settings["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: settings["guidance_scale"].as_f64().unwrap(),
        width: Some(settings["width"].as_u64().unwrap() as usize),
        height: Some(settings["height"].as_u64().unwrap() as usize),
        latents: Some(golden.tensor("pipe.latents")),
        ..Default::default()
    };
    let mut noise: Box<dyn NoiseSource<B>> = if scheduler == "euler_ancestral" {
        let draws = (0..request.num_inference_steps)
            .map(|i| golden.tensor(&format!("pipe.euler_ancestral.noise{i}")));
        Box::new(RecordedNoise::new(draws))
    } else {
        Box::new(NoNoise)
    };
    let steps = RefCell::new(Vec::new());
    let out = pipe
        .generate_with(&request, noise.as_mut(), |info| {
            steps
                .borrow_mut()
                .push((info.timestep, info.latents.clone()))
        })
        .unwrap();

    let expected_timesteps: Vec<f64> = golden.json["timesteps"][scheduler]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let steps = steps.into_inner();
    let timesteps: Vec<f64> = steps.iter().map(|(t, _)| *t).collect();
    assert_eq!(
        timesteps, expected_timesteps,
        "{name}/{scheduler}: timesteps"
    );
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(&golden, &format!("pipe.{scheduler}.step{i}"), latents, TOL);
    }

    let images = out.images.unwrap();
    let (expected, _) = golden.host(&format!("pipe.{scheduler}.image"));
    let err = relative_error(&images.data, &expected);
    assert!(
        err <= TOL,
        "{name}/{scheduler}: image relative error {err:e}"
    );

    common::assert_png_close(
        &images.to_rgb8(0).unwrap(),
        &format!("{name}-{scheduler}.png"),
        2,
    );
}

#[test]
fn sd1_pndm_matches_diffusers() {
    run("tiny-sd1", "pndm");
}

#[test]
fn sd1_ddim_matches_diffusers() {
    run("tiny-sd1", "ddim");
}

#[test]
fn sd1_euler_matches_diffusers() {
    run("tiny-sd1", "euler");
}

#[test]
fn sd1_euler_ancestral_matches_diffusers_with_replayed_noise() {
    run("tiny-sd1", "euler_ancestral");
}

#[test]
fn sd2_v_prediction_pndm_matches_diffusers() {
    run("tiny-sd2", "pndm");
}

#[test]
fn sd2_v_prediction_ddim_matches_diffusers() {
    run("tiny-sd2", "ddim");
}

#[test]
fn sd2_v_prediction_euler_matches_diffusers() {
    run("tiny-sd2", "euler");
}

#[test]
fn sd2_v_prediction_euler_ancestral_matches_diffusers_with_replayed_noise() {
    run("tiny-sd2", "euler_ancestral");
}

#[test]
fn empty_prompts_bad_sizes_and_wrong_latents_are_input_errors() {
    let device = Default::default();
    let mut pipe = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let base = GenerateRequest::<B> {
        prompts: vec!["x".into()],
        num_inference_steps: 1,
        ..Default::default()
    };
    let mut err = |req: &GenerateRequest<B>| pipe_err(&mut pipe, req);
    fn pipe_err(pipe: &mut StableDiffusionPipeline<B>, req: &GenerateRequest<B>) -> String {
        match pipe.generate(req) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }
    let empty = GenerateRequest {
        prompts: vec![],
        ..base.clone()
    };
    assert!(err(&empty).contains("prompt list is empty"));
    let odd = GenerateRequest {
        width: Some(70),
        ..base.clone()
    };
    assert!(err(&odd).contains("multiples of 8"));
    let negatives = GenerateRequest {
        negative_prompts: vec!["a".into(), "b".into()],
        ..base.clone()
    };
    assert!(err(&negatives).contains("negative prompts"));
    let latents = GenerateRequest {
        latents: Some(burn::tensor::Tensor::zeros([1, 4, 4, 4], &device)),
        ..base.clone()
    };
    assert!(err(&latents).contains("expected [1, 4, 8, 8]"));
    // The default size is the UNet's sample_size times the VAE factor.
    assert_eq!(pipe.default_size(), 64);
}

/// Every scheduler the crate offers (each `SchedulerKind`) runs the tiny pipeline to a finite
/// image, calling the UNet once per entry of its timesteps (PLMS repeats one; Heun, KDPM2 and
/// flow-matching Heun add one per step but the last), by A1111 name too. The flow-matching
/// ones run on this epsilon UNet as diffusers would let them: a smoke test, not a parity test.
#[test]
fn every_scheduler_runs_the_pipeline() {
    let device = Default::default();
    let mut pipe = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let cases = [
        ("pndm", 4),
        ("ddim", 3),
        ("ddpm", 3),
        ("euler", 3),
        ("Euler a", 3),
        ("heun", 5),
        ("lms", 3),
        ("DPM++ 2M Karras", 3),
        ("DEIS", 3),
        ("DPM++ 2M SDE", 3),
        ("unipc", 3),
        ("flow_match_euler", 3),
        ("FlowMatchHeunDiscreteScheduler", 5),
        ("DPM2 Karras", 5),
        ("DPM2 a", 5),
        ("LCM", 3),
        ("TCD", 3),
        ("DPM++ SDE Karras", 3),
        ("cm", 3),
    ];
    let mut kinds = std::collections::HashSet::new();
    for (name, calls) in cases {
        pipe.set_scheduler(name).unwrap();
        kinds.insert(pipe.scheduler.kind());
        let request = GenerateRequest::<B> {
            prompts: vec!["a red apple".into()],
            num_inference_steps: 3,
            seed: 5,
            ..Default::default()
        };
        let mut seen = 0;
        let mut generator = oxidiff::schedulers::TorchCpuGenerator::new(5);
        let out = pipe
            .generate_with(&request, &mut generator, |_| seen += 1)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(seen, calls, "{name}: UNet calls");
        let images = out.images.unwrap();
        assert!(images.data.iter().all(|v| v.is_finite()), "{name}: finite");
        let mean = images.data.iter().sum::<f32>() / images.data.len() as f32;
        assert!((0.05..0.95).contains(&mean), "{name}: mean {mean}");
    }
    assert!(pipe.set_scheduler("warp drive").is_err());
    for kind in oxidiff::schedulers::SchedulerKind::ALL {
        assert!(kinds.contains(&kind), "{kind} was not run");
    }
}
