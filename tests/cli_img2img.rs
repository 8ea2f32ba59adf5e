//! The `img2img` binary's inpainting (`--mask`) and SDXL dispatch (a refiner with only
//! `text_encoder_2` too): each run's PNG matches diffusers' (`tools/golden/make_inpaint.py`,
//! `make_refiner.py`) within 2 levels, the pipeline is picked from
//! `model_index.json`; a mask of another size, an unreadable mask and a bad strength are
//! errors that write nothing; `--ip-adapter` steers image to image as diffusers' IP-Adapter
//! (`make_ip_adapter.py`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{copy_dir, fixtures, model_dir};

const PROMPT: &str = "a photo of an astronaut riding a horse";

fn img2img(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_img2img"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("img2img runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn golden(name: &str) -> PathBuf {
    fixtures().join("golden").join(name)
}

/// Runs the binary on the golden input (4 steps, seed 42, negative prompt "blurry") with
/// `extra` flags and checks its PNG against diffusers' `expected`; returns stderr.
fn check(model: &Path, extra: &[&str], expected: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let input = golden("img2img-input.png");
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--image",
        input.to_str().unwrap(),
        "--steps",
        "4",
        "--seed",
        "42",
        "--negative-prompt",
        "blurry",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.push(PROMPT);
    let result = img2img(&args);
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, expected, 2);
    stderr(&result)
}

#[test]
fn mask_inpaints_with_an_ordinary_unet_as_diffusers() {
    let mask = golden("inpaint-mask.png");
    // SD inpainting's default strength is 1, as diffusers'.
    check(
        &model_dir("tiny-sd1"),
        &["--mask", mask.to_str().unwrap()],
        "inpaint-sd4-pndm.png",
    );
}

#[test]
fn mask_inpaints_with_a_nine_channel_inpainting_checkpoint_as_diffusers() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny-sd1-inpainting");
    copy_dir(&model_dir("tiny-sd1"), &model);
    std::fs::remove_dir_all(model.join("unet")).unwrap();
    copy_dir(
        &fixtures().join("tiny-sd1-inpaint-unet"),
        &model.join("unet"),
    );
    let index_path = model.join("model_index.json");
    let index = std::fs::read_to_string(&index_path).unwrap().replace(
        "\"StableDiffusionPipeline\"",
        "\"StableDiffusionInpaintPipeline\"",
    );
    std::fs::write(&index_path, index).unwrap();
    let mask = golden("inpaint-mask.png");
    check(
        &model,
        &[
            "--mask",
            mask.to_str().unwrap(),
            "--strength",
            "0.75",
            "--scheduler",
            "euler",
        ],
        "inpaint-sd9-euler.png",
    );
}

#[test]
fn sdxl_checkpoints_go_to_the_sdxl_img2img_and_inpaint_pipelines() {
    let model = model_dir("tiny-sdxl");
    // SDXL's default guidance is 5, as in the golden runs.
    let log = check(&model, &["--strength", "0.6"], "inpaint-xl-img2img.png");
    assert!(
        log.contains("StableDiffusionXLImg2ImgPipeline, ") && log.contains("eager"),
        "{log}"
    );
    // diffusers' SDXL inpainting defaults to guidance 7.5; the golden run took 5.
    let mask = golden("inpaint-mask.png");
    let mask = mask.to_str().unwrap();
    check(
        &model,
        &["--mask", mask, "--strength", "0.8", "--guidance", "5"],
        "inpaint-xl-inpaint.png",
    );
    // Without --guidance and --strength, each pipeline takes diffusers' own defaults.
    let tmp = tempfile::tempdir().unwrap();
    let input = golden("img2img-input.png");
    for (extra, guidance, strength) in [
        (&[][..], 5.0, "0.3"),
        (&["--mask", mask][..], 7.5, "0.9999"),
    ] {
        let out = tmp.path().join("defaults.png");
        let mut args = vec!["--model", model.to_str().unwrap(), "--image"];
        args.extend([input.to_str().unwrap(), "--steps", "4", "-o"]);
        args.extend([out.to_str().unwrap(), PROMPT]);
        args.extend_from_slice(extra);
        let result = img2img(&args);
        assert!(result.status.success(), "{}", stderr(&result));
        let params = oxidiff::pipelines::GenerationParameters::from_png(&out).unwrap();
        assert_eq!(params.guidance_scale, guidance, "{extra:?}");
        let recorded = params.extra.iter().find(|(k, _)| k == "Denoising strength");
        assert_eq!(
            recorded.map(|(_, v)| v.as_str()),
            Some(strength),
            "{extra:?}"
        );
        std::fs::remove_file(&out).unwrap();
    }
}

/// stabilityai's refiner layout: no first text encoder (`text_encoder: [null, null]`), only
/// `text_encoder_2` (`tools/golden/make_refiner.py`).
#[test]
fn a_refiner_with_only_text_encoder_2_loads_and_matches_diffusers() {
    let log = check(
        &model_dir("tiny-sdxl-refiner"),
        &[
            "--strength",
            "0.6",
            "--aesthetic-score",
            "7",
            "--negative-aesthetic-score",
            "2",
        ],
        "refiner-xl-refiner-te2-image.png",
    );
    assert!(log.contains("StableDiffusionXLImg2ImgPipeline, "), "{log}");
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let log = check(
        &model_dir("tiny-sdxl-refiner"),
        &[
            "--strength",
            "0.6",
            "--aesthetic-score",
            "7",
            "--negative-aesthetic-score",
            "2",
            "--device",
            "xla:cpu",
            "--compile",
        ],
        "refiner-xl-refiner-te2-image.png",
    );
    assert!(log.contains("compiled: 1 program(s)"), "{log}");
}

#[test]
fn bad_masks_and_strengths_are_errors_that_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let input = golden("img2img-input.png");
    let small = tmp.path().join("small-mask.png");
    image::RgbImage::new(32, 64).save(&small).unwrap();
    let broken = tmp.path().join("broken-mask.png");
    std::fs::write(&broken, b"not a png").unwrap();
    let mask = golden("inpaint-mask.png");
    let model = model_dir("tiny-sd1");
    let cases: [(&Path, &str, &str); 3] = [
        (&small, "1", "is 32x64 but the image"),
        (&broken, "1", "cannot read the mask"),
        (&mask, "0", "strength must be in (0, 1]"),
    ];
    for (mask, strength, expected) in cases {
        let result = img2img(&[
            "--model",
            model.to_str().unwrap(),
            "--image",
            input.to_str().unwrap(),
            "--mask",
            mask.to_str().unwrap(),
            "--strength",
            strength,
            "--steps",
            "2",
            "-o",
            out.to_str().unwrap(),
            PROMPT,
        ]);
        assert!(!result.status.success());
        let err = stderr(&result);
        assert!(err.contains(expected), "{}: {err}", mask.display());
        if expected != "strength must be in (0, 1]" {
            let name = mask.file_name().unwrap().to_str().unwrap();
            assert!(err.contains(name), "the error names the mask file: {err}");
        }
        assert!(!out.exists(), "nothing is written on bad input");
    }
}

/// `--device xla:cpu --compile` inpaints with the guided UNet call as one XLA program (the
/// masked-latent blend eager): the PNG is diffusers' within 2 levels (the plugin and burn-flex
/// differ by about 1e-6).
#[test]
fn compiled_inpainting_on_xla_cpu_matches_diffusers_png() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let mask = golden("inpaint-mask.png");
    let log = check(
        &model_dir("tiny-sd1"),
        &[
            "--mask",
            mask.to_str().unwrap(),
            "--device",
            "xla:cpu",
            "--compile",
        ],
        "inpaint-sd4-pndm.png",
    );
    assert!(
        log.contains("StableDiffusionInpaintPipeline") && log.contains("compiled: 1 program(s)"),
        "{log}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let input = golden("img2img-input.png");
    let result = img2img(&[
        "--model",
        model_dir("tiny-sd1").to_str().unwrap(),
        "--image",
        input.to_str().unwrap(),
        "--compile",
        "-o",
        out.to_str().unwrap(),
        PROMPT,
    ]);
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("--compile needs a PJRT device"),
        "{}",
        stderr(&result)
    );
    assert!(!out.exists());
}

#[test]
fn lora_flag_fuses_like_diffusers_and_is_recorded_in_the_png() {
    // tools/golden/make_lora_dit.py: make_img2img.py's run (strength 0.75, PNDM) with
    // make_lora.py's kohya LoRA fused at 0.75.
    let lora = fixtures().join("lora/tiny-sd1-kohya.safetensors");
    let spec = format!("{}:0.75", lora.display());
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let input = golden("img2img-input.png");
    let model = model_dir("tiny-sd1");
    let base = [
        "--model",
        model.to_str().unwrap(),
        "--image",
        input.to_str().unwrap(),
        "--strength",
        "0.75",
        "--steps",
        "4",
        "--seed",
        "42",
        "--negative-prompt",
        "blurry",
    ];
    let mut args = base.to_vec();
    args.extend(["--lora", &spec, "-o", out.to_str().unwrap(), PROMPT]);
    let result = img2img(&args);
    assert!(result.status.success(), "{}", stderr(&result));
    assert!(
        stderr(&result).contains("fused LoRA"),
        "{}",
        stderr(&result)
    );
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, "tiny-sd1-lora-img2img.png", 2);
    let params = oxidiff::pipelines::GenerationParameters::from_png(&out).unwrap();
    assert_eq!(
        params.prompt,
        format!("{PROMPT} <lora:tiny-sd1-kohya:0.75>")
    );
    assert!(params.extra.iter().any(|(k, _)| k == "Lora hashes"));

    // an SD 1.x LoRA on SDXL is an error naming the file; nothing is written
    let bad = tmp.path().join("bad.png");
    let xl = model_dir("tiny-sdxl");
    let mut args = base.to_vec();
    args[1] = xl.to_str().unwrap();
    args.extend(["--lora", &spec, "-o", bad.to_str().unwrap(), PROMPT]);
    let result = img2img(&args);
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("tiny-sd1-kohya.safetensors")
            && stderr(&result).contains("do not match this model"),
        "{}",
        stderr(&result)
    );
    assert!(!bad.exists());
}

#[test]
fn controlnet_flags_steer_image_to_image_and_inpainting_as_diffusers() {
    // tools/golden/make_controlnet.py: strength 0.75, the first ControlNet at 0.8 over [0, 0.8].
    let model = common::model_dir("tiny-sd1");
    let net = format!("{}:0.8", common::model_dir("tiny-controlnet-sd1").display());
    let control = golden("controlnet-input.png");
    let mask = golden("inpaint-mask.png");
    let flags = [
        "--strength",
        "0.75",
        "--controlnet",
        &net,
        "--control-image",
        control.to_str().unwrap(),
        "--control-guidance-end",
        "0.8",
    ];
    let log = check(&model, &flags, "controlnet-sd1-img2img.png");
    assert!(
        log.contains("StableDiffusionControlNetImg2ImgPipeline"),
        "{log}"
    );
    let with_mask = [&flags[..], &["--mask", mask.to_str().unwrap()]].concat();
    let log = check(&model, &with_mask, "controlnet-sd1-inpaint.png");
    assert!(
        log.contains("StableDiffusionControlNetInpaintPipeline"),
        "{log}"
    );
    // SDXL (tools/golden/make_controlnet_sdxl.py: the same settings, guidance 5.0, diffusers'
    // default for both SDXL ControlNet editing pipelines).
    let model = common::model_dir("tiny-sdxl");
    let net = format!(
        "{}:0.8",
        common::model_dir("tiny-controlnet-sdxl").display()
    );
    let flags = [&flags[..3], &[net.as_str()], &flags[4..]].concat();
    let log = check(&model, &flags, "controlnet-sdxl-img2img.png");
    assert!(
        log.contains("StableDiffusionXLControlNetImg2ImgPipeline"),
        "{log}"
    );
    let with_mask = [&flags[..], &["--mask", mask.to_str().unwrap()]].concat();
    let log = check(&model, &with_mask, "controlnet-sdxl-inpaint.png");
    assert!(
        log.contains("StableDiffusionXLControlNetInpaintPipeline"),
        "{log}"
    );
}

#[test]
fn ip_adapter_flags_steer_image_to_image_as_diffusers() {
    // tools/golden/make_ip_adapter.py: the SD 1.x adapter at scale 0.8, strength 0.75.
    let adapter = fixtures()
        .join("ip-adapter")
        .join("ip-adapter_sd1.safetensors");
    let image = golden("ip-adapter-input.png");
    check(
        &model_dir("tiny-sd1"),
        &[
            "--strength",
            "0.75",
            "--guidance",
            "7.5",
            "--ip-adapter",
            adapter.to_str().unwrap(),
            "--ip-adapter-image",
            image.to_str().unwrap(),
            "--ip-adapter-scale",
            "0.8",
        ],
        "ip-adapter-sd1-img2img.png",
    );
}
