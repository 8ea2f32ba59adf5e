//! libFuzzer entry for `fuzz/targets/lora_file.rs` (the body is shared with `tests/fuzz_replay.rs`).
#![no_main]

#[path = "../targets/lora_file.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
