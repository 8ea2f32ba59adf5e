//! A bounded load test of a running `oxidiff-server`: `--requests N` OpenAI requests from
//! `--concurrency C` clients on loopback; prints the latency percentiles, images per second,
//! the errors and (with `--pid`) the server's resident memory before and after.
//!
//! ```sh
//! target/release/oxidiff-server --model tests/fixtures/tiny-sd1 --port 7860 &
//! cargo run --release -p oxidiff-server --example load -- --url http://127.0.0.1:7860 \
//!     --requests 200 --concurrency 16 --steps 4 --pid $!
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn flag(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

/// VmRSS of `pid` in MiB.
fn rss_mib(pid: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The number after `name`, or `default`; anything else stops with a message naming the flag.
fn number(args: &[String], name: &str, default: &str) -> u64 {
    let text = flag(args, name, default);
    text.parse().unwrap_or_else(|_| {
        eprintln!("load: {name} takes a whole number (it was {text:?})");
        std::process::exit(2)
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let url = flag(&args, "--url", "http://127.0.0.1:7860");
    let requests = number(&args, "--requests", "200") as usize;
    let concurrency = number(&args, "--concurrency", "16").max(1) as usize;
    let steps = number(&args, "--steps", "4");
    let size = flag(&args, "--size", "auto");
    let pid = flag(&args, "--pid", "");
    let rss_before = rss_mib(&pid);
    let next = Arc::new(AtomicUsize::new(0));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(requests)));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let clients: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, latencies, errors) = (next.clone(), latencies.clone(), errors.clone());
            let (url, size) = (url.clone(), size.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                let body = serde_json::json!({
                    "prompt": format!("load test prompt {i}"), "seed": i, "steps": steps,
                    "size": size,
                });
                let sent = Instant::now();
                match ureq::post(&format!("{url}/v1/images/generations"))
                    .timeout(Duration::from_secs(3600))
                    .send_json(body)
                {
                    Ok(r) if r.status() == 200 => {
                        let _ = r.into_string();
                        latencies.lock().unwrap().push(sent.elapsed());
                    }
                    Ok(r) => errors
                        .lock()
                        .unwrap()
                        .push(format!("status {}", r.status())),
                    Err(e) => errors.lock().unwrap().push(e.to_string()),
                }
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client thread");
    }
    let wall = started.elapsed().as_secs_f64();
    let mut latencies = latencies.lock().unwrap().clone();
    latencies.sort();
    let errors = errors.lock().unwrap();
    println!(
        "{} requests at concurrency {concurrency}: {} ok, {} errors{}",
        requests,
        latencies.len(),
        errors.len(),
        errors
            .first()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default()
    );
    println!(
        "latency p50 {:.3} s, p99 {:.3} s, max {:.3} s; {:.2} images/s over {wall:.1} s",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().map_or(f64::NAN, Duration::as_secs_f64),
        latencies.len() as f64 / wall
    );
    if let (Some(before), Some(after)) = (rss_before, rss_mib(&pid)) {
        println!("server RSS: {before:.0} MiB before, {after:.0} MiB after");
    }
}
