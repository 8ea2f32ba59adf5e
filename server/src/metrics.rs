//! Counters the worker and the handlers update, served by `/metrics` in Prometheus' text
//! format: queue depth, requests by endpoint and outcome, images, batches by size, step and
//! batch latency, and compiled mode's program counts.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxidiff::pipelines::CompileStats;

/// Everything `/metrics` reports; one lock, updated a few times per step at most.
pub struct Metrics {
    started: Instant,
    inner: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    /// (endpoint, status code) -> requests answered.
    requests: BTreeMap<(String, u16), u64>,
    images: u64,
    cancelled_images: u64,
    /// Batch size -> batches run.
    batches: BTreeMap<usize, u64>,
    steps: u64,
    step_seconds: f64,
    batch_seconds: f64,
    compile: Option<CompileStats>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            inner: Mutex::default(),
        }
    }
}

impl Metrics {
    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request to `endpoint` answered with `status`.
    pub fn request(&self, endpoint: &str, status: u16) {
        *self
            .counts()
            .requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    /// One denoising step of a batch took `took`.
    pub fn step(&self, took: Duration) {
        let mut c = self.counts();
        c.steps += 1;
        c.step_seconds += took.as_secs_f64();
    }

    /// A batch of `size` images ran in `took`: `delivered` of them went to clients, and
    /// `abandoned` were asked for by clients that went away.
    pub fn batch(&self, size: usize, delivered: usize, abandoned: usize, took: Duration) {
        let mut c = self.counts();
        *c.batches.entry(size).or_default() += 1;
        c.images += delivered as u64;
        c.cancelled_images += abandoned as u64;
        c.batch_seconds += took.as_secs_f64();
    }

    pub fn compile_stats(&self, stats: Option<CompileStats>) {
        self.counts().compile = stats;
    }

    /// The largest batch run so far (0 before the first).
    pub fn largest_batch(&self) -> usize {
        self.counts()
            .batches
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
    }

    /// The text `/metrics` serves: each metric's HELP and TYPE, then its samples.
    pub fn render(&self, queue_depth: usize) -> String {
        let c = self.counts();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: Vec<(String, String)>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let one = |value: String| vec![(String::new(), value)];
        metric(
            "oxidiff_queue_depth",
            "gauge",
            "Requests waiting for the worker.",
            one(queue_depth.to_string()),
        );
        metric(
            "oxidiff_requests_total",
            "counter",
            "Requests answered, by endpoint and HTTP status.",
            c.requests
                .iter()
                .map(|((endpoint, status), n)| {
                    (
                        format!("{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
                        n.to_string(),
                    )
                })
                .collect(),
        );
        metric(
            "oxidiff_images_total",
            "counter",
            "Images delivered.",
            one(c.images.to_string()),
        );
        metric(
            "oxidiff_cancelled_images_total",
            "counter",
            "Images made for clients that went away.",
            one(c.cancelled_images.to_string()),
        );
        metric(
            "oxidiff_batches_total",
            "counter",
            "Denoiser batches run, by images per batch.",
            c.batches
                .iter()
                .map(|(size, n)| (format!("{{size=\"{size}\"}}"), n.to_string()))
                .collect(),
        );
        metric(
            "oxidiff_steps_total",
            "counter",
            "Denoising steps run.",
            one(c.steps.to_string()),
        );
        metric(
            "oxidiff_step_seconds_total",
            "counter",
            "Time in denoising steps.",
            one(c.step_seconds.to_string()),
        );
        metric(
            "oxidiff_batch_seconds_total",
            "counter",
            "Time in batches (encode, denoise, decode, PNG).",
            one(c.batch_seconds.to_string()),
        );
        let rate = if c.batch_seconds > 0.0 {
            c.images as f64 / c.batch_seconds
        } else {
            0.0
        };
        metric(
            "oxidiff_images_per_second",
            "gauge",
            "Images delivered per second of batch time.",
            one(rate.to_string()),
        );
        metric(
            "oxidiff_uptime_seconds",
            "gauge",
            "Seconds since start.",
            one(self.started.elapsed().as_secs_f64().to_string()),
        );
        let stats = c.compile.unwrap_or_default();
        metric(
            "oxidiff_compiled_programs",
            "gauge",
            "Compiled mode: programs built (one per input signature).",
            one(stats.programs.to_string()),
        );
        metric(
            "oxidiff_xla_compiles",
            "gauge",
            "Compiled mode: programs XLA compiled (the rest came from the disk cache).",
            one(stats.xla_compiles.to_string()),
        );
        metric(
            "oxidiff_disk_cache_loads",
            "gauge",
            "Compiled mode: programs loaded from the disk cache.",
            one(stats.disk_loads.to_string()),
        );
        out
    }
}
