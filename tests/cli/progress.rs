//! What the binary reports while it runs, and Ctrl-C.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use oxidiff_test_support::Deadline;

use crate::common::{model_dir, stderr};
use crate::succeeds;

/// How long a child may take to get ready or to stop before it counts as hung and is killed:
/// far beyond a slow machine's time, so it catches hangs without measuring speed.
const HANG: Duration = Duration::from_secs(600);

/// Ctrl-C is sent only once the child reports, on stderr, that the model is loaded or a step
/// is done (`RUST_LOG=info`): the handler is installed by then, and with 1000 steps the run is
/// still denoising. No sleep and no clock: a child that never gets there or never stops is
/// killed after [`HANG`], and the checks of its exit fail.
#[test]
fn ctrl_c_stops_after_the_current_step_writes_nothing_and_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let out = tmp.path().join("out.png");
    let mut child = Command::new(env!("CARGO_BIN_EXE_txt2img"))
        .args([
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "1000",
            "--scheduler",
            "euler",
            "--seed",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "a long run",
        ])
        .env("RUST_LOG", "info")
        .env("HF_HUB_OFFLINE", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("txt2img starts");
    let _deadline = Deadline::kill_child("txt2img before and after Ctrl-C", HANG, child.id());
    // Lines go to the test through a channel, so the whole stderr is kept for the messages.
    let (lines, received) = mpsc::channel();
    let pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut log = Vec::new();
    let ready = received.iter().any(|line: String| {
        let ready = line.contains(" loaded") || line.contains("step=");
        log.push(line);
        ready
    });
    assert!(
        ready,
        "no load or step report before stderr closed:\n{}",
        log.join("\n")
    );
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    reader.join().unwrap();
    log.extend(received.try_iter());
    let msg = log.join("\n");
    assert_eq!(status.code(), Some(130), "{msg}");
    assert!(msg.contains("interrupted after"), "{msg}");
    assert!(msg.contains("of 1000 steps; nothing was written"), "{msg}");
    // No image and no temporary file left behind.
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn quiet_and_non_terminal_stderr_show_no_progress_and_rust_log_adds_events() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let a = tmp.path().join("a.png");
    // stderr is a pipe here: no progress line, but the `wrote` line.
    let msg = succeeds(
        &["--model", m, "--steps", "2", "-o", a.to_str().unwrap(), "x"],
        &[],
    );
    assert!(msg.contains("wrote ") && msg.contains("(seed "), "{msg}");
    assert!(!msg.contains("denoising"), "{msg}");
    let b = tmp.path().join("b.png");
    let msg = succeeds(
        &[
            "--model",
            m,
            "--steps",
            "2",
            "-q",
            "-o",
            b.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(
        msg.trim().is_empty(),
        "--quiet prints nothing on success: {msg}"
    );
    // RUST_LOG=info: structured load events, one per component.
    let c = tmp.path().join("c.png");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_txt2img"));
    cmd.args([
        "--model",
        m,
        "--steps",
        "1",
        "-q",
        "-o",
        c.to_str().unwrap(),
        "x",
    ])
    .env("RUST_LOG", "info");
    let result = cmd.output().unwrap();
    let log = stderr(&result);
    assert!(result.status.success(), "{log}");
    for component in ["tokenizer", "text_encoder", "unet", "vae", "scheduler"] {
        assert!(
            log.contains(&format!("component=\"{component}\"")),
            "{component}: {log}"
        );
    }
    assert!(log.contains("loaded"), "{log}");
}
