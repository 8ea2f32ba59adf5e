//! libFuzzer entry for `fuzz/targets/safetensors_header.rs` (the body is shared with `tests/fuzz_replay.rs`).
#![no_main]

#[path = "../targets/safetensors_header.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
