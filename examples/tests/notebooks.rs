//! Every notebook in `examples/notebooks` runs to the end: `build.rs` turns its code cells into
//! one program (the `notebook` binary), this test runs it and checks that it succeeded and that
//! each image it showed is a real PNG. This stands in for executing the notebooks with evcxr,
//! which would take too long to install in CI.
//!
//! `OXIDIFF_SKIP_PJRT_TESTS=1` skips the notebooks that need the XLA CPU plugin.

use std::path::Path;
use std::process::Command;

/// Notebooks that use a PJRT device.
const NEEDS_PJRT: &[&str] = &["eager_vs_compiled"];

fn notebooks() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("notebooks");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            (path.extension()? == "ipynb")
                .then(|| path.file_stem().unwrap().to_string_lossy().into())
        })
        .collect();
    names.sort();
    names
}

/// The images a run showed: the base64 PNGs between evcxr's content markers.
fn shown_images(stdout: &str) -> Vec<image::RgbImage> {
    let mut images = Vec::new();
    let mut lines = stdout.lines();
    while let Some(line) = lines.next() {
        if line == "EVCXR_BEGIN_CONTENT image/png" {
            let data = lines.next().expect("image data after the begin marker");
            assert_eq!(lines.next(), Some("EVCXR_END_CONTENT"));
            let png = decode_base64(data);
            let image = image::load_from_memory_with_format(&png, image::ImageFormat::Png)
                .expect("a shown image is a valid PNG");
            images.push(image.to_rgb8());
        }
    }
    images
}

fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {:?}", c as char),
    };
    let mut out = Vec::new();
    for chunk in text.trim_end_matches('=').as_bytes().chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | u32::from(value(c)) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

#[test]
fn base64_decoder_inverts_rfc_4648_vectors() {
    assert_eq!(decode_base64("Zm9vYg=="), b"foob");
    assert_eq!(decode_base64("Zm9vYmFy"), b"foobar");
    assert_eq!(decode_base64("+//+"), [0xfb, 0xff, 0xfe]);
}

#[test]
fn every_notebook_runs_and_shows_its_images() {
    let skip_pjrt = std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1");
    let names = notebooks();
    for expected in ["quickstart", "eager_vs_compiled", "scheduler_grid"] {
        assert!(
            names.iter().any(|n| n == expected),
            "missing notebook {expected}"
        );
    }
    for name in &names {
        if skip_pjrt && NEEDS_PJRT.contains(&name.as_str()) {
            eprintln!("skipping {name} (OXIDIFF_SKIP_PJRT_TESTS=1)");
            continue;
        }
        let output = Command::new(env!("CARGO_BIN_EXE_notebook"))
            .arg(name)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "notebook {name} failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
        let images = shown_images(&stdout);
        assert!(
            !images.is_empty(),
            "notebook {name} showed no image:\n{stdout}"
        );
        for image in &images {
            let first = image.get_pixel(0, 0);
            assert!(
                image.pixels().any(|p| p != first),
                "notebook {name} showed a blank {}x{} image",
                image.width(),
                image.height()
            );
        }
        if let Ok(dir) = std::env::var("OXIDIFF_NOTEBOOK_IMAGES") {
            for (i, image) in images.iter().enumerate() {
                image
                    .save(Path::new(&dir).join(format!("{name}-{i}.png")))
                    .unwrap();
            }
        }
    }
}
