//! A running `oxidiff-server` for the tests (killed when dropped), HTTP calls through ureq, and
//! the `txt2img` binary for reference images.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use base64::Engine;

pub const TINY_SD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-sd1");

pub struct Server {
    pub child: Child,
    pub url: String,
}

impl Server {
    /// `oxidiff-server --model tiny-sd1 --port 0` with `args`, once it listens.
    pub fn start(args: &[&str]) -> Self {
        Self::start_model(TINY_SD, args)
    }

    pub fn start_model(model: &str, args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_oxidiff-server"))
            .args(["--model", model, "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting oxidiff-server");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("listening on ") {
                    let _ = tx.send(url.to_string());
                }
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the server did not print `listening on ...` within 2 minutes");
        Self { child, url }
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Answer {
        post_to(&self.url, path, body)
    }

    pub fn post_raw(&self, path: &str, body: &[u8]) -> Answer {
        answer(
            ureq::post(&format!("{}{path}", self.url))
                .set("Content-Type", "application/json")
                .timeout(Duration::from_secs(300))
                .send_bytes(body),
        )
    }

    pub fn get(&self, path: &str) -> Answer {
        answer(
            ureq::get(&format!("{}{path}", self.url))
                .timeout(Duration::from_secs(60))
                .call(),
        )
    }

    /// The value of the Prometheus sample `name` (with its labels, e.g.
    /// `oxidiff_batches_total{size="4"}`), 0 when absent.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (key, value) = l.rsplit_once(' ')?;
                (key == name).then(|| value.parse().ok())?
            })
            .unwrap_or(0.0)
    }

    /// The address as host:port, for raw sockets.
    pub fn addr(&self) -> String {
        self.url.trim_start_matches("http://").to_string()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A status and a body, for 2xx and error answers alike.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub text: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }
}

/// `POST url + path` with a JSON body (for client threads, which hold no `Server`).
pub fn post_to(url: &str, path: &str, body: &serde_json::Value) -> Answer {
    answer(
        ureq::post(&format!("{url}{path}"))
            .timeout(Duration::from_secs(300))
            .send_json(body.clone()),
    )
}

fn answer(result: Result<ureq::Response, ureq::Error>) -> Answer {
    match result {
        Ok(r) => Answer {
            status: r.status(),
            text: r.into_string().expect("reading the body"),
        },
        Err(ureq::Error::Status(status, r)) => Answer {
            status,
            text: r.into_string().unwrap_or_default(),
        },
        Err(e) => panic!("request failed: {e}"),
    }
}

pub fn unbase64(text: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .expect("base64")
}

/// The `txt2img` binary built beside the server (`cargo test --workspace` builds both).
pub fn txt2img_binary() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_oxidiff-server")).with_file_name("txt2img");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --bin txt2img` (cargo test --workspace does)",
        path.display()
    );
    path
}

/// The PNG files `txt2img` writes for `args` (with `--num-images n`), in order.
pub fn txt2img(args: &[&str], n: usize) -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("ref.png");
    let n_text = n.to_string();
    let status = Command::new(txt2img_binary())
        .args(["--model", TINY_SD, "--quiet", "--num-images", &n_text, "-o"])
        .arg(&out)
        .args(args)
        .status()
        .expect("running txt2img");
    assert!(status.success(), "txt2img {args:?} failed");
    if n == 1 {
        vec![std::fs::read(&out).expect("txt2img's PNG")]
    } else {
        (0..n)
            .map(|i| std::fs::read(dir.path().join(format!("ref-{i}.png"))).expect("PNG"))
            .collect()
    }
}

/// The RGB pixels of a PNG.
pub fn pixels(png: &[u8]) -> Vec<u8> {
    image::load_from_memory(png)
        .expect("a PNG")
        .to_rgb8()
        .into_raw()
}

/// Asserts two PNGs hold the same pixels (0 levels apart) and the same bytes (the same text).
pub fn assert_same_png(got: &[u8], want: &[u8], what: &str) {
    let (a, b) = (pixels(got), pixels(want));
    assert_eq!(a.len(), b.len(), "{what}: image sizes differ");
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0);
    assert_eq!(worst, 0, "{what}: pixels differ by up to {worst} levels");
    assert!(
        got == want,
        "{what}: same pixels, but the PNG bytes (text chunks) differ"
    );
}
