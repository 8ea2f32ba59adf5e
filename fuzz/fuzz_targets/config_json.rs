//! libFuzzer entry for `fuzz/targets/config_json.rs` (the body is shared with `tests/fuzz_replay.rs`).
#![no_main]

#[path = "../targets/config_json.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
