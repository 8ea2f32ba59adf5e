//! Hub ids from a hand-made cache, offline: revisions, `HF_HOME`, variants.

use std::path::Path;

use crate::common::{copy_dir, model_dir, stderr, txt2img_env};
use crate::succeeds;

#[test]
fn hub_id_resolves_from_a_hand_made_cache_offline() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--oxidiff--tiny-sd1");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    copy_dir(&model_dir("tiny-sd1"), &repo.join("snapshots").join(rev));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    let out = cache.path().join("out.png");
    let result = txt2img_env(
        &[
            "--model",
            "oxidiff/tiny-sd1",
            "--steps",
            "1",
            "--seed",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "a red apple",
        ],
        &[("HF_HUB_CACHE", cache.path())],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    assert!(out.is_file());

    let missing = txt2img_env(
        &[
            "--model",
            "oxidiff/not-cached",
            "-o",
            out.to_str().unwrap(),
            "--force",
            "x",
        ],
        &[("HF_HUB_CACHE", cache.path())],
    );
    assert_eq!(missing.status.code(), Some(1));
    let msg = stderr(&missing);
    assert!(msg.contains(&cache.path().display().to_string()), "{msg}");
    assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");
}

/// A Hub cache folder with `org/name` at two commits: `main` -> `a...`, tag `v1` -> `b...`.
fn hand_made_cache(root: &Path) -> (String, String) {
    let repo = root.join("models--oxidiff--tiny");
    let (main, v1) = ("a".repeat(40), "b".repeat(40));
    copy_dir(&model_dir("tiny-sd1"), &repo.join("snapshots").join(&main));
    copy_dir(&model_dir("tiny-sd2"), &repo.join("snapshots").join(&v1));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), &main).unwrap();
    std::fs::write(repo.join("refs/v1"), &v1).unwrap();
    (main, v1)
}

#[test]
fn revision_pins_a_snapshot_and_hf_home_locates_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    let cache = home.join("hub");
    let (_, v1) = hand_made_cache(&cache);
    let run = |model: &str, extra: &[&str], name: &str| {
        let out = tmp.path().join(name);
        let o = out.to_str().unwrap().to_string();
        let args = [
            &[
                "--model", model, "--steps", "1", "--seed", "1", "--quiet", "--json",
            ][..],
            extra,
            &["-o", &o, "x"],
        ]
        .concat();
        let result = txt2img_env(&args, &[("HF_HOME", &home)]);
        assert!(result.status.success(), "{}", stderr(&result));
        image::open(out).unwrap().to_rgb8().into_raw()
    };
    // HF_HOME/hub is the cache when HF_HUB_CACHE is unset; main is tiny-sd1, v1 tiny-sd2.
    let main = run("oxidiff/tiny", &[], "main.png");
    let tagged = run("oxidiff/tiny", &["--revision", "v1"], "v1.png");
    let by_hash = run(&format!("oxidiff/tiny@{v1}"), &[], "hash.png");
    assert_ne!(main, tagged, "--revision v1 must load the other snapshot");
    assert_eq!(
        tagged, by_hash,
        "a tag and its commit hash are the same snapshot"
    );
    let params =
        oxidiff::pipelines::GenerationParameters::from_png(&tmp.path().join("v1.png")).unwrap();
    assert_eq!(params.model, "oxidiff/tiny@v1");

    // An uncached revision offline names the cache folder; both spellings at once are refused.
    let out = tmp.path().join("none.png");
    let o = out.to_str().unwrap();
    let missing = txt2img_env(
        &["--model", "oxidiff/tiny", "--revision", "v2", "-o", o, "x"],
        &[("HF_HOME", &home)],
    );
    assert_eq!(missing.status.code(), Some(1));
    let msg = stderr(&missing);
    assert!(
        msg.contains(&cache.display().to_string()) && msg.contains("HF_HUB_OFFLINE"),
        "{msg}"
    );
    assert_eq!(msg.trim().lines().count(), 1, "one-line error: {msg}");
    let both = txt2img_env(
        &[
            "--model",
            "oxidiff/tiny@v1",
            "--revision",
            "v1",
            "-o",
            o,
            "x",
        ],
        &[("HF_HOME", &home)],
    );
    assert!(
        stderr(&both).contains("give one of them"),
        "{}",
        stderr(&both)
    );
    assert!(!out.exists());
}

#[test]
fn variant_loads_fp16_files_and_falls_back_per_component() {
    let tmp = tempfile::tempdir().unwrap();
    // tiny-sd2 has an fp16 UNet only: the other components load their plain files.
    let model = model_dir("tiny-sd2");
    let out = tmp.path().join("fp16.png");
    succeeds(
        &[
            "--model",
            model.to_str().unwrap(),
            "--variant",
            "fp16",
            "--steps",
            "1",
            "--seed",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(out.is_file());
}
