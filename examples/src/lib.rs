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

/// CPU time this process has used so far, all threads, in seconds
/// (`CLOCK_PROCESS_CPUTIME_ID`): with one thread pinned to one core it is the work a step
/// took, whatever else the machine runs.
pub fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write into.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
