//! `oxidiff::tune_allocator` in a process of its own: glibc's limit on arenas binds only the
//! threads that first allocate after it is set, and the test harness's threads allocate before
//! any test runs, so this file has no harness (`harness = false`) and calls it first thing, as
//! the binaries do.
//!
//! What it checks: a large block allocated by a thread other than the main one (as XLA's CPU
//! plugin allocates a compiled program's working memory on its own threads) comes from the one
//! heap, not from a fresh `mmap`, and a second such block after the first is freed reuses the
//! first's memory instead of growing the heap. Without the single arena the thread got an arena
//! whose heaps hold at most 64 MiB, and glibc mapped the block with `mmap` whatever the other
//! settings: its pages were faulted and zeroed again at every run.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    use std::hint::black_box;

    assert!(oxidiff::tune_allocator(), "glibc refused the settings");
    // A block larger than a thread arena's largest heap (64 MiB on 64-bit glibc).
    const BLOCK: usize = 100 << 20;
    // SAFETY: mallinfo2 only reads the allocator's counters, under its own locks.
    let info = || unsafe { libc::mallinfo2() };
    let before = info();

    // The pages are written so that the block is really in use while it is measured.
    let in_thread = || {
        std::thread::spawn(move || {
            let block = black_box(vec![1u8; BLOCK]);
            let during = info();
            drop(block);
            during
        })
        .join()
        .expect("the allocating thread panicked")
    };
    let first = in_thread();
    assert_eq!(
        first.hblkhd, before.hblkhd,
        "a {BLOCK}-byte block of another thread was mapped with mmap ({} bytes mapped, {} before)",
        first.hblkhd, before.hblkhd
    );
    assert!(
        first.arena >= before.arena + BLOCK,
        "the block did not come from the heap: {} bytes of heap during, {} before",
        first.arena,
        before.arena
    );

    let second = in_thread();
    assert_eq!(
        second.hblkhd, before.hblkhd,
        "the second block was mapped with mmap"
    );
    assert!(
        second.arena <= first.arena,
        "the second block grew the heap from {} to {} bytes instead of reusing the first's",
        first.arena,
        second.arena
    );
    // The line tools/test.sh counts.
    println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    assert!(!oxidiff::tune_allocator());
    println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}
