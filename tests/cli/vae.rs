//! `--vae-tile-size` and `--vae-slicing`: tiled decoding through the whole txt2img run against
//! diffusers' tiled output (tools/golden/make_vae_tiling.py), slicing equal to the batch, and
//! tile sizes that do not fit refused with nothing written.

use std::path::Path;

use crate::common::{assert_png_close, model_dir, png_level_diff, stderr, txt2img};

/// A 128x128 run of the golden settings (4 steps, seed 42, negative prompt "blurry", the
/// folder's scheduler and default guidance) with `extra` flags into `out`.
fn run(fixture: &str, out: &Path, extra: &[&str]) {
    let model = model_dir(fixture);
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "4",
        "--seed",
        "42",
        "--width",
        "128",
        "--height",
        "128",
        "--negative-prompt",
        "blurry",
        "--quiet",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.push("a photo of an astronaut riding a horse");
    let result = txt2img(&args);
    assert!(result.status.success(), "{}", stderr(&result));
}

#[test]
fn tiled_decode_matches_diffusers_tiled_output_for_sd1_and_sdxl() {
    let tmp = tempfile::tempdir().unwrap();
    for fixture in ["sd1", "sdxl"] {
        let golden = format!("vae-tiling-{fixture}.png");
        let tiled = tmp.path().join(format!("{fixture}-tiled.png"));
        run(
            &format!("tiny-{fixture}"),
            &tiled,
            &["--vae-tile-size", "64"],
        );
        let tiled = image::open(&tiled).unwrap().to_rgb8();
        assert_png_close(&tiled, &golden, 2);
        // Without tiles the image is another one: the flag really tiles.
        let whole = tmp.path().join(format!("{fixture}-whole.png"));
        run(&format!("tiny-{fixture}"), &whole, &[]);
        let whole = image::open(&whole).unwrap().to_rgb8();
        assert!(png_level_diff(&whole, &tiled) > 4, "{fixture}");
    }
}

#[test]
fn sliced_decode_of_a_batch_equals_the_batch_and_bad_tiles_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (batch, sliced) = (tmp.path().join("batch.png"), tmp.path().join("sliced.png"));
    let two = ["--num-images", "2", "--batch-size", "2"];
    run("tiny-sd1", &batch, &two);
    run(
        "tiny-sd1",
        &sliced,
        &[&two[..], &["--vae-slicing"]].concat(),
    );
    for i in 0..2 {
        let name = |p: &Path| {
            p.with_file_name(format!(
                "{}-{i}.png",
                p.file_stem().unwrap().to_str().unwrap()
            ))
        };
        let a = image::open(name(&batch)).unwrap().to_rgb8();
        let b = image::open(name(&sliced)).unwrap().to_rgb8();
        assert!(png_level_diff(&a, &b) <= 1, "image {i}");
    }

    let model = model_dir("tiny-sd1");
    let out = tmp.path().join("refused.png");
    for size in ["60", "8"] {
        let result = txt2img(&[
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "1",
            "--vae-tile-size",
            size,
            "-o",
            out.to_str().unwrap(),
            "x",
        ]);
        let msg = stderr(&result);
        assert_eq!(result.status.code(), Some(2), "{msg}");
        assert!(
            msg.contains(&format!("--vae-tile-size {size}")) && msg.contains("multiple of 8"),
            "{msg}"
        );
        assert!(!out.exists());
    }
}
