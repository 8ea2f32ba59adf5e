//! The compile cache across processes: a second `txt2img` on an XLA device compiles nothing,
//! eager or compiled, and makes the same image.

use crate::common::{model_dir, stderr, txt2img_env};

/// `txt2img --json` on xla:cpu with the compile cache in `cache`: the summary and the PNG.
fn run(
    cache: &std::path::Path,
    out: &std::path::Path,
    extra: &[&str],
) -> (serde_json::Value, Vec<u8>) {
    let model = model_dir("tiny-sd1");
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--device",
        "xla:cpu",
        "--steps",
        "2",
        "--seed",
        "3",
        "--json",
        "--quiet",
        "--force",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.push("a lighthouse");
    let result = txt2img_env(&args, &[("OXIDIFF_COMPILE_CACHE", cache)]);
    assert!(result.status.success(), "{}", stderr(&result));
    let stdout = String::from_utf8_lossy(&result.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let summary = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    (summary, std::fs::read(out).unwrap())
}

#[test]
fn a_second_process_compiles_nothing_eager_or_compiled() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    for extra in [&[][..], &["--compile"][..]] {
        let cache = tmp.path().join(format!("cache{}", extra.len()));
        let (first, first_png) = run(&cache, &out, extra);
        let (second, second_png) = run(&cache, &out, extra);
        let eager = |s: &serde_json::Value, field: &str| s["eager_ops"][field].as_u64().unwrap();
        assert!(eager(&first, "xla_compiles") > 0, "{extra:?}: {first}");
        assert_eq!(eager(&second, "xla_compiles"), 0, "{extra:?}: {second}");
        assert!(eager(&second, "disk_loads") > 0, "{extra:?}: {second}");
        assert_eq!(eager(&second, "disk_rejects"), 0, "{extra:?}: {second}");
        if extra.is_empty() {
            assert!(second["compiled"].is_null(), "{second}");
        } else {
            assert!(
                first["compiled"]["xla_compiles"].as_u64().unwrap() > 0,
                "{first}"
            );
            assert_eq!(second["compiled"]["xla_compiles"], 0, "{second}");
            assert!(
                second["compiled"]["disk_loads"].as_u64().unwrap() > 0,
                "{second}"
            );
        }
        assert!(
            first_png == second_png,
            "{extra:?}: the cached executables changed the image"
        );
    }
}
