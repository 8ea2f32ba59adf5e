#!/usr/bin/env bash
# The project's test command (the README's, and what CI runs): fetch the pinned PJRT plugins,
# the pretrained terrain model (checked by sha256), Debian's chromium for the server's browser
# test (tools/fetch-chromium.sh) and evcxr (each skipped when already present),
# run every test of the workspace, then every notebook in evcxr itself, one evaluation per cell
# as the Jupyter kernel runs them (tools/evcxr-notebooks.sh). With the terrain model fetched,
# OXIDIFF_REQUIRE_TERRAIN=1 makes examples/terrain fail to build rather than silently leave its
# onnxruntime parity test out. OXIDIFF_SKIP_EVCXR=1 leaves the evcxr run (and its 5-minute
# first build) out; `cargo test --test notebooks` still runs the notebooks' cells as programs.
# The count of tests that ran is printed and, for the whole suite, held against tools/test-floor.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tools/fetch-plugins.sh
tools/fetch-terrain.sh
tools/fetch-chromium.sh
if [[ "${OXIDIFF_SKIP_EVCXR:-0}" != 1 ]]; then
    tools/fetch-evcxr.sh
fi
export OXIDIFF_REQUIRE_TERRAIN=1
# Every test binary prints `test result: ok. N passed; ...`: their sum is the count of tests
# that ran. Without arguments (CI) it must reach the floor in tools/test-floor, so a filter,
# a cfg gate or a lost test binary that silently drops tests fails the run; with arguments
# (a filtered run) the count is only printed. --no-fail-fast: a red run reports every failing
# binary, not only the first.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --no-fail-fast "$@" | tee "$log"
ran="$(sed -n 's/^test result: [a-zA-Z]*\. \([0-9][0-9]*\) passed.*/\1/p' "$log" | awk '{n += $1} END {print n + 0}')"
floor="$(grep -v '^#' tools/test-floor | tr -d '[:space:]')"
if [[ $# -eq 0 ]]; then
    echo "tests run: $ran (floor $floor, tools/test-floor)"
    if (( ran < floor )); then
        echo "error: $ran tests ran, fewer than the floor of $floor in tools/test-floor:" \
            "a test binary or gate dropped tests (if tests were removed on purpose, lower the floor)" >&2
        exit 1
    fi
else
    echo "tests run: $ran (filtered run: the floor in tools/test-floor is not checked)"
fi
if [[ "${OXIDIFF_SKIP_EVCXR:-0}" != 1 ]]; then
    tools/evcxr-notebooks.sh
fi
