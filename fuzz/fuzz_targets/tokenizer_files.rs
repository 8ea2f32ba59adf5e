//! libFuzzer entry for `fuzz/targets/tokenizer_files.rs` (the body is shared with `tests/fuzz_replay.rs`).
#![no_main]

#[path = "../targets/tokenizer_files.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
