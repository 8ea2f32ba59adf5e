//! Bad input at the command line (issue 23): usage errors exit 2 before any model loads, sizes
//! are refused before anything is allocated (the child's peak memory is measured), input files
//! that are FIFOs, devices or too large are refused, outputs are created exclusively, and
//! Ctrl-C reports the files it leaves. Each failure is clear, short and writes nothing.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::files_in;

/// Most memory a refused run may use (its peak resident set, in KiB): far below any tensor of
/// the refused size, above what the binary needs to start.
const REFUSAL_RSS_KIB: i64 = 300 * 1024;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-sd1")
}

/// How a child run ended.
struct Ended {
    /// The exit status, `None` when a signal ended it.
    code: Option<i32>,
    stderr: String,
    /// Peak resident set of the child alone (`wait4`'s rusage), KiB.
    peak_rss_kib: i64,
}

impl Ended {
    /// Asserts a clear refusal: `code`, `needle` in a message of at most 3 lines, no panic,
    /// and a peak memory far below what the refused input would take.
    fn refused(&self, code: i32, needle: &str) {
        let msg = &self.stderr;
        assert_eq!(self.code, Some(code), "{msg}");
        assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
        assert!(!msg.contains("panicked"), "{msg}");
        assert!(msg.trim().lines().count() <= 3, "at most 3 lines: {msg}");
        assert!(
            self.peak_rss_kib < REFUSAL_RSS_KIB,
            "peak RSS {} KiB refusing: {msg}",
            self.peak_rss_kib
        );
    }
}

/// Runs `bin` with `args` offline, stdout discarded, and measures the child's peak memory.
// The child is reaped by `wait4` (which reports its own rusage), not `Child::wait`.
#[allow(clippy::zombie_processes)]
fn run(bin: &str, args: &[&str]) -> Ended {
    let mut child = Command::new(bin)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr is piped")
        .read_to_string(&mut stderr)
        .unwrap();
    wait_measured(child.id(), stderr)
}

/// Reaps child `pid` with `wait4`, which reports that child's own resource use.
fn wait_measured(pid: u32, stderr: String) -> Ended {
    let mut status = 0;
    // SAFETY: `rusage` is plain data that wait4 fills; `pid` is our unreaped child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let reaped = unsafe { libc::wait4(pid as i32, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid as i32, "wait4 failed");
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Ended {
        code,
        stderr,
        peak_rss_kib: usage.ru_maxrss,
    }
}

fn txt2img(args: &[&str]) -> Ended {
    run(env!("CARGO_BIN_EXE_txt2img"), args)
}

fn img2img(args: &[&str]) -> Ended {
    run(env!("CARGO_BIN_EXE_img2img"), args)
}

#[test]
fn usage_errors_exit_2_before_the_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.png");
    let o = out.to_str().unwrap();
    // A model that does not exist: a run that got as far as loading would fail with exit 1.
    let m = "/no/such/model";
    for (args, needle) in [
        (vec!["--tp", "2"], "add --compile"),
        (vec!["--dp", "2"], "add --compile"),
        (vec!["--compile"], "--compile needs a PJRT device"),
        (vec!["--width", "60"], "use a width of 56 or 64"),
        (vec!["--height", "0"], "use a height of 8"),
        (vec!["--guidance", "NaN"], "give --guidance a finite number"),
        (vec!["--guidance", "inf"], "give --guidance a finite number"),
        (vec!["--true-cfg-scale", "nan"], "--true-cfg-scale"),
        (vec!["--steps", "0"], "1 to 10000 steps"),
        (vec!["--steps", "1000000000"], "1 to 10000 steps"),
        (vec!["--offload", "vae"], "use `off` or `text-encoders`"),
        (
            vec!["--offload", "text-encoders"],
            "drop --offload, or add a PJRT --device",
        ),
    ] {
        let all = [&["--model", m, "-o", o][..], &args, &["x"]].concat();
        txt2img(&all).refused(2, needle);
        assert!(!out.exists(), "{args:?} wrote a file");
    }
    let image =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/img2img-input.png");
    let i = image.to_str().unwrap();
    for (args, needle) in [
        (vec!["--strength", "NaN"], "--strength must be in (0, 1]"),
        (vec!["--strength", "0"], "--strength must be in (0, 1]"),
        (vec!["--guidance=-inf"], "give --guidance a finite number"),
        (vec!["--compile"], "--compile needs a PJRT device"),
        (vec!["--width", "100"], "use a width of 96 or 104"),
    ] {
        let all = [&["--model", m, "--image", i, "-o", o][..], &args, &["x"]].concat();
        img2img(&all).refused(2, needle);
        assert!(!out.exists(), "{args:?} wrote a file");
    }
}

#[test]
fn huge_sizes_are_refused_before_anything_is_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.png");
    let o = out.to_str().unwrap();
    let model = model();
    let m = model.to_str().unwrap();
    for (w, h) in [
        ("1000000", "1000000"),
        ("4096", "4096"),
        ("18446744073709551608", "18446744073709551608"),
    ] {
        let args = ["--model", m, "--width", w, "--height", h, "-o", o, "x"];
        txt2img(&args).refused(2, "pass --max-pixels");
        assert!(!out.exists());
    }
    // The limit is the user's to raise: 4096x4096 passes the check with --max-pixels (and the
    // output folder check then names the missing folder, still before the model loads).
    let nowhere = tmp.path().join("missing/o.png");
    let args = [
        "--model",
        m,
        "--width",
        "4096",
        "--height",
        "4096",
        "--max-pixels",
        "16777216",
        "-o",
        nowhere.to_str().unwrap(),
        "x",
    ];
    txt2img(&args).refused(1, "does not exist");

    // --from-png sizes and steps are bounded like the flags.
    for (size, steps, needle) in [
        ("100000x100000", "2", "pass --max-pixels"),
        ("64x64", "1000000000000", "1 to 10000 steps"),
    ] {
        let params = oxidiff::pipelines::GenerationParameters::parse(&format!(
            "a cat\nSteps: {steps}, Sampler: Euler, CFG scale: 7, Seed: 1, Size: {size}"
        ))
        .unwrap();
        let png = tmp.path().join("params.png");
        let bytes = oxidiff::pipelines::metadata::encode_png(
            &image::RgbImage::new(8, 8),
            &[("parameters", params.to_text())],
        )
        .unwrap();
        std::fs::write(&png, bytes).unwrap();
        let args = ["--model", m, "--from-png", png.to_str().unwrap(), "-o", o];
        txt2img(&args).refused(2, needle);
        assert!(!out.exists());
    }
}

#[test]
fn fifos_devices_and_oversized_input_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.png");
    let o = out.to_str().unwrap();
    let model = model();
    let m = model.to_str().unwrap();
    let fifo = tmp.path().join("latents.npy");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let zero = tmp.path().join("zero.npy");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let big = tmp.path().join("big.npy");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    for (file, needle) in [
        (&fifo, "FIFO"),
        (&zero, "character device"),
        (&big, "is larger than"),
    ] {
        let args = [
            "--model",
            m,
            "--steps",
            "1",
            "--latents",
            file.to_str().unwrap(),
            "-o",
            o,
            "x",
        ];
        txt2img(&args).refused(1, needle);
        assert!(!out.exists());
    }
    let fifo_png = tmp.path().join("params.png");
    let path = std::ffi::CString::new(fifo_png.to_str().unwrap()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let args = [
        "--model",
        m,
        "--from-png",
        fifo_png.to_str().unwrap(),
        "-o",
        o,
    ];
    txt2img(&args).refused(1, "FIFO");

    // A weight file that is a FIFO is named as such (reading it would block forever).
    let fifo_model = tmp.path().join("fifo-model");
    common::copy_dir(&model, &fifo_model);
    let weights = fifo_model.join("unet/diffusion_pytorch_model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    let path = std::ffi::CString::new(weights.to_str().unwrap()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let args = [
        "--model",
        fifo_model.to_str().unwrap(),
        "--steps",
        "1",
        "-o",
        o,
        "x",
    ];
    let ended = txt2img(&args);
    ended.refused(1, "is a FIFO");
    assert!(
        ended.stderr.contains("diffusion_pytorch_model.safetensors"),
        "{}",
        ended.stderr
    );
}

#[test]
fn a_missing_output_folder_is_one_clean_message_before_the_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("no/such/folder/o.png");
    // The model does not exist either: the output is checked first.
    let args = [
        "--model",
        "/no/such/model",
        "-o",
        out.to_str().unwrap(),
        "x",
    ];
    let ended = txt2img(&args);
    ended.refused(1, "does not exist");
    assert_eq!(
        ended.stderr.matches("No such file").count(),
        0,
        "{}",
        ended.stderr
    );
    let image =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/img2img-input.png");
    let args = [
        "--model",
        "/no/such/model",
        "--image",
        image.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "x",
    ];
    img2img(&args).refused(1, "does not exist");
}

/// Starts a one-step tiny-sd1 run writing to `out` (with `extra` flags).
fn spawn_one_step(out: &Path, extra: &[&str]) -> std::process::Child {
    let model = model();
    Command::new(env!("CARGO_BIN_EXE_txt2img"))
        .args([
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "1",
            "--seed",
            "5",
            "-o",
            out.to_str().unwrap(),
        ])
        .args(extra)
        .arg("x")
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("txt2img starts")
}

#[test]
fn of_two_runs_to_one_path_exactly_one_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("same.png");
    // Both pass the early existence check; the exclusive create decides.
    let a = spawn_one_step(&out, &[]);
    let b = spawn_one_step(&out, &[]);
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let codes = [a.status.code(), b.status.code()];
    let loser = if a.status.success() { &b } else { &a };
    assert_eq!(
        codes.iter().filter(|c| **c == Some(0)).count(),
        1,
        "{codes:?}: {}",
        String::from_utf8_lossy(&loser.stderr)
    );
    let msg = String::from_utf8_lossy(&loser.stderr);
    assert_eq!(loser.status.code(), Some(1), "{msg}");
    assert!(msg.contains("already exists"), "{msg}");
    assert_eq!(files_in(tmp.path()), vec!["same.png".to_string()]);
    image::open(&out).expect("the winner's PNG is whole");
}

#[test]
fn concurrent_runs_into_one_folder_number_their_files_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("out/");
    std::fs::create_dir(&dir).unwrap();
    let runs: Vec<_> = (0..2)
        .map(|_| spawn_one_step(&dir, &["--num-images", "2"]))
        .collect();
    for run in runs {
        let ended = run.wait_with_output().unwrap();
        assert!(
            ended.status.success(),
            "{}",
            String::from_utf8_lossy(&ended.stderr)
        );
    }
    assert_eq!(
        files_in(&dir),
        ["00000.png", "00001.png", "00002.png", "00003.png"]
    );
}

#[test]
// The child is reaped by `wait4`, as in `run`.
#[allow(clippy::zombie_processes)]
fn ctrl_c_reports_the_files_written_so_far() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model();
    let dir = tmp.path().join("out/");
    // Enough steps that the second image is still denoising when the signal arrives.
    let mut child = Command::new(env!("CARGO_BIN_EXE_txt2img"))
        .args([
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "100",
            "--scheduler",
            "euler",
            "--seed",
            "1",
            "--num-images",
            "3",
            "-o",
            dir.to_str().unwrap(),
            "a long run",
        ])
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("txt2img starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    // Each `wrote` line is printed as its file appears: interrupt after the first.
    for line in lines.by_ref() {
        let line = line.unwrap();
        let wrote = line.starts_with("wrote ");
        seen.push(line);
        if wrote {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.starts_with("wrote ")),
        "{seen:?}"
    );
    let first = dir.join("00000.png");
    assert!(first.is_file(), "the file exists when its line is printed");
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    seen.extend(lines.map(|l| l.unwrap()));
    let ended = wait_measured(child.id(), String::new());
    let msg = seen.join("\n");
    assert_eq!(ended.code, Some(130), "{msg}");
    assert_eq!(
        seen.iter().filter(|l| l.starts_with("wrote ")).count(),
        1,
        "{msg}"
    );
    assert!(msg.contains("1 of 3 files were written"), "{msg}");
    assert!(msg.contains("00000.png"), "{msg}");
    assert_eq!(files_in(&dir), ["00000.png"], "{msg}");
}

#[test]
fn png_metadata_names_the_model_and_latents_file_and_img2img_pngs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model();
    let out = tmp.path().join("a.png");
    let latents = tmp.path().join("start.npy");
    std::fs::write(
        &latents,
        oxidiff::latents::encode_npy(&vec![0.5; 4 * 8 * 8], &[1, 4, 8, 8]),
    )
    .unwrap();
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "1",
        "--latents",
        latents.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "x",
    ];
    let ended = txt2img(&args);
    assert_eq!(ended.code, Some(0), "{}", ended.stderr);
    let params = oxidiff::pipelines::GenerationParameters::from_png(&out).unwrap();
    assert_eq!(params.model, "tiny-sd1", "the folder's name, not its path");
    let field = |key: &str| {
        params
            .extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(field("Latents").as_deref(), Some("start.npy"));
    // --from-png says it cannot make those latents again.
    let again = tmp.path().join("b.png");
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--from-png",
        out.to_str().unwrap(),
        "-o",
        again.to_str().unwrap(),
    ];
    let ended = txt2img(&args);
    assert_eq!(ended.code, Some(0), "{}", ended.stderr);
    assert!(
        ended.stderr.contains("pass --latents FILE"),
        "{}",
        ended.stderr
    );

    // An image img2img made is refused with a pointer to img2img.
    let mut edited = params.clone();
    edited.extra = vec![("Denoising strength".into(), "0.75".into())];
    let png = tmp.path().join("edited.png");
    let bytes = oxidiff::pipelines::metadata::encode_png(
        &image::RgbImage::new(8, 8),
        &[("parameters", edited.to_text())],
    )
    .unwrap();
    std::fs::write(&png, bytes).unwrap();
    let third = tmp.path().join("c.png");
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--from-png",
        png.to_str().unwrap(),
        "-o",
        third.to_str().unwrap(),
    ];
    txt2img(&args).refused(1, "use img2img with --image and --strength 0.75");
    assert!(!third.exists());
}

/// A copy of the tiny pipeline with one field of one component's config replaced.
fn with_config(
    tmp: &Path,
    name: &str,
    file: &str,
    field: &str,
    value: serde_json::Value,
) -> PathBuf {
    let dir = tmp.join(name);
    common::copy_dir(&model(), &dir);
    let path = dir.join(file);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config[field] = value;
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn absurd_config_sizes_are_refused_before_anything_is_built() {
    use serde_json::json;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.png");
    let o = out.to_str().unwrap();
    let cases = [
        // A timestep table of 2.5e9 entries, then an abort (before: SIGABRT).
        (
            "channels",
            "unet/config.json",
            "block_out_channels",
            json!([5_000_000_000u64, 16, 32, 32]),
            "`block_out_channels: 5000000000`",
        ),
        // The default image size from it, overflowing the latents' size (before: a panic).
        (
            "sample",
            "unet/config.json",
            "sample_size",
            json!(1_000_000_000u64),
            "`sample_size: 1000000000`",
        ),
        (
            "vae",
            "vae/config.json",
            "latent_channels",
            json!(4_000_000_000u64),
            "`latent_channels: 4000000000`",
        ),
        (
            "clip",
            "text_encoder/config.json",
            "max_position_embeddings",
            json!(1u64 << 40),
            "`max_position_embeddings: 1099511627776`",
        ),
        // Tables of 1e9 and 1e12 entries (before: 6 GB and growing; an abort).
        (
            "timesteps",
            "scheduler/scheduler_config.json",
            "num_train_timesteps",
            json!(1_000_000_000u64),
            "num_train_timesteps",
        ),
        (
            "timesteps12",
            "scheduler/scheduler_config.json",
            "num_train_timesteps",
            json!(1_000_000_000_000u64),
            "num_train_timesteps",
        ),
    ];
    for (name, file, field, value, needle) in cases {
        let dir = with_config(tmp.path(), name, file, field, value);
        let ended = txt2img(&[
            "--model",
            dir.to_str().unwrap(),
            "--steps",
            "2",
            "-o",
            o,
            "x",
        ]);
        ended.refused(1, needle);
        // The message names the file to fix.
        assert!(
            ended.stderr.contains(file.split('/').next().unwrap()),
            "{}",
            ended.stderr
        );
        assert!(!out.exists());
    }
}

/// The transformer and T5 configs are bounded as the UNet's, VAE's and CLIP's are: each absurd
/// size is refused when the config is read, naming the file and the field, before a layer
/// exists (before, `from_file` accepted them and the model's build allocated them).
#[test]
fn absurd_transformer_and_t5_config_sizes_are_refused_when_read() {
    use oxidiff::models::{
        FluxTransformer2DConfig, ModelError, PixArtTransformer2DConfig, SD3Transformer2DConfig,
        T5Config,
    };
    use serde_json::json;
    type Read = fn(&Path) -> Result<(), ModelError>;
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let flux: Read = |p| FluxTransformer2DConfig::from_file(p).map(drop);
    let sd3: Read = |p| SD3Transformer2DConfig::from_file(p).map(drop);
    let pixart: Read = |p| PixArtTransformer2DConfig::from_file(p).map(drop);
    let t5: Read = |p| T5Config::from_file(p).map(drop);
    let big = json!(1u64 << 40);
    let cases: [(&str, Read, &str, serde_json::Value, &str); 8] = [
        (
            "tiny-flux-dev/transformer",
            flux,
            "num_layers",
            json!(100_000),
            "`num_layers: 100000`",
        ),
        (
            "tiny-flux-dev/transformer",
            flux,
            "attention_head_dim",
            json!(1u64 << 21),
            "num_attention_heads * attention_head_dim",
        ),
        (
            "tiny-flux-dev/transformer",
            flux,
            "joint_attention_dim",
            big.clone(),
            "`joint_attention_dim: 1099511627776`",
        ),
        (
            "tiny-sd3/transformer",
            sd3,
            "pos_embed_max_size",
            json!(1_000_000),
            "`pos_embed_max_size: 1000000`",
        ),
        (
            "tiny-sd3/transformer",
            sd3,
            "caption_projection_dim",
            big.clone(),
            "`caption_projection_dim",
        ),
        (
            "tiny-pixart-alpha/transformer",
            pixart,
            "sample_size",
            json!(1_000_000_000),
            "`sample_size: 1000000000`",
        ),
        (
            "tiny-flux-dev/text_encoder_2",
            t5,
            "d_ff",
            big.clone(),
            "`d_ff: 1099511627776`",
        ),
        (
            "tiny-flux-dev/text_encoder_2",
            t5,
            "vocab_size",
            big,
            "`vocab_size: 1099511627776`",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (i, (folder, read, field, value, needle)) in cases.into_iter().enumerate() {
        let original = fixtures.join(folder).join("config.json");
        read(&original).unwrap_or_else(|e| panic!("{folder}: the fixture reads: {e}"));
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&original).unwrap()).unwrap();
        config[field] = value;
        let path = tmp.path().join(format!("config-{i}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        let err = read(&path).expect_err(field).to_string();
        assert!(
            err.contains(needle) && err.contains(&format!("config-{i}.json")),
            "{folder} {field}: {err}"
        );
    }
}

#[test]
fn a_transformer_gguf_runs_flux_and_bad_ones_are_refused() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let gguf = fixtures.join("tiny-flux-gguf/flux-Q4_K.gguf");
    let tmp = tempfile::tempdir().unwrap();
    // schnell's folder with the GGUF transformer's config (its weights stay unread).
    let flux = tmp.path().join("flux");
    common::copy_dir(&fixtures.join("tiny-flux-schnell"), &flux);
    std::fs::copy(
        fixtures.join("tiny-flux-gguf/transformer/config.json"),
        flux.join("transformer/config.json"),
    )
    .unwrap();
    let out = tmp.path().join("o.png");
    let base = [
        "--model",
        flux.to_str().unwrap(),
        "a lighthouse",
        "--steps",
        "1",
        "--width",
        "32",
        "--height",
        "32",
        "--output",
        out.to_str().unwrap(),
    ];
    let with = |transformer: &Path, model: Option<&Path>| {
        let mut args: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        if let Some(m) = model {
            args[1] = m.to_str().unwrap().to_string();
        }
        args.extend(["--transformer".into(), transformer.to_str().unwrap().into()]);
        txt2img(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    // The tiny-flux-gguf transformer is built for schnell's text encoders: a real run.
    let ended = with(&gguf, None);
    assert_eq!(ended.code, Some(0), "{}", ended.stderr);
    let image = image::open(&out).unwrap();
    assert_eq!((image.width(), image.height()), (32, 32));
    std::fs::remove_file(&out).unwrap();
    // A safetensors file is no GGUF; a file that is cut short; a pipeline without a transformer.
    let not_gguf =
        fixtures.join("tiny-flux-schnell/transformer/diffusion_pytorch_model.safetensors");
    with(&not_gguf, None).refused(1, "not a GGUF file");
    let short = tmp.path().join("short.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&short, &bytes[..bytes.len() / 2]).unwrap();
    with(&short, None).refused(1, "truncated");
    with(&gguf, Some(&model())).refused(1, "cannot take one");
    assert!(!out.exists(), "a refused run writes nothing");
}
