//! `--controlnet`, `--control-image`, the guidance window and `--guess-mode` through txt2img
//! against diffusers' `StableDiffusionControlNetPipeline` (tools/golden/make_controlnet.py) and
//! `StableDiffusionXLControlNetPipeline` (make_controlnet_sdxl.py),
//! the PNG's A1111 ControlNet fields, and bad input refused before the model loads.

use std::path::Path;

use crate::common::{assert_png_close, fixtures, model_dir, stderr, txt2img};

/// The golden settings (4 steps, seed 42, guidance 7.5, negative prompt "blurry") on tiny-sd1
/// with `extra` flags into `out`; returns stderr and the exit code.
fn run(out: &Path, extra: &[&str]) -> (String, Option<i32>) {
    run_on("tiny-sd1", "7.5", out, extra)
}

/// [`run`] on another model folder with another guidance scale.
fn run_on(model: &str, guidance: &str, out: &Path, extra: &[&str]) -> (String, Option<i32>) {
    let model = model_dir(model);
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "4",
        "--seed",
        "42",
        "--guidance",
        guidance,
        "--negative-prompt",
        "blurry",
        "--quiet",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.push("a photo of an astronaut riding a horse");
    let result = txt2img(&args);
    (stderr(&result), result.status.code())
}

fn paths() -> (String, String, String) {
    let image = fixtures().join("golden").join("controlnet-input.png");
    (
        model_dir("tiny-controlnet-sd1").display().to_string(),
        model_dir("tiny-controlnet-sd1-b").display().to_string(),
        image.display().to_string(),
    )
}

#[test]
fn controlnet_flags_match_diffusers_and_are_recorded_in_the_png() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, image) = paths();
    let single = tmp.path().join("single.png");
    let (log, code) = run(&single, &["--controlnet", &a, "--control-image", &image]);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&single).unwrap().to_rgb8(),
        "controlnet-sd1-single.png",
        2,
    );

    // Two ControlNets (the second through its weights file) sharing one window.
    let b_file = format!("{b}/diffusion_pytorch_model.safetensors:0.5");
    let shared = tmp.path().join("shared.png");
    let (log, code) = run(
        &shared,
        &[
            "--controlnet",
            &format!("{a}:0.8"),
            "--control-image",
            &image,
            "--controlnet",
            &b_file,
            "--control-image",
            &image,
            "--control-guidance-start",
            "0.25",
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&shared).unwrap().to_rgb8(),
        "controlnet-sd1-shared.png",
        2,
    );
    let bytes = std::fs::read(&shared).unwrap();
    let text = oxidiff::pipelines::metadata::png_text(&bytes, "parameters")
        .unwrap()
        .unwrap();
    for field in [
        "ControlNet 0: \"Module: none, Model: tiny-controlnet-sd1, Weight: 0.8, Guidance Start: 0.25, Guidance End: 1, Control Mode: Balanced\"",
        "ControlNet 1: \"Module: none, Model: tiny-controlnet-sd1-b, Weight: 0.5,",
    ] {
        assert!(text.contains(field), "{field} missing from {text}");
    }

    let guess = tmp.path().join("guess.png");
    let (log, code) = run(
        &guess,
        &[
            "--controlnet",
            &format!("{a}:0.9"),
            "--control-image",
            &image,
            "--guess-mode",
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&guess).unwrap().to_rgb8(),
        "controlnet-sd1-guess.png",
        2,
    );
}

#[test]
fn bad_controlnet_input_is_one_line_before_anything_is_generated() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, _, image) = paths();
    let out = tmp.path().join("out.png");
    let missing = tmp.path().join("nope.png").display().to_string();
    let not_image = model_dir("tiny-sd1")
        .join("model_index.json")
        .display()
        .to_string();
    let sd2 = model_dir("tiny-sd2").display().to_string();
    let cases: Vec<(Vec<&str>, &str, i32)> = vec![
        (
            vec!["--controlnet", &a],
            "1 --controlnet and 0 --control-image",
            2,
        ),
        (
            vec!["--control-image", &image],
            "--control-image and --guess-mode need a --controlnet",
            2,
        ),
        (
            vec![
                "--controlnet",
                &a,
                "--control-image",
                &image,
                "--control-image",
                &image,
            ],
            "1 --controlnet and 2 --control-image",
            2,
        ),
        (
            vec!["--controlnet", &a, "--control-image", &missing],
            "nope.png",
            2,
        ),
        (
            vec!["--controlnet", &a, "--control-image", &not_image],
            "not an image",
            2,
        ),
        (
            vec![
                "--controlnet",
                &a,
                "--control-image",
                &image,
                "--control-guidance-start",
                "0.8",
                "--control-guidance-end",
                "0.5",
            ],
            "whose start is below its end",
            2,
        ),
        (
            vec![
                "--controlnet",
                &a,
                "--control-image",
                &image,
                "--control-guidance-end",
                "1.5",
            ],
            "inside [0, 1]",
            2,
        ),
        (
            vec!["--controlnet", &sd2, "--control-image", &image],
            "no ControlNet there",
            2,
        ),
    ];
    for (flags, needle, want) in cases {
        let (log, code) = run(&out, &flags);
        assert_eq!(code, Some(want), "{flags:?}: {log}");
        assert!(log.contains(needle), "{flags:?}: {log}");
        assert!(log.lines().count() <= 3, "{log}");
        assert!(!out.exists());
    }
    // A ControlNet of another base model: named after loading, before any step.
    let model = model_dir("tiny-sd2");
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "1",
        "--controlnet",
        &a,
        "--control-image",
        &image,
        "-o",
        out.to_str().unwrap(),
        "x",
    ]);
    let log = stderr(&result);
    assert_eq!(result.status.code(), Some(1), "{log}");
    assert!(log.contains("made for another base model"), "{log}");
    assert!(!out.exists());
}

/// `--from-png` reads the ControlNet fields back: the same two ControlNets, weights, window
/// and mode, found by name in `--model-dir`, with the control images given again (a PNG does
/// not hold them) make the same image bit for bit; without the images, or with a ControlNet
/// that is not in the model folders, it is a usage error naming the fix.
#[test]
fn from_png_reads_the_controlnets_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, image) = paths();
    let first = tmp.path().join("first.png");
    let (log, code) = run(
        &first,
        &[
            "--controlnet",
            &format!("{a}:0.8"),
            "--control-image",
            &image,
            "--controlnet",
            &format!("{b}:0.5"),
            "--control-image",
            &image,
            "--control-guidance-start",
            "0.25",
            "--guess-mode",
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    let again = tmp.path().join("again.png");
    let fixtures_dir = fixtures().display().to_string();
    let from_png = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "--from-png",
            first.to_str().unwrap(),
            "--quiet",
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let result = txt2img(&args);
        (stderr(&result), result.status.code())
    };
    let (log, code) = from_png(
        &again,
        &[
            "--model-dir",
            &fixtures_dir,
            "--control-image",
            &image,
            "--control-image",
            &image,
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(
        image::open(&first).unwrap().to_rgb8().as_raw(),
        image::open(&again).unwrap().to_rgb8().as_raw(),
        "the PNG's ControlNets make its image again"
    );
    let text = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        oxidiff::pipelines::metadata::png_text(&bytes, "parameters")
            .unwrap()
            .unwrap()
    };
    assert_eq!(text(&first), text(&again));

    let (log, code) = from_png(&tmp.path().join("x.png"), &["--model-dir", &fixtures_dir]);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("tiny-controlnet-sd1, tiny-controlnet-sd1-b")
            && log.contains("--control-image"),
        "{log}"
    );
    let model = model_dir("tiny-sd1").display().to_string();
    let (log, code) = from_png(
        &tmp.path().join("y.png"),
        &["--model", &model, "--control-image", &image],
    );
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("ControlNet `tiny-controlnet-sd1`") && log.contains("--model-dir"),
        "{log}"
    );
    assert!(!tmp.path().join("x.png").exists() && !tmp.path().join("y.png").exists());
}

#[test]
fn an_sdxl_folder_takes_sdxl_controlnets_and_refuses_sd1_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let (sd1_net, _, image) = paths();
    let net = format!("{}:0.9", model_dir("tiny-controlnet-sdxl").display());
    let out = tmp.path().join("guess.png");
    let flags = [
        "--controlnet",
        &net,
        "--control-image",
        &image,
        "--guess-mode",
    ];
    let (log, code) = run_on("tiny-sdxl", "5.0", &out, &flags);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&out).unwrap().to_rgb8(),
        "controlnet-sdxl-guess.png",
        2,
    );

    // Compiled on XLA's CPU plugin: the same image, and --dp is refused before loading (--tp
    // is tests/parallel.rs's).
    let compiled = tmp.path().join("compiled.png");
    let mut flags = flags.to_vec();
    flags.extend(["--device", "xla:cpu", "--compile", "--json"]);
    let (log, code) = run_on("tiny-sdxl", "5.0", &compiled, &flags);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&compiled).unwrap().to_rgb8(),
        "controlnet-sdxl-guess.png",
        2,
    );
    flags.extend(["--dp", "2"]);
    let (log, code) = run_on("tiny-sdxl", "5.0", &tmp.path().join("dp.png"), &flags);
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("drop --dp"), "{log}");

    let refused = tmp.path().join("refused.png");
    let flags = ["--controlnet", &sd1_net, "--control-image", &image];
    let (log, code) = run_on("tiny-sdxl", "5.0", &refused, &flags);
    assert_ne!(code, Some(0));
    assert!(log.contains("ControlNet 0"), "{log}");
    assert!(!refused.exists());
}

#[test]
fn an_sd3_folder_takes_sd3_controlnets_by_their_class() {
    let tmp = tempfile::tempdir().unwrap();
    let (sd1_net, _, image) = paths();
    let model = model_dir("tiny-sd3");
    let net = model_dir("tiny-controlnet-sd3");
    let out = tmp.path().join("sd3.png");
    let args = |net: &str, out: &Path| {
        [
            "--model",
            model.to_str().unwrap(),
            "--controlnet",
            net,
            "--control-image",
            &image,
            "--steps",
            "3",
            "--seed",
            "42",
            "--guidance",
            "5.0",
            "--width",
            "48",
            "--height",
            "64",
            "--max-sequence-length",
            "24",
            "--negative-prompt",
            "blurry, low quality",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "A photo of an astronaut riding a horse on the moon",
        ]
        .map(String::from)
        .to_vec()
    };
    let run = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let result = txt2img(&refs);
        (stderr(&result), result.status.code())
    };
    let (log, code) = run(args(net.to_str().unwrap(), &out));
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&out).unwrap().to_rgb8(),
        "controlnet-sd3-single.png",
        2,
    );
    // A UNet ControlNet on SD3: refused, naming both kinds, nothing written.
    let refused = tmp.path().join("refused.png");
    let (log, code) = run(args(&sd1_net, &refused));
    assert_ne!(code, Some(0));
    assert!(log.contains("SD3ControlNetModel"), "{log}");
    assert!(!refused.exists());
}

/// txt2img on tiny-flux-dev with the golden Flux settings, each of `nets` on the control
/// image, into `out`; returns stderr and the exit code.
fn run_flux(nets: &[&str], out: &Path) -> (String, Option<i32>) {
    let (_, _, image) = paths();
    let model = model_dir("tiny-flux-dev");
    let mut args = vec!["--model", model.to_str().unwrap()];
    for net in nets {
        args.extend(["--controlnet", net, "--control-image", &image]);
    }
    args.extend([
        "--steps",
        "4",
        "--seed",
        "42",
        "--guidance",
        "3.5",
        "--width",
        "96",
        "--height",
        "64",
        "--max-sequence-length",
        "24",
        "--quiet",
        "-o",
        out.to_str().unwrap(),
        "A photo of an astronaut riding a horse on the moon",
    ]);
    let result = txt2img(&args);
    (stderr(&result), result.status.code())
}

#[test]
fn a_flux_folder_takes_flux_controlnets_and_refuses_a_mix_of_kinds() {
    let tmp = tempfile::tempdir().unwrap();
    let net = format!("{}:0.9", model_dir("tiny-controlnet-flux").display());
    let sd3_net = model_dir("tiny-controlnet-sd3").display().to_string();
    let run = run_flux;
    let out = tmp.path().join("flux.png");
    let (log, code) = run(&[&net], &out);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&out).unwrap().to_rgb8(),
        "controlnet-flux-single.png",
        2,
    );
    let mixed = tmp.path().join("mixed.png");
    let (log, code) = run(&[&net, &sd3_net], &mixed);
    assert_ne!(code, Some(0));
    assert!(log.contains("another kind of ControlNet"), "{log}");
    assert!(!mixed.exists());
}

/// An XLabs Flux ControlNet works from txt2img (diffusers' image within 2 levels); a
/// ControlNet-Union with several modes is a one-line error, as the flags have no control mode.
#[test]
fn txt2img_takes_xlabs_flux_controlnets_and_asks_unions_for_a_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let xlabs = format!("{}:0.9", model_dir("tiny-controlnet-flux-xlabs").display());
    let out = tmp.path().join("xlabs.png");
    let (log, code) = run_flux(&[&xlabs], &out);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&out).unwrap().to_rgb8(),
        "controlnet-flux-xlabs.png",
        2,
    );
    let union = model_dir("tiny-controlnet-flux-union")
        .display()
        .to_string();
    let refused = tmp.path().join("union.png");
    let (log, code) = run_flux(&[&union], &refused);
    assert_ne!(code, Some(0));
    assert!(
        log.contains(
            "a ControlNet-Union needs a control mode; use the library's Control::control_mode"
        ),
        "{log}"
    );
    assert_eq!(log.trim().lines().count(), 1, "{log}");
    assert!(!refused.exists());
}

/// A ControlNet as one file in lllyasviel's layout (A1111's `control_*.safetensors`; the tiny
/// one needs its config beside it, a released one is configured from its tensors) gives
/// diffusers' image, the PNG names it by its stem, and `--from-png` finds `NAME.safetensors`
/// in a `--model-dir` (also under A1111's `NAME [hash]`).
#[test]
fn a_single_file_controlnet_is_used_recorded_and_found_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, _, image) = paths();
    let nets = tmp.path().join("ControlNet");
    std::fs::create_dir(&nets).unwrap();
    let file = nets.join("control_tiny_canny.safetensors");
    std::fs::copy(
        fixtures().join("single-file/tiny-controlnet-sd1.safetensors"),
        &file,
    )
    .unwrap();
    std::fs::copy(Path::new(&a).join("config.json"), nets.join("config.json")).unwrap();
    let first = tmp.path().join("first.png");
    let (log, code) = run(
        &first,
        &[
            "--controlnet",
            file.to_str().unwrap(),
            "--control-image",
            &image,
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&first).unwrap().to_rgb8(),
        "controlnet-sd1-single.png",
        2,
    );
    let bytes = std::fs::read(&first).unwrap();
    let text = oxidiff::pipelines::metadata::png_text(&bytes, "parameters")
        .unwrap()
        .unwrap();
    assert!(
        text.contains("Model: control_tiny_canny, Weight: 1,"),
        "{text}"
    );

    // A1111 writes the model's short hash after its name.
    let a1111 = tmp.path().join("a1111.png");
    let renamed = text.replace(
        "Model: control_tiny_canny,",
        "Model: control_tiny_canny [d14c016b],",
    );
    let png = image::open(&first).unwrap().to_rgb8();
    let encoded =
        oxidiff::pipelines::metadata::encode_png(&png, &[("parameters", renamed)]).unwrap();
    std::fs::write(&a1111, encoded).unwrap();
    for source in [&first, &a1111] {
        let again = tmp.path().join("again.png");
        let result = txt2img(&[
            "--from-png",
            source.to_str().unwrap(),
            "--model-dir",
            &fixtures().display().to_string(),
            "--model-dir",
            nets.to_str().unwrap(),
            "--control-image",
            &image,
            "--quiet",
            "--force",
            "-o",
            again.to_str().unwrap(),
        ]);
        assert_eq!(result.status.code(), Some(0), "{}", stderr(&result));
        assert_eq!(
            image::open(&first).unwrap().to_rgb8().as_raw(),
            image::open(&again).unwrap().to_rgb8().as_raw(),
            "{}: the PNG's ControlNet file makes its image again",
            source.display()
        );
    }
}
