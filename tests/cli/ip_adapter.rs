//! `--ip-adapter`, `--ip-adapter-image`, `--ip-adapter-scale` and
//! `--ip-adapter-image-encoder` through txt2img against diffusers' IP-Adapter pipelines
//! (tools/golden/make_ip_adapter.py), the PNG fields `--from-png` reads back, and bad input
//! refused with one-line errors and nothing written.

use std::path::Path;

use crate::common::{assert_png_close, fixtures, model_dir, stderr, txt2img};

/// The golden settings (4 steps, seed 42, negative prompt "blurry") on `model` with
/// `guidance` and `extra` flags into `out`; returns stderr and the exit code.
fn run(model: &str, guidance: &str, out: &Path, extra: &[&str]) -> (String, Option<i32>) {
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

fn adapter(name: &str) -> String {
    fixtures()
        .join("ip-adapter")
        .join(name)
        .display()
        .to_string()
}

fn image() -> String {
    fixtures()
        .join("golden")
        .join("ip-adapter-input.png")
        .display()
        .to_string()
}

#[test]
fn ip_adapter_flags_match_diffusers_for_sd1_and_sdxl() {
    let tmp = tempfile::tempdir().unwrap();
    let image = image();
    let sd1 = tmp.path().join("sd1.png");
    let flags = |file: &str| {
        vec![
            "--ip-adapter".to_string(),
            adapter(file),
            "--ip-adapter-image".into(),
            image.clone(),
            "--ip-adapter-scale".into(),
            "0.8".into(),
        ]
    };
    let sd1_flags = flags("ip-adapter_sd1.safetensors");
    let refs: Vec<&str> = sd1_flags.iter().map(String::as_str).collect();
    let (log, code) = run("tiny-sd1", "7.5", &sd1, &refs);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&sd1).unwrap().to_rgb8(),
        "ip-adapter-sd1.png",
        2,
    );

    // The PNG records the adapter; --from-png needs its files again and restores the scale.
    let again = tmp.path().join("again.png");
    let from_png = |extra: &[&str]| {
        let mut args = vec![
            "--from-png",
            sd1.to_str().unwrap(),
            "--quiet",
            "-o",
            again.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        txt2img(&args)
    };
    let refused = from_png(&[]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    let log = stderr(&refused);
    assert!(
        log.contains(
            "IP-Adapter ip-adapter_sd1.safetensors with the image prompt ip-adapter-input.png"
        ),
        "{log}"
    );
    assert!(!again.exists());
    let sd1_file = adapter("ip-adapter_sd1.safetensors");
    let made = from_png(&["--ip-adapter", &sd1_file, "--ip-adapter-image", &image]);
    assert!(made.status.success(), "{}", stderr(&made));
    assert_eq!(
        image::open(&again).unwrap().to_rgb8(),
        image::open(&sd1).unwrap().to_rgb8()
    );

    // SDXL, with the image encoder folder named explicitly.
    let xl = tmp.path().join("sdxl.png");
    let mut xl_flags = flags("ip-adapter_sdxl.safetensors");
    xl_flags.push("--ip-adapter-image-encoder".into());
    xl_flags.push(adapter("image_encoder"));
    let refs: Vec<&str> = xl_flags.iter().map(String::as_str).collect();
    let (log, code) = run("tiny-sdxl", "5.0", &xl, &refs);
    assert_eq!(code, Some(0), "{log}");
    assert_png_close(
        &image::open(&xl).unwrap().to_rgb8(),
        "ip-adapter-sdxl.png",
        2,
    );
}

#[test]
fn bad_ip_adapter_input_is_refused_with_one_line_and_nothing_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let (sd1, sdxl, image) = (
        adapter("ip-adapter_sd1.safetensors"),
        adapter("ip-adapter_sdxl.safetensors"),
        image(),
    );
    let not_an_image = fixtures().join("golden").join("ip-adapter.json");
    let not_an_image = not_an_image.to_str().unwrap();
    let cases: [(&str, &[&str], i32, &str); 6] = [
        (
            "tiny-sd1",
            &["--ip-adapter-image", &image],
            2,
            "need an --ip-adapter FILE",
        ),
        ("tiny-sd1", &["--ip-adapter", &sd1], 2, "--ip-adapter-image"),
        (
            "tiny-sd1",
            &[
                "--ip-adapter",
                "missing.safetensors",
                "--ip-adapter-image",
                &image,
            ],
            2,
            "missing.safetensors",
        ),
        (
            "tiny-sd1",
            &["--ip-adapter", &sd1, "--ip-adapter-image", not_an_image],
            2,
            "cannot read the --ip-adapter-image",
        ),
        (
            "tiny-sd1",
            &[
                "--ip-adapter",
                &sd1,
                "--ip-adapter-image",
                &image,
                "--ip-adapter-scale",
                "nan",
            ],
            2,
            "--ip-adapter-scale",
        ),
        // The SDXL adapter on SD 1.x: named, with the fix.
        (
            "tiny-sd1",
            &["--ip-adapter", &sdxl, "--ip-adapter-image", &image],
            1,
            "use the IP-Adapter file made for this base model",
        ),
    ];
    for (model, extra, expected, needle) in cases {
        let (log, code) = run(model, "7.5", &out, extra);
        assert_eq!(code, Some(expected), "{extra:?}: {log}");
        assert!(log.contains(needle), "{extra:?}: {log}");
        assert_eq!(log.trim().lines().count(), 1, "{extra:?}: {log}");
        assert!(!out.exists(), "{extra:?} wrote {}", out.display());
    }
}
