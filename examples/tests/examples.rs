//! The runnable examples of `src/bin` run to the end on the tiny test pipeline and write valid
//! images. `OXIDIFF_SKIP_PJRT_TESTS=1` skips the ones that need the XLA CPU plugin.

use std::path::Path;
use std::process::Command;

/// Runs example `exe` in `dir` with `args`; panics with its stderr on failure.
fn run(exe: &str, dir: &Path, args: &[&str]) -> String {
    let out = Command::new(exe)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the example starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{exe} failed:\n{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn assert_png(path: &Path) {
    let image = image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(image.width() > 0 && image.height() > 0);
}

#[test]
fn cpu_examples_write_their_images() {
    let tmp = tempfile::tempdir().unwrap();
    run(env!("CARGO_BIN_EXE_generate"), tmp.path(), &[]);
    assert_png(&tmp.path().join("astronaut.png"));
    run(env!("CARGO_BIN_EXE_custom_scheduler"), tmp.path(), &[]);
    let euler = std::fs::read(tmp.path().join("euler_a.png")).unwrap();
    let unipc = std::fs::read(tmp.path().join("unipc_karras.png")).unwrap();
    assert_png(&tmp.path().join("unipc_karras.png"));
    assert_ne!(euler, unipc, "two schedulers, two images");
    let stdout = run(env!("CARGO_BIN_EXE_lora"), tmp.path(), &[]);
    assert!(stdout.contains("unet layers changed"), "{stdout}");
    let base = std::fs::read(tmp.path().join("base.png")).unwrap();
    let lora = std::fs::read(tmp.path().join("lora.png")).unwrap();
    assert_png(&tmp.path().join("lora.png"));
    assert_ne!(base, lora, "the fused LoRA changes the image");
}

#[test]
fn pjrt_examples_run_eager_and_compiled_on_xla_cpu() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let stdout = run(
        env!("CARGO_BIN_EXE_compiled"),
        tmp.path(),
        &["--device", "xla:cpu"],
    );
    assert_png(&tmp.path().join("compiled.png"));
    // A new prompt, seed and guidance scale reuse the one program.
    assert!(
        stdout.contains("\"a green pear\"") && stdout.contains("programs 1"),
        "{stdout}"
    );
    run(
        env!("CARGO_BIN_EXE_eager_pjrt"),
        tmp.path(),
        &["--device", "xla:cpu"],
    );
    assert_png(&tmp.path().join("eager.png"));
}
