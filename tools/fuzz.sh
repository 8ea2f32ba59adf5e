#!/usr/bin/env bash
# Fuzzes the loaders of untrusted files (safetensors headers, config JSON, tokenizer folders, LoRA files,
# PNG generation parameters) with cargo fuzz (libFuzzer + AddressSanitizer), each target for a
# fixed time: tools/fuzz.sh [SECONDS_PER_TARGET] (default 30). Fails on the first crash; the
# input that crashed is kept in fuzz/artifacts/TARGET/ (make it a regression test in
# models/tests/hostile_files.rs or the module's tests, then fix it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-30}"
if ! command -v cargo-fuzz >/dev/null; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi
# cargo fuzz passes nightly-only -Z flags (the sanitizer); the machine's stable toolchain
# accepts them with RUSTC_BOOTSTRAP, which is how we run it without a nightly toolchain.
export RUSTC_BOOTSTRAP=1
cd "$root/fuzz"
mkdir -p artifacts
if ! cargo fuzz build >artifacts/build.log 2>&1; then
    tail -n 40 artifacts/build.log
    echo "fuzz: building the fuzz targets failed (log: fuzz/artifacts/build.log)"
    exit 1
fi
for target in safetensors_header config_json tokenizer_files png_parameters lora_file; do
    mkdir -p "corpus/$target"
    log="artifacts/$target.log"
    echo "fuzz: $target for ${seconds}s"
    if ! cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -timeout=20 -rss_limit_mb=4096 \
        -print_final_stats=1 >"$log" 2>&1; then
        tail -n 60 "$log"
        echo "fuzz: $target failed; the crashing input is in fuzz/artifacts/$target/ (log: fuzz/$log)"
        exit 1
    fi
    grep -E "^stat::number_of_executed_units" "$log" | sed "s/^/fuzz: $target /" || true
done
echo "fuzz: every target ran ${seconds}s without a crash"
