//! Where images go and in what form: no overwrite without `--force`, numbered files, `.npy`.

use crate::common::{model_dir, stderr, txt2img};
use crate::{fails_with, one_step, succeeds, write_npy};

#[test]
fn existing_output_is_not_overwritten_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("keep.png");
    std::fs::write(&out, b"precious").unwrap();
    let result = one_step(&model_dir("tiny-sd1"), &out);
    assert_eq!(result.status.code(), Some(1));
    assert!(stderr(&result).contains("--force"));
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
}

#[test]
fn num_images_into_a_folder_are_numbered_seeded_and_summarised_as_json() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let folder = tmp.path().join("out");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("00004.png"), b"an earlier image").unwrap();
    let result = txt2img(&[
        "--model",
        m,
        "--steps",
        "2",
        "--seed",
        "10",
        "--num-images",
        "3",
        "--json",
        "--quiet",
        "-o",
        folder.to_str().unwrap(),
        "a red apple",
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let summary: serde_json::Value =
        serde_json::from_slice(&result.stdout).expect("--json prints one JSON object");
    let files: Vec<String> = summary["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    let expected: Vec<String> = ["00005.png", "00006.png", "00007.png"]
        .iter()
        .map(|n| folder.join(n).display().to_string())
        .collect();
    assert_eq!(files, expected);
    assert_eq!(summary["seeds"], serde_json::json!([10, 11, 12]));
    assert_eq!(summary["steps"], 2);
    assert_eq!(summary["pipeline"], "StableDiffusionPipeline");
    assert_eq!(summary["generate_seconds"].as_array().unwrap().len(), 3);
    // The earlier file is untouched, and each image is the one its own seed makes alone.
    assert_eq!(
        std::fs::read(folder.join("00004.png")).unwrap(),
        b"an earlier image"
    );
    let params =
        oxidiff::pipelines::GenerationParameters::from_png(&folder.join("00006.png")).unwrap();
    assert_eq!(params.seed, 11);
    let alone = tmp.path().join("alone.png");
    let result = txt2img(&[
        "--model",
        m,
        "--steps",
        "2",
        "--seed",
        "11",
        "--quiet",
        "-o",
        alone.to_str().unwrap(),
        "a red apple",
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    assert_eq!(
        std::fs::read(&alone).unwrap(),
        std::fs::read(folder.join("00006.png")).unwrap()
    );
}

#[test]
fn num_images_beside_a_file_name_never_overwrite_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let out = tmp.path().join("pic.png");
    let args = |force: bool| {
        let mut a = vec![
            "--model",
            m,
            "--steps",
            "1",
            "--seed",
            "3",
            "--num-images",
            "2",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "x",
        ];
        if force {
            a.insert(0, "--force");
        }
        a
    };
    let result = txt2img(&args(false));
    assert!(result.status.success(), "{}", stderr(&result));
    let first = tmp.path().join("pic-0.png");
    assert!(first.is_file() && tmp.path().join("pic-1.png").is_file());
    assert!(!out.exists());
    let before = std::fs::read(&first).unwrap();
    let again = txt2img(&args(false));
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains(&format!("{} already exists", first.display())),
        "{}",
        stderr(&again)
    );
    assert_eq!(std::fs::read(&first).unwrap(), before);
    let forced = txt2img(&args(true));
    assert!(forced.status.success(), "{}", stderr(&forced));

    let latents = tmp.path().join("l.npy");
    write_npy(&latents, &[0.0; 4 * 8 * 8], &[1, 4, 8, 8]);
    let o = tmp.path().join("other.png");
    fails_with(
        &[
            "--model",
            m,
            "--latents",
            latents.to_str().unwrap(),
            "--num-images",
            "2",
            "-o",
            o.to_str().unwrap(),
            "x",
        ],
        "use it with --num-images 1",
        &o,
    );
}

#[test]
fn output_type_npy_holds_the_float_image_of_the_png() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let (png, npy) = (tmp.path().join("a.png"), tmp.path().join("a.npy"));
    let common = ["--model", m, "--steps", "2", "--seed", "9", "--quiet"];
    succeeds(
        &[&common[..], &["-o", png.to_str().unwrap(), "x"]].concat(),
        &[],
    );
    succeeds(
        &[
            &common[..],
            &["--output-type", "npy", "-o", npy.to_str().unwrap(), "x"],
        ]
        .concat(),
        &[],
    );
    let (values, shape) = oxidiff::latents::read_latents(&npy).unwrap();
    assert_eq!(shape, vec![64, 64, 3], "[height, width, 3]");
    assert!(values.iter().all(|v| (0.0..=1.0).contains(v)));
    // The PNG is the array rounded to 8 bits, as diffusers' numpy_to_pil.
    let rgb = image::open(&png).unwrap().to_rgb8();
    for (v, byte) in values.iter().zip(rgb.as_raw()) {
        assert_eq!((v * 255.0).round() as u8, *byte);
    }
    // A .png name for npy output is refused with the fix.
    let wrong = tmp.path().join("b.png");
    fails_with(
        &[
            &common[..],
            &["--output-type", "npy", "-o", wrong.to_str().unwrap(), "x"],
        ]
        .concat(),
        "must name a .npy file",
        &wrong,
    );
}

#[test]
fn output_type_latents_are_the_final_latents_and_feed_latents() {
    use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let folder = tmp.path().join("lat");
    let f = format!("{}/", folder.display());
    succeeds(
        &[
            "--model",
            m,
            "--steps",
            "3",
            "--seed",
            "21",
            "--num-images",
            "2",
            "--output-type",
            "latents",
            "--quiet",
            "-o",
            &f,
            "x",
        ],
        &[],
    );
    // Numbered .npy files, each [1, 4, h/8, w/8].
    let (second, shape) = oxidiff::latents::read_latents(&folder.join("00001.npy")).unwrap();
    assert_eq!(shape, vec![1, 4, 8, 8]);
    // The library's final latents for seed 22 (image 1) on the CLI's backend, bit for bit.
    // `--device cpu` runs on the plain CPU backend.
    let mut pipe = StableDiffusionPipeline::<oxidiff::Cpu>::from_dir(
        &model,
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let out = pipe
        .generate(&GenerateRequest {
            prompts: vec!["x".into()],
            num_inference_steps: 3,
            seed: 22,
            output: oxidiff::pipelines::OutputType::Latents,
            ..Default::default()
        })
        .unwrap();
    assert!(out.images.is_none());
    let expected = out.latents.into_data().to_vec::<f32>().unwrap();
    assert_eq!(second, expected);
    // The file is accepted by --latents (same layout and shape).
    let png = tmp.path().join("from-latents.png");
    let written = folder.join("00000.npy");
    succeeds(
        &[
            "--model",
            m,
            "--steps",
            "1",
            "--latents",
            written.to_str().unwrap(),
            "--quiet",
            "-o",
            png.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(png.is_file());
}
