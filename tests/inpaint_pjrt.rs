//! Inpainting on XLA's CPU plugin in compiled mode: the 9-channel UNet call (latents, mask and
//! masked-image latents concatenated, guidance batched) is one XLA program, compiled once for
//! the run, and the result matches the CPU backend within 1e-4 relative (burn-flex orders
//! reductions differently, as in `pipeline_pjrt.rs`); the masked-latent method runs its blend
//! eagerly on the device and matches too.

mod common;

use common::{fixtures, model_dir, relative_error, to_vec};
use oxidiff::models::UNet2DConditionModel;
use oxidiff::pipelines::image::{load_image, load_mask};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionInpaintPipeline};
use oxidiff::{Oxi, OxiDevice, ToDevice};

fn skip() -> bool {
    std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1")
}

fn load(nine_channels: bool) -> StableDiffusionInpaintPipeline<Oxi> {
    let options = LoadOptions {
        scheduler: Some("euler".into()),
        ..Default::default()
    };
    let mut pipe = StableDiffusionInpaintPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sd1"),
        &options,
        &OxiDevice::Cpu,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    if nine_channels {
        pipe.pipe.unet = UNet2DConditionModel::from_dir(
            &fixtures().join("tiny-sd1-inpaint-unet"),
            None,
            &OxiDevice::Cpu,
        )
        .unwrap();
    }
    pipe
}

fn run(pipe: &mut StableDiffusionInpaintPipeline<Oxi>) -> (Vec<f32>, Vec<f32>) {
    let image = load_image(&fixtures().join("golden/img2img-input.png")).unwrap();
    let mask = load_mask(&fixtures().join("golden/inpaint-mask.png")).unwrap();
    let req = GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        seed: 42,
        ..Default::default()
    };
    let out = pipe
        .generate(&req, &image, &mask, 0.75)
        .unwrap_or_else(|e| panic!("{e}"));
    (
        to_vec(out.latents.to_device(&OxiDevice::Cpu)),
        out.images.expect("images").data,
    )
}

fn assert_within(what: &str, actual: &[f32], expected: &[f32]) {
    let err = relative_error(actual, expected);
    eprintln!("{what}: relative error {err:e}");
    assert!(err <= 1e-4, "{what}: relative error {err:e} exceeds 1e-4");
}

#[test]
fn compiled_inpainting_on_xla_cpu_matches_the_cpu_backend() {
    if skip() {
        return;
    }
    let xla: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    for nine_channels in [true, false] {
        let (cpu_latents, cpu_image) = run(&mut load(nine_channels));
        let mut pipe = load(nine_channels).to(&xla);
        pipe.pipe.compile().unwrap();
        let (latents, image) = run(&mut pipe);
        let what = if nine_channels {
            "9-channel"
        } else {
            "4-channel"
        };
        assert_eq!(
            pipe.pipe.compile_stats().map(|s| s.programs),
            Some(1),
            "{what}: one program for the whole run"
        );
        assert_within(&format!("{what} latents"), &latents, &cpu_latents);
        assert_within(&format!("{what} image"), &image, &cpu_image);
    }
}
