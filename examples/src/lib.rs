//! Runnable examples and benchmarks of oxidiff (see `src/bin/`).

/// Peak resident memory of this process in bytes (`VmHWM`), where Linux reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
