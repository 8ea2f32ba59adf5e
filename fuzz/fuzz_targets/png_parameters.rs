//! libFuzzer entry for `fuzz/targets/png_parameters.rs` (the body is shared with `tests/fuzz_replay.rs`).
#![no_main]

#[path = "../targets/png_parameters.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
