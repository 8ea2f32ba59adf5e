//! `txt2img`: generate images from a prompt with a diffusers-format model: Stable Diffusion
//! 1.x/2.x, SDXL, SD3/SD3.5, PixArt-Alpha/Sigma or Flux.1, picked by `model_index.json`'s `_class_name`.
//!
//! The binary is argument parsing ([`args`], [`from_png`]), the progress line ([`progress`]),
//! output files ([`output`]) and the run itself ([`run`]), on the backend `--device` names
//! ([`oxidiff::execution`]).

mod args;
mod from_png;
mod output;
mod progress;
mod run;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use oxidiff::cli::UsageError;
use oxidiff::pipelines::PipelineError;

use args::Args;
use progress::Progress;

/// Exit status after Ctrl-C (128 + SIGINT, as shells report it).
const INTERRUPTED: u8 = 130;

/// Exit status of a command line that cannot run (as clap's own usage errors).
const USAGE: u8 = 2;

fn main() -> ExitCode {
    oxidiff::tune_allocator();
    progress::quiet_native_logs();
    let matches = Args::command().get_matches();
    let mut args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    args.model_given = matches.value_source("model") == Some(ValueSource::CommandLine);
    let progress = Progress::new(args.quiet);
    progress::init_logging(&progress);
    let result = run::run(args, &progress);
    progress.finish();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = oxidiff::cli::error_message(e.as_ref());
            tracing::info!(%message, "the full error");
            eprintln!("error: {}", oxidiff::cli::short_report(&message));
            exit_code(&e)
        }
    }
}

/// 2 for a usage error, 130 after Ctrl-C, else 1.
fn exit_code(e: &anyhow::Error) -> ExitCode {
    let usage = e.chain().any(|cause| cause.is::<UsageError>());
    let interrupted = e.chain().any(|cause| {
        cause.is::<run::Interrupted>()
            || matches!(
                cause.downcast_ref::<PipelineError>(),
                Some(PipelineError::Cancelled { .. })
            )
    });
    if usage {
        ExitCode::from(USAGE)
    } else if interrupted {
        ExitCode::from(INTERRUPTED)
    } else {
        ExitCode::FAILURE
    }
}
