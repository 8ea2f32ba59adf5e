//! Runnable examples and benchmarks of oxidiff (see `src/bin/`).

/// Peak resident memory of this process in bytes (`VmHWM`), where Linux reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The tiny random-weight SD 1.x test pipeline (`tests/fixtures/tiny-sd1`): the examples'
/// default model, so they run offline in seconds (the images are noise-like patterns).
pub const TINY_SD1: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-sd1");

/// The value after `flag` on the command line (`--device tpu`), if given.
pub fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).cloned()
}
