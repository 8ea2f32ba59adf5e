//! Bad input and faults: every malformed, absurd or unknown request gets a 4xx JSON error
//! naming the field, slow and vanishing clients do not hold the worker, the API key is checked,
//! and Ctrl-C finishes the queued work before the server exits.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{post_to, Server};

const GENERATIONS: &str = "/v1/images/generations";
const TXT2IMG: &str = "/sdapi/v1/txt2img";

#[test]
fn bad_requests_get_4xx_and_the_server_keeps_serving() {
    let server = Server::start(&["--max-body-bytes", "4096", "--read-timeout", "1"]);
    // (what, endpoint, body, status, part of the message)
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, String, u16, &str)> = [
        ("malformed JSON", GENERATIONS, r#"{"prompt": "#, 400, "malformed JSON"),
        ("not an object", GENERATIONS, "[1, 2]", 400, "JSON object"),
        ("trailing garbage", GENERATIONS, r#"{"prompt": "a"} x"#, 400, "trailing characters"),
        ("no prompt", GENERATIONS, r#"{"n": 1}"#, 400, "missing field `prompt`"),
        ("n of the wrong type", GENERATIONS, r#"{"prompt": "a", "n": "two"}"#, 400, "`n`"),
        ("n = 0", GENERATIONS, r#"{"prompt": "a", "n": 0}"#, 400, "1 to 16 images"),
        ("n = 10^6", GENERATIONS, r#"{"prompt": "a", "n": 1000000}"#, 400, "1 to 16 images"),
        ("negative n", GENERATIONS, r#"{"prompt": "a", "n": -3}"#, 400, "`n`"),
        ("huge size", GENERATIONS, r#"{"prompt": "a", "size": "100000x100000"}"#, 400, "pixels"),
        ("size overflowing usize", GENERATIONS, r#"{"prompt": "a", "size": "99999999999999999999x8"}"#, 400, "size must look like"),
        ("odd size", GENERATIONS, r#"{"prompt": "a", "size": "65x64"}"#, 400, "multiples of 8"),
        ("size not WxH", GENERATIONS, r#"{"prompt": "a", "size": "large"}"#, 400, "size must look like"),
        ("no steps", GENERATIONS, r#"{"prompt": "a", "steps": 0}"#, 400, "1 to 150 steps"),
        ("a billion steps", GENERATIONS, r#"{"prompt": "a", "steps": 1000000000}"#, 400, "1 to 150 steps"),
        ("infinite guidance", GENERATIONS, r#"{"prompt": "a", "guidance_scale": 1e999}"#, 400, "number out of range"),
        ("unknown sampler", GENERATIONS, r#"{"prompt": "a", "scheduler": "Quantum 9000"}"#, 400, "Quantum 9000"),
        ("URL answers", GENERATIONS, r#"{"prompt": "a", "response_format": "url"}"#, 400, "b64_json"),
        ("seed overflowing", GENERATIONS, r#"{"prompt": "a", "seed": 18446744073709551615}"#, 400, "seed"),
        ("A1111 zero width", TXT2IMG, r#"{"prompt": "a", "width": 0, "height": 64}"#, 400, "width/height"),
        ("A1111 batch overflow", TXT2IMG, r#"{"prompt": "a", "batch_size": 4294967296, "n_iter": 4294967296}"#, 400, "overflows"),
        ("A1111 batch too large", TXT2IMG, r#"{"prompt": "a", "batch_size": 8, "n_iter": 8}"#, 400, "batch_size * n_iter"),
        ("A1111 unknown sampler", TXT2IMG, r#"{"prompt": "a", "sampler_name": "Euler z"}"#, 400, "sampler_name"),
        ("A1111 unknown schedule", TXT2IMG, r#"{"prompt": "a", "scheduler": "Exponential"}"#, 400, "Exponential"),
        ("A1111 cfg as text", TXT2IMG, r#"{"prompt": "a", "cfg_scale": "high"}"#, 400, "cfg_scale"),
    ]
    .into_iter()
    .map(|(what, path, body, status, needle)| (what, path, body.to_string(), status, needle))
    .chain([(
        "oversized body",
        GENERATIONS,
        format!("{{\"prompt\": \"{}\"}}", "a".repeat(10_000)),
        413,
        "larger than 4096 bytes",
    )])
    .collect();
    assert!(cases.len() >= 15);
    for (what, path, body, status, needle) in &cases {
        let answer = server.post_raw(path, body.as_bytes());
        assert_eq!(answer.status, *status, "{what}: {}", answer.text);
        let message = answer.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            message.contains(needle),
            "{what}: {message:?} lacks {needle:?}"
        );
    }
    let unknown = server.get("/v2/nothing");
    assert_eq!(unknown.status, 404);
    let wrong_method = server.get(GENERATIONS);
    assert_eq!(wrong_method.status, 405);

    // A client that sends half its body and stalls gets 408; one that sends nothing at all
    // holds only its own connection. Meanwhile the server answers others.
    let idle = TcpStream::connect(server.addr()).unwrap();
    let mut slow = TcpStream::connect(server.addr()).unwrap();
    write!(
        slow,
        "POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    let ok = server.post(
        GENERATIONS,
        &json!({"prompt": "still serving", "steps": 2, "seed": 1}),
    );
    assert_eq!(ok.status, 200, "{}", ok.text);
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reply = Vec::new();
    let mut chunk = [0u8; 1024];
    while !reply.windows(4).any(|w| w == b"\r\n\r\n") {
        match slow.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => reply.extend_from_slice(&chunk[..n]),
        }
    }
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 408"),
        "slow client got {reply:?}"
    );
    drop(idle);
    let ok = server.post(
        TXT2IMG,
        &json!({"prompt": "still serving", "steps": 2, "seed": 1}),
    );
    assert_eq!(ok.status, 200, "{}", ok.text);
    let refused =
        server.metric("oxidiff_requests_total{endpoint=\"/v1/images/generations\",status=\"400\"}");
    assert!(refused >= 15.0, "{refused} refusals counted");
}

#[test]
fn the_api_key_is_required_when_set() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, "s3cret-key\n").unwrap();
    let server = Server::start(&["--api-key-file", key_file.to_str().unwrap()]);
    let body = json!({"prompt": "a", "steps": 1});
    let url = format!("{}{GENERATIONS}", server.url);
    for key in [None, Some("wrong"), Some("s3cret-key-and-more"), Some("")] {
        let mut request = ureq::post(&url);
        if let Some(key) = key {
            request = request.set("Authorization", &format!("Bearer {key}"));
        }
        match request.send_json(body.clone()) {
            Err(ureq::Error::Status(401, _)) => {}
            other => panic!("key {key:?}: expected 401, got {other:?}"),
        }
    }
    let ok = ureq::post(&url)
        .set("Authorization", "Bearer s3cret-key")
        .send_json(body)
        .expect("the right key is accepted");
    assert_eq!(ok.status(), 200);
    // The page and the health check stay open, so a load balancer can probe.
    assert_eq!(server.get("/healthz").status, 200);
    assert_eq!(server.get("/metrics").status, 401);
}

#[test]
fn a_client_that_goes_away_cancels_its_job_and_interrupt_stops_a_batch() {
    let server = Server::start(&[]);
    // A streamed request of many steps: read its first progress event, then hang up.
    let response = ureq::post(&format!("{}{GENERATIONS}", server.url))
        .send_json(json!({"prompt": "long", "steps": 150, "stream": true, "seed": 3}))
        .expect("the stream starts");
    let mut reader = response.into_reader();
    let mut first = [0u8; 64];
    reader.read_exact(&mut first).expect("a first event");
    assert!(String::from_utf8_lossy(&first).contains("image_generation.progress"));
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.metric("oxidiff_cancelled_images_total") < 1.0 {
        assert!(Instant::now() < deadline, "the job was not cancelled");
        std::thread::sleep(Duration::from_millis(50));
    }
    let steps = server.metric("oxidiff_steps_total");
    assert!(steps < 150.0, "the cancelled job ran {steps} steps");

    // The same for a plain (not streamed) request whose client closes the connection.
    let mut client = TcpStream::connect(server.addr()).unwrap();
    let body = json!({"prompt": "long", "steps": 150, "seed": 4}).to_string();
    write!(
        client,
        "POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    while server.get("/sdapi/v1/progress").json()["state"]["sampling_step"] == 0 {
        assert!(Instant::now() < deadline, "the plain job did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(client);
    while server.metric("oxidiff_cancelled_images_total") < 2.0 {
        assert!(Instant::now() < deadline, "the plain job was not cancelled");
        std::thread::sleep(Duration::from_millis(50));
    }
    let steps = server.metric("oxidiff_steps_total");
    assert!(steps < 300.0, "the cancelled jobs ran {steps} steps");

    // /sdapi/v1/interrupt stops the running batch: its client gets a 503 saying so.
    let url = server.url.clone();
    let waiting =
        std::thread::spawn(move || post_to(&url, TXT2IMG, &json!({"prompt": "x", "steps": 150})));
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.get("/sdapi/v1/progress").json()["state"]["sampling_step"] == 0 {
        assert!(Instant::now() < deadline, "the job did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        server.post("/sdapi/v1/interrupt", &json!({})).json()["interrupted"],
        true
    );
    let interrupted = waiting.join().unwrap();
    assert_eq!(interrupted.status, 503, "{}", interrupted.text);
    assert!(
        interrupted.text.contains("interrupted"),
        "{}",
        interrupted.text
    );
    let ok = server.post(GENERATIONS, &json!({"prompt": "after", "steps": 1}));
    assert_eq!(ok.status, 200, "{}", ok.text);
}

#[test]
fn a_full_queue_answers_429() {
    let server = Server::start(&["--max-queue", "1", "--max-batch", "1"]);
    let url = server.url.clone();
    // One request runs, one waits; the third finds the queue full.
    let long = |url: String| {
        std::thread::spawn(move || {
            post_to(
                &url,
                GENERATIONS,
                &json!({"prompt": "x", "steps": 60, "seed": 5}),
            )
            .status
        })
    };
    let running = long(url.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.get("/sdapi/v1/progress").json()["state"]["sampling_step"] == 0 {
        assert!(Instant::now() < deadline, "the first job did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let queued = long(url);
    while server.metric("oxidiff_queue_depth") < 1.0 {
        assert!(Instant::now() < deadline, "the second job was not queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let full = server.post(GENERATIONS, &json!({"prompt": "x", "steps": 1}));
    assert_eq!(full.status, 429, "{}", full.text);
    assert!(full.text.contains("queue is full"), "{}", full.text);
    assert_eq!(running.join().unwrap(), 200);
    assert_eq!(queued.join().unwrap(), 200);
}

#[test]
fn ctrl_c_finishes_the_queued_requests_then_exits() {
    let mut server = Server::start(&[]);
    let url = server.url.clone();
    let running = std::thread::spawn(move || {
        post_to(
            &url,
            GENERATIONS,
            &json!({"prompt": "x", "steps": 60, "n": 2}),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.get("/sdapi/v1/progress").json()["state"]["sampling_step"] == 0 {
        assert!(Instant::now() < deadline, "the job did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill sends a signal to the child we started; no memory is involved.
    let sent = unsafe { libc::kill(server.child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(sent, 0);
    let answer = running.join().unwrap();
    assert_eq!(
        answer.status, 200,
        "the running request is finished: {}",
        answer.text
    );
    assert_eq!(answer.json()["data"].as_array().unwrap().len(), 2);
    let status = server.child.wait().expect("the server exits");
    assert!(status.success(), "exit status {status}");
}
