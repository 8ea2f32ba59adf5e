//! IP-Adapter against diffusers (tools/golden/make_ip_adapter.py): the CLIP image processor and
//! image encoder, the image projection (with the zero-embedding negative), IP-Adapter Plus's
//! resampler on the penultimate hidden states, and whole tiny SD 1.x (text to image, image to
//! image, Plus) and SDXL runs within 2 PNG levels; scale 0 gives the plain pipeline's image and a non-zero
//! scale another; bad weight files are refused with errors naming the file and the fix.

mod common;

use burn::tensor::{Tensor, TensorData};
use common::{assert_png_close, fixtures, model_dir, png_level_diff, Golden, B};
use oxidiff::models::ClipVisionModelWithProjection;
use oxidiff::pipelines::{
    ClipImageProcessor, GenerateRequest, IpAdapter, LoadOptions, StableDiffusionImg2ImgPipeline,
    StableDiffusionPipeline, StableDiffusionXLPipeline, XlRequest,
};

/// Pixels and embeddings are f32 sums over a few dozen terms; 1 and 2 torch threads already
/// differ by about 1e-5 relative (NOTES.md).
const TOL: f32 = 1e-4;

fn adapter_dir() -> std::path::PathBuf {
    fixtures().join("ip-adapter")
}

fn input_image() -> image::DynamicImage {
    image::open(fixtures().join("golden").join("ip-adapter-input.png")).unwrap()
}

fn max_abs_diff(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "sizes differ");
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

fn request(image: Option<image::DynamicImage>) -> GenerateRequest<B> {
    GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 7.5,
        seed: 42,
        ip_adapter_image: image,
        ..Default::default()
    }
}

fn sd1() -> StableDiffusionPipeline<B> {
    StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

fn sd1_png(pipe: &mut StableDiffusionPipeline<B>, req: &GenerateRequest<B>) -> image::RgbImage {
    let out = pipe.generate(req).unwrap();
    out.images.unwrap().to_rgb8(0).unwrap()
}

#[test]
fn clip_image_processor_and_image_encoder_match_transformers() {
    let golden = Golden::load("ip-adapter");
    let (pixels, shape) = golden.host("pixel_values");
    // The processor `load_ip_adapter` makes for a pipeline without a feature extractor.
    let processor = ClipImageProcessor::for_image_size(64);
    let ours = processor
        .preprocess::<B>(&input_image(), &Default::default())
        .unwrap();
    assert_eq!(ours.dims().to_vec(), shape);
    let diff = max_abs_diff(&host(ours), &pixels);
    eprintln!("pixel_values: max difference {diff:e}");
    assert!(diff <= 1e-5, "pixel_values differ by {diff}");

    let device = Default::default();
    let encoder = ClipVisionModelWithProjection::<B>::from_dir_in(
        &adapter_dir().join("image_encoder"),
        burn::tensor::FloatDType::F32,
        &device,
    )
    .unwrap();
    let input = Tensor::<B, 4>::from_data(TensorData::new(pixels, [1, 3, 64, 64]), &device);
    let embeds = encoder.forward(input).unwrap().image_embeds;
    let (expected, shape) = golden.host("image_embeds");
    assert_eq!(embeds.dims().to_vec(), shape);
    let diff = max_abs_diff(&host(embeds), &expected);
    eprintln!("image_embeds: max difference {diff:e}");
    assert!(diff <= TOL, "image_embeds differ by {diff}");
}

#[test]
fn image_tokens_and_zero_negative_match_diffusers() {
    let golden = Golden::load("ip-adapter");
    let mut pipe = sd1();
    pipe.load_ip_adapter(&adapter_dir().join("ip-adapter_sd1.safetensors"), None)
        .unwrap();
    let adapter: &IpAdapter<B> = pipe.ip_adapter.as_ref().unwrap();
    let tokens = adapter.image_tokens(&input_image(), 1, true).unwrap();
    assert_eq!(tokens.dims(), [2, 4, 32]);
    let (uncond, _) = golden.host("sd1.uncond_tokens");
    let (cond, _) = golden.host("sd1.image_tokens");
    let ours = host(tokens);
    let diff = max_abs_diff(&ours[..uncond.len()], &uncond)
        .max(max_abs_diff(&ours[uncond.len()..], &cond));
    eprintln!("image tokens: max difference {diff:e}");
    assert!(diff <= TOL, "image tokens differ by {diff}");
}

#[test]
fn sd1_with_ip_adapter_matches_diffusers_and_scale_zero_is_the_plain_image() {
    let mut pipe = sd1();
    let plain = sd1_png(&mut pipe, &request(None));
    pipe.load_ip_adapter(&adapter_dir().join("ip-adapter_sd1.safetensors"), None)
        .unwrap();
    pipe.set_ip_adapter_scale(0.8).unwrap();
    let ours = sd1_png(&mut pipe, &request(Some(input_image())));
    assert_png_close(&ours, "ip-adapter-sd1.png", 2);
    let changed = png_level_diff(&plain, &ours);
    assert!(
        changed > 10,
        "the image prompt changed the image by only {changed} levels"
    );
    // At scale 0 the image branch is skipped, as in diffusers: the plain pipeline's image.
    pipe.set_ip_adapter_scale(0.0).unwrap();
    let off = sd1_png(&mut pipe, &request(Some(input_image())));
    assert_eq!(png_level_diff(&plain, &off), 0);
    // Unloaded, the request without an image is the plain one again.
    pipe.unload_ip_adapter().unwrap();
    assert_eq!(
        png_level_diff(&plain, &sd1_png(&mut pipe, &request(None))),
        0
    );
}

#[test]
fn ip_adapter_plus_resampler_and_pipeline_match_diffusers() {
    let golden = Golden::load("ip-adapter");
    let mut pipe = sd1();
    let plain = sd1_png(&mut pipe, &request(None));
    pipe.load_ip_adapter(&adapter_dir().join("ip-adapter-plus_sd1.safetensors"), None)
        .unwrap();
    let adapter = pipe.ip_adapter.as_ref().unwrap();
    // The encoder's `hidden_states[-2]`, then the resampler (negative: an all-zero image).
    let (pixels, _) = golden.host("pixel_values");
    let input =
        Tensor::<B, 4>::from_data(TensorData::new(pixels, [1, 3, 64, 64]), &Default::default());
    let hidden = adapter
        .image_encoder
        .penultimate_hidden_state(input)
        .unwrap();
    let (expected, shape) = golden.host("plus.hidden_states");
    assert_eq!(hidden.dims().to_vec(), shape);
    let diff = max_abs_diff(&host(hidden), &expected);
    eprintln!("penultimate hidden states: max difference {diff:e}");
    assert!(diff <= TOL, "hidden states differ by {diff}");
    let tokens = adapter.image_tokens(&input_image(), 1, true).unwrap();
    assert_eq!(tokens.dims(), [2, 6, 32]);
    let (uncond, _) = golden.host("plus.uncond_tokens");
    let (cond, _) = golden.host("plus.image_tokens");
    let ours = host(tokens);
    let diff = max_abs_diff(&ours[..uncond.len()], &uncond)
        .max(max_abs_diff(&ours[uncond.len()..], &cond));
    eprintln!("Plus image tokens: max difference {diff:e}");
    assert!(diff <= TOL, "Plus image tokens differ by {diff}");

    pipe.set_ip_adapter_scale(0.8).unwrap();
    let ours = sd1_png(&mut pipe, &request(Some(input_image())));
    assert_png_close(&ours, "ip-adapter-plus-sd1.png", 2);
    let changed = png_level_diff(&plain, &ours);
    assert!(
        changed > 10,
        "the image prompt changed the image by only {changed} levels"
    );
}

#[test]
fn sd1_img2img_with_ip_adapter_matches_diffusers() {
    let mut pipe = sd1();
    pipe.load_ip_adapter(&adapter_dir().join("ip-adapter_sd1.safetensors"), None)
        .unwrap();
    pipe.set_ip_adapter_scale(0.8).unwrap();
    let mut edit = StableDiffusionImg2ImgPipeline::from(pipe);
    let init = image::open(fixtures().join("golden").join("img2img-input.png")).unwrap();
    let out = edit
        .generate(&request(Some(input_image())), &init, 0.75)
        .unwrap();
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "ip-adapter-sd1-img2img.png",
        2,
    );
}

#[test]
fn sdxl_with_ip_adapter_matches_diffusers() {
    let mut pipe = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    pipe.load_ip_adapter(&adapter_dir().join("ip-adapter_sdxl.safetensors"), None)
        .unwrap();
    pipe.set_ip_adapter_scale(0.8).unwrap();
    let request = XlRequest {
        common: GenerateRequest {
            guidance_scale: 5.0,
            ..request(Some(input_image()))
        },
        xl: Default::default(),
    };
    let out = pipe.generate(&request).unwrap();
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "ip-adapter-sdxl.png",
        2,
    );
}

/// Requests without an image prompt while an adapter is loaded, or with one while none is, are
/// refused; with a ControlNet (which attends to the text alone, the UNet to text and image
/// tokens, as diffusers passes them) the image is diffusers' within 1 level.
#[test]
fn requests_without_image_or_adapter_are_refused_and_controlnet_matches_diffusers() {
    let mut pipe = sd1();
    let err = pipe
        .generate(&request(Some(input_image())))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no IP-Adapter is loaded"), "{err}");
    pipe.load_ip_adapter(&adapter_dir().join("ip-adapter_sd1.safetensors"), None)
        .unwrap();
    let err = pipe.generate(&request(None)).unwrap_err().to_string();
    assert!(err.contains("needs an `ip_adapter_image`"), "{err}");
    pipe.set_ip_adapter_scale(0.8).unwrap();

    use oxidiff::pipelines::{Control, ControlRequest, StableDiffusionControlNetPipeline};
    let net = oxidiff::models::ControlNetModel::<B>::from_dir(
        &model_dir("tiny-controlnet-sd1"),
        None,
        &Default::default(),
    )
    .unwrap();
    let mut controlled = StableDiffusionControlNetPipeline::new(pipe, vec![net]).unwrap();
    let control = ControlRequest {
        controls: vec![Control::new(
            image::open(fixtures().join("golden/controlnet-input.png")).unwrap(),
        )],
        guess_mode: false,
    };
    let out = controlled
        .generate(&request(Some(input_image())), &control)
        .unwrap_or_else(|e| panic!("{e}"));
    // 1 level, not the usual 2: it matches exactly here, and a ControlNet that also attends to
    // the image tokens lands 2 levels off (the tiny ControlNet's text attention is weak).
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "ip-adapter-sd1-controlnet.png",
        1,
    );
}

/// Writes `tensors` (name, shape) of zeros as a safetensors file.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, Vec<usize>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, shape)| vec![0u8; 4 * shape.iter().product::<usize>()])
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape), data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

/// The tensors of the tiny SD 1.x adapter, with their shapes.
fn sd1_adapter_tensors() -> Vec<(String, Vec<usize>)> {
    let weights = oxidiff::models::Weights::from_standalone_file(
        &adapter_dir().join("ip-adapter_sd1.safetensors"),
    )
    .unwrap();
    let mut keys: Vec<String> = weights.keys().map(str::to_string).collect();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let shape = weights.shape(&k).unwrap().to_vec();
            (k, shape)
        })
        .collect()
}

#[test]
fn bad_ip_adapter_files_are_refused_naming_file_and_fix() {
    let mut pipe = sd1();
    let dir = tempfile::tempdir().unwrap();
    let encoder = adapter_dir().join("image_encoder");
    let mut refuse = |file: &std::path::Path| {
        let err = pipe
            .load_ip_adapter(file, Some(&encoder))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&file.display().to_string()), "{err}");
        assert!(pipe.ip_adapter.is_none());
        err
    };

    // A pickle `.bin` (or anything not safetensors).
    let bin = dir.path().join("ip-adapter_sd15.bin");
    std::fs::write(&bin, b"PK\x03\x04 not a safetensors file").unwrap();
    let err = refuse(&bin);
    assert!(err.contains("not a valid safetensors file"), "{err}");

    // The SDXL adapter on SD 1.x: cross-attention widths differ.
    let err = refuse(&adapter_dir().join("ip-adapter_sdxl.safetensors"));
    assert!(err.contains("cross_attention_dim 16"), "{err}");
    assert!(err.contains("made for this base model"), "{err}");

    // One cross-attention pair missing.
    let mut tensors = sd1_adapter_tensors();
    tensors.retain(|(k, _)| !k.starts_with("ip_adapter.5."));
    let missing = dir.path().join("missing.safetensors");
    write_safetensors(&missing, &tensors);
    let err = refuse(&missing);
    assert!(err.contains("has 15 cross-attention"), "{err}");

    // A wrongly shaped key/value projection.
    let mut tensors = sd1_adapter_tensors();
    for (k, shape) in &mut tensors {
        if k == "ip_adapter.3.to_v_ip.weight" {
            shape[0] += 1;
        }
    }
    let shaped = dir.path().join("shape.safetensors");
    write_safetensors(&shaped, &tensors);
    let err = refuse(&shaped);
    assert!(err.contains("ip_adapter.3.to_v_ip.weight"), "{err}");

    // Another kind of file (a LoRA, say).
    let other = dir.path().join("lora.safetensors");
    write_safetensors(&other, &[("lora_unet_down.weight".into(), vec![2, 2])]);
    let err = refuse(&other);
    assert!(err.contains("not an IP-Adapter file"), "{err}");

    // An image encoder folder that is missing.
    let err = pipe
        .load_ip_adapter(
            &adapter_dir().join("ip-adapter_sd1.safetensors"),
            Some(&dir.path().join("nowhere")),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("nowhere"), "{err}");
}

#[test]
fn pipelines_without_ip_adapter_refuse_it() {
    use oxidiff::pipelines::{AutoPipeline, FamilyOptions};
    use oxidiff::schedulers::TorchCpuGenerator;
    let mut pipe = AutoPipeline::<B>::from_dir(
        &model_dir("tiny-sd3"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let err = pipe
        .load_ip_adapter(&adapter_dir().join("ip-adapter_sd1.safetensors"), None, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("IP-Adapter applies to Stable Diffusion"),
        "{err}"
    );
    // An image prompt is refused, not ignored.
    let req = GenerateRequest {
        num_inference_steps: 1,
        ..request(Some(input_image()))
    };
    let mut noise = TorchCpuGenerator::new(0);
    let err = pipe
        .generate_with(&req, &FamilyOptions::default(), &mut noise, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("take no `ip_adapter_image`"), "{err}");
}
