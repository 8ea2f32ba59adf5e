//! Runs one of `examples/notebooks/*.ipynb` as a program (its code cells, in order, as
//! `build.rs` extracts them), from the notebook's directory as Jupyter would:
//! `cargo run -p oxidiff-examples --bin notebook -- quickstart`. `tests/notebooks.rs` runs each.

include!(concat!(env!("OUT_DIR"), "/notebooks.rs"));

/// The code cell (from 1) running now, set by the generated code, for error messages.
static CELL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

type Main = fn() -> Result<(), Box<dyn std::error::Error>>;

fn main() -> std::process::ExitCode {
    let names: Vec<&str> = NOTEBOOKS.iter().map(|(name, _)| *name).collect();
    let Some(name) = std::env::args().nth(1) else {
        eprintln!("usage: notebook NAME (one of: {})", names.join(", "));
        return std::process::ExitCode::from(2);
    };
    let Some((_, run)) = NOTEBOOKS.iter().find(|(n, _)| *n == name) else {
        eprintln!(
            "no notebook {name:?}; the notebooks are: {}",
            names.join(", ")
        );
        return std::process::ExitCode::from(2);
    };
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/notebooks");
    if let Err(e) = std::env::set_current_dir(dir) {
        eprintln!("cannot enter {dir}: {e}");
        return std::process::ExitCode::FAILURE;
    }
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let cell = CELL.load(std::sync::atomic::Ordering::Relaxed);
            eprintln!("notebook {name} failed in code cell {cell}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
