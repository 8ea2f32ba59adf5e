//! The progress line on stderr and the `tracing` subscriber that feeds it.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use oxidiff::pipelines::StepInfo;
use oxidiff::Oxi;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Logs: `RUST_LOG` (default `warn`; `RUST_LOG=info` adds load, compile and timing events), and
/// the load and compile events on the progress line.
pub fn init_logging(progress: &Progress) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let progress_events = tracing_subscriber::filter::filter_fn(|meta| {
        matches!(meta.target(), "oxidiff::load" | "oxidiff::compile")
    });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_filter(filter),
        )
        .with(ProgressLayer(progress.bar.clone()).with_filter(progress_events))
        .init();
}

/// The progress display on stderr: one line for loading (per component), compiling (with the
/// reason), the denoising steps (with it/s) and decoding. Hidden with --quiet or when stderr is
/// not a terminal. Loading and compile phases arrive as `tracing` events (targets
/// `oxidiff::load` and `oxidiff::compile`), through [`ProgressLayer`].
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        if quiet || !std::io::stderr().is_terminal() {
            return Self {
                bar: ProgressBar::hidden(),
            };
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        Self { bar }
    }

    /// A phase without a count (loading, compiling, decoding, writing).
    pub fn phase(&self, message: String) {
        self.bar.set_message(message);
    }

    /// Starts counting `steps` denoising steps.
    pub fn steps(&self, label: &str, steps: usize) {
        self.bar.set_message(label.to_string());
        self.bar.set_style(
            ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} [{elapsed}] {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        self.bar.reset();
        self.bar.set_length(steps as u64);
        self.bar.set_position(0);
    }

    /// After each step; the VAE decode follows the last one when images are made.
    pub fn step(&self, info: &StepInfo<'_, Oxi>, decodes: bool) {
        self.bar.set_length(info.num_steps as u64);
        self.bar.set_position(info.step as u64 + 1);
        if decodes && info.step + 1 == info.num_steps {
            self.bar.set_message("decoding");
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Shows the pipelines' load events (`oxidiff::load`, one per component) and the compiler's
/// (`oxidiff::compile`, with the reason) on the progress line.
struct ProgressLayer(ProgressBar);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ProgressLayer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let get = |name: &str| {
            fields
                .0
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        match event.metadata().target() {
            "oxidiff::load" => self.0.set_message(format!("loading {}", get("component"))),
            "oxidiff::compile" => {
                self.0
                    .set_message(format!("compiling {} ({})", get("program"), get("reason")))
            }
            _ => {}
        }
    }
}

/// An event's fields as text.
#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .push((field.name().to_string(), format!("{value:?}")));
    }
}
