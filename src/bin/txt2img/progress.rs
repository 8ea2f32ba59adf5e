//! The progress line on stderr and the `tracing` subscriber that feeds it.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use oxidiff::pipelines::StepInfo;
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
/// reason), the denoising steps (with tqdm's rate) and decoding. Hidden with --quiet or when
/// stderr is not a terminal. Loading and compile phases arrive as `tracing` events (targets
/// `oxidiff::load` and `oxidiff::compile`), through [`ProgressLayer`].
pub struct Progress {
    bar: ProgressBar,
    /// What the step counter is labelled (`denoising`, `batch 2/3: denoising`), restored after
    /// a compile that happened inside a step.
    label: Arc<Mutex<String>>,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        let label = Arc::new(Mutex::new(String::new()));
        if quiet || !std::io::stderr().is_terminal() {
            return Self {
                bar: ProgressBar::hidden(),
                label,
            };
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(spinner_style());
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        Self { bar, label }
    }

    /// A phase without a count (loading, compiling, decoding, writing).
    pub fn phase(&self, message: String) {
        self.bar.set_style(spinner_style());
        self.bar.set_message(message);
    }

    /// Starts a run of denoising steps under `label`. The counter appears with the first step,
    /// when the pipeline reports the real total (a scheduler may run more steps than asked,
    /// img2img fewer), so no wrong total is ever shown.
    pub fn steps(&self, label: &str) {
        *self.label.lock().unwrap_or_else(|e| e.into_inner()) = label.to_string();
        self.phase(label.to_string());
    }

    /// After each step; the VAE decode follows the last one when images are made.
    pub fn step<B: burn::tensor::backend::Backend>(&self, info: &StepInfo<'_, B>, decodes: bool) {
        if info.step == 0 {
            self.bar.reset();
            self.bar.set_length(info.num_steps as u64);
        }
        // A compile inside the step showed itself as a phase; the counter comes back.
        self.bar.set_style(steps_style());
        self.bar.set_position(info.step as u64 + 1);
        if decodes && info.step + 1 == info.num_steps {
            self.bar.set_style(spinner_style());
            self.bar.set_message("decoding");
        } else {
            let label = self.label.lock().unwrap_or_else(|e| e.into_inner()).clone();
            self.bar.set_message(label);
        }
    }

    /// Prints `line` on stderr above the progress line (which is redrawn after it).
    pub fn println(&self, line: &str) {
        self.bar.suspend(|| eprintln!("{line}"));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn steps_style() -> ProgressStyle {
    ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} [{elapsed}] {rate}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .with_key(
            "rate",
            |state: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&tqdm_rate(state.per_sec()));
            },
        )
}

/// A rate as tqdm prints it: `3.21it/s` at one step a second or faster, else `1.52s/it`.
fn tqdm_rate(per_sec: f64) -> String {
    if !per_sec.is_finite() || per_sec <= 0.0 {
        "?it/s".into()
    } else if per_sec >= 1.0 {
        format!("{per_sec:.2}it/s")
    } else {
        format!("{:.2}s/it", 1.0 / per_sec)
    }
}

/// Turns off the native libraries' own stderr logging (XLA's and libtpu's INFO and WARNING
/// lines) unless `RUST_LOG` is set, where the user asked for detail; variables already set
/// win. Called first thing in `main`, before any thread exists.
pub fn quiet_native_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        return;
    }
    for (name, value) in [
        ("TF_CPP_MIN_LOG_LEVEL", "2"),
        ("GLOG_minloglevel", "2"),
        ("TPU_MIN_LOG_LEVEL", "2"),
        ("TPU_STDERR_LOG_LEVEL", "2"),
    ] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
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
                self.0.set_style(spinner_style());
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

#[cfg(test)]
mod tests {
    use super::tqdm_rate;

    #[test]
    fn rates_read_as_tqdm_prints_them() {
        assert_eq!(tqdm_rate(3.214), "3.21it/s");
        assert_eq!(tqdm_rate(1.0 / 1.52), "1.52s/it");
        assert_eq!(tqdm_rate(0.0), "?it/s");
    }
}
