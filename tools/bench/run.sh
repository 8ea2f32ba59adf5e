#!/usr/bin/env bash
# Builds the oxidiff side of the benchmark suite (release) and runs the driver, which times
# oxidiff and diffusers alternately on this machine and writes tools/bench/results.json and
# docs/bench.svg. Arguments go to tools/bench/run.py (see `python3 tools/bench/run.py --help`):
#
#   tools/bench/run.sh                                   # tiny + SD 1.5 at 256, 1 and 2 threads
#   tools/bench/run.sh --configs sd15-512 --threads 2 --rounds 1
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
cargo build --release -p oxidiff-examples --bin bench >&2
exec python3 tools/bench/run.py "$@"
