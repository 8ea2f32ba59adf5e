//! What the binaries (`txt2img`, `img2img`, `oxidiff-server`) share and the library does not
//! need: usage checks made before any model loads, output files created exclusively, reading
//! input files with a size limit, and one-message error reports. Errors are typed here; the
//! binaries wrap them in `anyhow` and map a [`UsageError`] to exit status 2.

pub mod control;
pub mod ip_adapter;
pub mod model_lookup;
pub mod output;
pub mod precision;
pub mod usage;
pub mod vae;

pub use precision::Precision;
pub use usage::UsageError;

use std::path::Path;

use oxidiff_pipelines::lora::hashes_field;
use oxidiff_pipelines::{LoraReport, PipelineDefaults};

/// `error`'s message and its causes as one line, each cause once: a cause whose text the
/// message already holds (an I/O error repeated by its wrapper) is left out.
pub fn error_message(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

/// The most lines an error report takes on stderr.
pub const REPORT_LINES: usize = 3;

/// `message` in at most [`REPORT_LINES`] lines: a longer one (a plugin search listing every
/// place it looked) keeps its first line and its last (where such messages put the fix), with
/// a pointer to the full text, which `RUST_LOG=info` logs.
pub fn short_report(message: &str) -> String {
    let lines: Vec<&str> = message.lines().collect();
    if lines.len() <= REPORT_LINES {
        return message.to_string();
    }
    format!(
        "{}
{}
({} more lines: run with RUST_LOG=info to see them)",
        lines[0],
        lines[lines.len() - 1].trim(),
        lines.len() - 2
    )
}

/// The fields a PNG's parameters end with: `Lora hashes` when LoRAs were fused (as A1111
/// writes them), then `Version`.
pub fn closing_fields(loras: &[LoraReport]) -> Vec<(String, String)> {
    let mut fields = Vec::new();
    if !loras.is_empty() {
        fields.push(("Lora hashes".to_string(), hashes_field(loras)));
    }
    fields.push((
        "Version".to_string(),
        format!("oxidiff {}", env!("CARGO_PKG_VERSION")),
    ));
    fields
}

/// The steps and guidance of a run that names neither: diffusers' defaults of the pipeline
/// (`defaults`), except for sd-turbo, run as its model card says (1 step, no guidance).
pub fn run_defaults(model: &str, defaults: &PipelineDefaults) -> (usize, f64) {
    if model.trim_end_matches('/').ends_with("sd-turbo") {
        (1, 0.0)
    } else {
        (defaults.num_inference_steps, defaults.guidance_scale)
    }
}

/// A seed from the clock and process id for runs that give none (printed or recorded so they
/// can be made again), below 2^53 so that JSON numbers keep it exact.
pub fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    (nanos ^ ((std::process::id() as u64) << 32)) % (1 << 53)
}

/// What a PNG records of a path the user gave: its last component (a file or folder name says
/// what it was without revealing where this machine keeps it).
pub fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// The model as a PNG records it (`Model:`): a Hub id as it is, a local folder or single file
/// by its name (without `.safetensors`), never a path of this machine.
pub fn model_name(model: &str) -> String {
    let path = Path::new(model);
    if !path.exists() {
        return model.to_string();
    }
    let name = file_name(path);
    name.strip_suffix(".safetensors")
        .map(str::to_string)
        .unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot write out.png: {0}")]
    struct Wrapper(#[source] std::io::Error);

    #[test]
    fn long_reports_keep_their_first_and_last_lines() {
        let long = "no plugin found. Looked in:\n  - a\n  - b\n  - c\nInstall it with x.sh";
        let short = short_report(long);
        assert_eq!(short.lines().count(), REPORT_LINES, "{short}");
        assert!(short.contains("Install it with x.sh"), "{short}");
        assert_eq!(short_report("one line"), "one line");
    }

    #[test]
    fn a_cause_repeated_by_its_wrapper_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let message = error_message(&Wrapper(io));
        assert_eq!(message.matches("not found").count(), 1, "{message}");
    }
}
