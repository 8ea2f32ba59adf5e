//! The tiny SD pipeline on XLA's CPU plugin (eager PJRT) matches the CPU result, whole or split
//! across devices.
//!
//! Tolerance 1e-4 relative: both sides compute in f32, but XLA fuses and orders reductions
//! differently from burn-flex (observed about 1e-6).

mod common;

use burn::tensor::Tensor;
use common::{model_dir, relative_error, to_vec, Golden};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::schedulers::NoNoise;
use oxidiff::{Oxi, OxiDevice, ToDevice};

fn request(golden: &Golden, device: &OxiDevice) -> GenerateRequest<Oxi> {
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 2,
        guidance_scale: 7.5,
        latents: Some(Tensor::from_data(
            burn::tensor::TensorData::new(values, shape),
            device,
        )),
        ..Default::default()
    }
}

/// The tiny SD pipeline, with DDIM, loaded straight onto `device`.
fn tiny_sd(device: &OxiDevice) -> StableDiffusionPipeline<Oxi> {
    let options = LoadOptions {
        scheduler: Some("ddim".into()),
        ..Default::default()
    };
    StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, device).unwrap()
}

fn xla(index: usize) -> OxiDevice {
    format!("xla:cpu:{index}")
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"))
}

#[test]
fn tiny_pipeline_on_xla_cpu_matches_cpu() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load("tiny-sd1");
    let cpu = OxiDevice::Cpu;
    let options = LoadOptions {
        scheduler: Some("ddim".into()),
        ..Default::default()
    };
    let mut pipe =
        StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, &cpu).unwrap();
    let on_cpu = pipe
        .generate_with(&request(&golden, &cpu), &mut NoNoise, |_| {})
        .unwrap();
    let expected = on_cpu.images.unwrap().data;

    // The whole pipeline on one PJRT device.
    let device = xla(0);
    let mut pipe = pipe.to(&device);
    assert_eq!(pipe.unet_device(), device);
    let on_xla = pipe
        .generate_with(&request(&golden, &cpu), &mut NoNoise, |_| {})
        .unwrap();
    let err = relative_error(&on_xla.images.unwrap().data, &expected);
    assert!(err <= 1e-4, "xla:cpu vs cpu image: relative error {err:e}");
    let latents = to_vec(on_xla.latents.to_device(&cpu));
    let reference = to_vec(on_cpu.latents);
    let err = relative_error(&latents, &reference);
    assert!(
        err <= 1e-4,
        "xla:cpu vs cpu latents: relative error {err:e}"
    );

    // Components on different devices: text encoder on the CPU, UNet and VAE on two devices.
    let mut pipe = pipe.to_components(&cpu, &device, &xla(1));
    assert_eq!(pipe.text_encoder_device(), cpu);
    assert_eq!(pipe.vae_device(), xla(1));
    let split = pipe
        .generate_with(&request(&golden, &cpu), &mut NoNoise, |_| {})
        .unwrap();
    let err = relative_error(&split.images.unwrap().data, &expected);
    assert!(
        err <= 1e-4,
        "split placement vs cpu: relative error {err:e}"
    );
}

/// Compiled mode: the UNet step is one program; a new prompt, seed, guidance, scheduler or step
/// count reuses it, a new size compiles once more; results match the eager CPU run.
#[test]
fn compiled_unet_matches_and_does_not_recompile() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load("tiny-sd1");
    let cpu = OxiDevice::Cpu;
    let options = LoadOptions {
        scheduler: Some("ddim".into()),
        ..Default::default()
    };
    let mut pipe =
        StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, &cpu).unwrap();
    assert!(pipe
        .compile()
        .unwrap_err()
        .to_string()
        .contains("PJRT device"));
    let expected = pipe
        .generate_with(&request(&golden, &cpu), &mut NoNoise, |_| {})
        .unwrap()
        .images
        .unwrap()
        .data;

    let mut pipe = pipe.to(&xla(0));
    pipe.compile().unwrap();
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(0));
    let out = pipe
        .generate_with(&request(&golden, &cpu), &mut NoNoise, |_| {})
        .unwrap();
    let err = relative_error(&out.images.unwrap().data, &expected);
    assert!(err <= 1e-4, "compiled vs eager cpu: relative error {err:e}");
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(1));

    pipe.set_scheduler("euler_a").unwrap();
    let other = GenerateRequest::<Oxi> {
        prompts: vec!["a red apple".into()],
        num_inference_steps: 3,
        guidance_scale: 4.0,
        seed: 9,
        ..Default::default()
    };
    pipe.generate(&other).unwrap();
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(1),
        "prompt/seed/guidance/scheduler/steps recompiled"
    );

    let larger = GenerateRequest::<Oxi> {
        width: Some(72),
        num_inference_steps: 1,
        ..other
    };
    let out = pipe.generate(&larger).unwrap();
    assert_eq!(out.images.unwrap().width, 72);
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(2),
        "a new size compiles once"
    );
}

/// `Offload::TextEncoders`: after each request's prompts are encoded, every weight of the text
/// encoder (all read from the mapped checkpoint) leaves the device, and the next request
/// uploads it again from the file, except the embedding tables, looked up on the host with or
/// without offload (they left the device at their first lookup); the images are the same bit
/// for bit, eager and compiled.
#[test]
fn text_encoder_offload_frees_and_restores_its_weights() {
    use burn::module::Module;
    use oxidiff::pipelines::Offload;

    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load("tiny-sd1");
    // Its own device: the SDXL test hands back weights on device 0 at the same time.
    let device = xla(1);
    let mut pipe = tiny_sd(&device);
    let client = oxidiff::backend::pjrt_client(&device).unwrap();
    let encoder_bytes = (pipe.text_encoder.num_params() * 4) as u64;
    // The embedding tables are looked up on the host (only the rows used are uploaded), so
    // from the first request on they are off the device.
    let tables = ((pipe.text_encoder.token_embedding.num_params()
        + pipe.text_encoder.position_embedding.num_params())
        * 4) as u64;
    let generate = |pipe: &mut StableDiffusionPipeline<Oxi>| {
        let before = client.stats();
        let image = pipe
            .generate_with(&request(&golden, &OxiDevice::Cpu), &mut NoNoise, |_| {})
            .unwrap()
            .images
            .unwrap()
            .data;
        let after = client.stats();
        assert!(
            after.host_lookups >= before.host_lookups + 2,
            "the token and position tables were not looked up on the host"
        );
        (
            image,
            after.released_bytes - before.released_bytes,
            after.uploaded_bytes - before.uploaded_bytes,
            after.host_heap_returns - before.host_heap_returns,
        )
    };
    for compiled in [false, true] {
        if compiled {
            pipe.compile().unwrap();
        }
        pipe.offload = Offload::Off;
        let (kept, released, _, returns) = generate(&mut pipe);
        assert_eq!(
            released, 0,
            "compiled {compiled}: nothing released without offload"
        );
        // Without offload the host heap goes back before the VAE decodes (and, in the first
        // request, when the tables leave the device).
        assert!(
            returns >= 1,
            "compiled {compiled}: the host heap was not handed back"
        );
        pipe.offload = Offload::TextEncoders;
        for request in 0..2 {
            let (image, released, uploaded, returns) = generate(&mut pipe);
            let at = format!("compiled {compiled}, request {request}");
            assert!(image == kept, "{at}: the image changed");
            let expected = encoder_bytes - tables;
            assert_eq!(released, expected, "{at}: bytes released");
            if request > 0 {
                assert!(
                    uploaded >= expected,
                    "{at}: the encoder was not uploaded again"
                );
            }
            // The host heap's free memory goes back to the kernel at the release and before
            // the VAE decodes; in compiled mode also before the denoiser's first program (what
            // the text encoder's program still read at the release is freed only then), and
            // from the second request on before the encoder is uploaded again.
            let least = 2 + u64::from(compiled) + u64::from(request > 0);
            assert!(
                returns >= least,
                "{at}: the host heap was handed back {returns} times, fewer than {least}"
            );
        }
    }
    assert_eq!(
        "text-encoders".parse::<Offload>().unwrap(),
        Offload::TextEncoders
    );
    assert_eq!(Offload::TextEncoders.to_string(), "text-encoders");
    let err = "vae".parse::<Offload>().unwrap_err().to_string();
    assert!(err.contains("`off` or `text-encoders`"), "{err}");
}

/// SDXL on XLA's CPU plugin, eager and compiled (the added condition as runtime inputs), matches
/// the CPU; new size/crop conditioning and guidance reuse the compiled program.
#[test]
fn sdxl_on_xla_cpu_eager_and_compiled_matches_cpu() {
    use oxidiff::pipelines::{StableDiffusionXLPipeline, XlOptions, XlRequest};
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load("tiny-sdxl");
    let cpu = OxiDevice::Cpu;
    let mut pipe = StableDiffusionXLPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &cpu,
    )
    .unwrap();
    assert!(pipe
        .compile()
        .unwrap_err()
        .to_string()
        .contains("PJRT device"));
    let xl = XlOptions {
        original_size: Some((96, 80)),
        crops_coords_top_left: (8, 4),
        ..Default::default()
    };
    let xl_request = |device: &OxiDevice| XlRequest {
        common: request(&golden, device),
        xl: xl.clone(),
    };
    let image = |pipe: &mut StableDiffusionXLPipeline<Oxi>| {
        pipe.generate_with(&xl_request(&cpu), &mut NoNoise, |_| {})
            .unwrap()
            .images
            .unwrap()
            .data
    };
    let expected = image(&mut pipe);

    let mut pipe = pipe.to(&xla(0));
    let eager = pipe
        .generate_with(&xl_request(&cpu), &mut NoNoise, |_| {})
        .unwrap();
    let err = relative_error(&eager.images.unwrap().data, &expected);
    assert!(
        err <= 1e-4,
        "SDXL xla:cpu eager vs cpu: relative error {err:e}"
    );
    eprintln!("SDXL xla:cpu eager vs cpu: relative error {err:e}");

    pipe.compile().unwrap();
    let compiled = image(&mut pipe);
    let err = relative_error(&compiled, &expected);
    assert!(err <= 1e-4, "SDXL compiled vs cpu: relative error {err:e}");
    eprintln!("SDXL compiled vs cpu: relative error {err:e}");
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(1));

    // Both text encoders handed back after each request (of a pipeline moved from the CPU:
    // its weights still read from the mapped files), then uploaded again: the same image.
    pipe.offload = oxidiff::pipelines::Offload::TextEncoders;
    let client = oxidiff::backend::pjrt_client(&xla(0)).unwrap();
    for request in 0..2 {
        let before = client.stats().released_bytes;
        assert!(
            image(&mut pipe) == compiled,
            "request {request}: offload changed the image"
        );
        assert!(
            client.stats().released_bytes > before,
            "request {request}: nothing was handed back"
        );
    }
    pipe.offload = oxidiff::pipelines::Offload::Off;
    let other = XlOptions {
        original_size: Some((1024, 1024)),
        ..Default::default()
    };
    let mut req = XlRequest {
        common: request(&golden, &cpu),
        xl: other,
    };
    req.common.guidance_scale = 3.0;
    pipe.generate_with(&req, &mut NoNoise, |_| {}).unwrap();
    assert_eq!(
        pipe.compile_stats().map(|s| s.programs),
        Some(1),
        "time ids or guidance recompiled"
    );
}

/// Text to image on a device never uploads the VAE's encoder (diffusers' pipelines hold it
/// anyway): its weights arrive at its first encode, which then matches the same encode on the
/// CPU.
#[test]
fn the_vae_encoder_reaches_the_device_at_its_first_use() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let golden = Golden::load("tiny-sd1");
    let device = xla(0);
    let mut pipe = tiny_sd(&device);
    let encoder_loaded = |pipe: &StableDiffusionPipeline<Oxi>| {
        let quant = pipe.vae.quant_conv.as_ref().unwrap();
        assert_eq!(
            pipe.vae.encoder.conv_in.weight.is_initialized(),
            quant.weight.is_initialized()
        );
        pipe.vae.encoder.conv_in.weight.is_initialized()
    };
    assert!(pipe.vae.decoder.conv_in.weight.is_initialized());
    assert!(!encoder_loaded(&pipe), "uploaded at load");
    pipe.generate_with(&request(&golden, &OxiDevice::Cpu), &mut NoNoise, |_| {})
        .unwrap();
    assert!(!encoder_loaded(&pipe), "uploaded by text to image");

    let uploaded = || {
        oxidiff::backend::pjrt_client(&device)
            .unwrap()
            .stats()
            .uploaded_bytes
    };
    let before = uploaded();
    let pixels: Vec<f32> = (0..3 * 64 * 64)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let image = |on: &OxiDevice| {
        Tensor::<Oxi, 4>::from_data(
            burn::tensor::TensorData::new(pixels.clone(), [1, 3, 64, 64]),
            on,
        )
    };
    let on_device = to_vec(
        pipe.vae
            .encode(image(&device))
            .mean
            .to_device(&OxiDevice::Cpu),
    );
    assert!(encoder_loaded(&pipe));
    let encoder_bytes: usize = {
        use burn::module::Module;
        (pipe.vae.encoder.num_params() + pipe.vae.quant_conv.as_ref().unwrap().num_params()) * 4
    };
    assert!(
        uploaded() - before >= encoder_bytes as u64,
        "the encoder's {encoder_bytes} bytes of weights were uploaded at its first use"
    );

    let cpu = OxiDevice::Cpu;
    let on_cpu_pipe = tiny_sd(&cpu);
    let on_cpu = to_vec(on_cpu_pipe.vae.encode(image(&cpu)).mean);
    let err = relative_error(&on_device, &on_cpu);
    assert!(err <= 1e-4, "relative error {err:e}");
}
