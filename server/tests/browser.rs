//! The web page in a real headless browser: Debian's chromium, driven through chromedriver's
//! WebDriver protocol. The test types a prompt and a seed, presses Generate, watches the
//! progress bar move and the image arrive, and checks that the image is the one the API gives
//! for the same request. `tools/fetch-chromium.sh` installs both; without them the test fails
//! and says so (`OXIDIFF_SKIP_BROWSER=1` leaves it out on purpose).

mod support;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{unbase64, Server};

/// The W3C WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

struct Driver {
    child: Child,
    url: String,
    session: String,
    /// Chromium's profile, removed with the driver.
    _profile: tempfile::TempDir,
}

impl Driver {
    fn start() -> Option<Self> {
        let (chromium, chromedriver) = ("/usr/bin/chromium", "/usr/bin/chromedriver");
        if std::env::var("OXIDIFF_SKIP_BROWSER").as_deref() == Ok("1") {
            eprintln!("OXIDIFF_SKIP_BROWSER is set: the browser test is left out");
            return None;
        }
        assert!(
            std::path::Path::new(chromium).exists() && std::path::Path::new(chromedriver).exists(),
            "{chromium} and {chromedriver} are needed: run tools/fetch-chromium.sh (Debian's \
             chromium and chromium-driver), or set OXIDIFF_SKIP_BROWSER=1"
        );
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromedriver");
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while ureq::get(&format!("{url}/status")).call().is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let profile = tempfile::tempdir().expect("a profile folder");
        let user_data = format!("--user-data-dir={}", profile.path().display());
        let mut driver = Self {
            child,
            url,
            session: String::new(),
            _profile: profile,
        };
        let session = driver.send(
            "POST",
            "/session",
            json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium,
                    "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", user_data],
                },
            }}}),
        );
        driver.session = session["sessionId"]
            .as_str()
            .expect("a session")
            .to_string();
        Some(driver)
    }

    fn send(&self, method: &str, path: &str, body: Value) -> Value {
        let url = if path == "/session" {
            format!("{}{path}", self.url)
        } else {
            format!("{}/session/{}{path}", self.url, self.session)
        };
        let request = ureq::request(method, &url).timeout(Duration::from_secs(120));
        let answer = if method == "GET" {
            request.call()
        } else {
            request.send_json(body)
        };
        match answer {
            Ok(r) => r.into_json::<Value>().expect("WebDriver JSON")["value"].clone(),
            Err(ureq::Error::Status(code, r)) => {
                panic!(
                    "WebDriver {method} {path}: {code} {}",
                    r.into_string().unwrap_or_default()
                )
            }
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
    }

    fn element(&self, css: &str) -> String {
        let found = self.send(
            "POST",
            "/element",
            json!({"using": "css selector", "value": css}),
        );
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_string()
    }

    fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.send(
            "POST",
            &format!("/element/{id}/value"),
            json!({"text": text}),
        );
    }

    fn script(&self, script: &str) -> Value {
        self.send(
            "POST",
            "/execute/sync",
            json!({"script": script, "args": []}),
        )
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = ureq::delete(&format!("{}/session/{}", self.url, self.session)).call();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_web_page_generates_an_image_with_progress_in_chromium() {
    let Some(driver) = Driver::start() else {
        return;
    };
    let server = Server::start(&[]);
    driver.send("POST", "/url", json!({"url": format!("{}/", server.url)}));
    driver.type_into("#prompt", "a lighthouse at dusk");
    driver.type_into("#steps", "40");
    driver.type_into("#seed", "1234");
    let deadline = Instant::now() + Duration::from_secs(120);
    // The sampler list is filled from /sdapi/v1/samplers once the page loads.
    while driver.script("return document.querySelectorAll('#sampler option').length") == 1 {
        assert!(Instant::now() < deadline, "the sampler list stayed empty");
        std::thread::sleep(Duration::from_millis(50));
    }
    let button = driver.element("#generate");
    driver.send("POST", &format!("/element/{button}/click"), json!({}));
    let mut seen_progress = Vec::new();
    let src = loop {
        assert!(
            Instant::now() < deadline,
            "no image after 2 minutes: saw {seen_progress:?}"
        );
        let state = driver.script(
            "const img = document.querySelector('#gallery img.generated');
             return [Number(document.getElementById('progress').value),
                     document.getElementById('status').textContent,
                     document.getElementById('error').textContent,
                     img ? img.src : null,
                     img ? img.naturalWidth : 0];",
        );
        let error = state[2].as_str().unwrap_or_default();
        assert!(error.is_empty(), "the page shows an error: {error}");
        let progress = state[0].as_f64().unwrap_or(0.0);
        if progress > 0.0 && progress < 1.0 {
            seen_progress.push(state[1].as_str().unwrap_or_default().to_string());
        }
        if let (Some(src), Some(width)) = (state[3].as_str(), state[4].as_u64()) {
            if width > 0 {
                assert_eq!(width, 64, "the tiny model makes 64x64 images");
                break src.to_string();
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        seen_progress.iter().any(|s| s.starts_with("step ")),
        "the progress bar never moved: {seen_progress:?}"
    );
    let shown = unbase64(src.trim_start_matches("data:image/png;base64,"));
    let answer = server.post(
        "/v1/images/generations",
        &json!({"prompt": "a lighthouse at dusk", "steps": 40, "seed": 1234}),
    );
    let want = unbase64(answer.json()["data"][0]["b64_json"].as_str().unwrap());
    support::assert_same_png(&shown, &want, "the page's image and the API's");
}
