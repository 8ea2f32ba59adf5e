#!/usr/bin/env bash
# The project's test command (the README's, and what CI runs): fetch the pinned PJRT plugins,
# the pretrained terrain model (checked by sha256) and evcxr (skipped when already present),
# run every test of the workspace, then every notebook in evcxr itself, one evaluation per cell
# as the Jupyter kernel runs them (tools/evcxr-notebooks.sh). With the terrain model fetched,
# OXIDIFF_REQUIRE_TERRAIN=1 makes examples/terrain fail to build rather than silently leave its
# onnxruntime parity test out. OXIDIFF_SKIP_EVCXR=1 leaves the evcxr run (and its 5-minute
# first build) out; `cargo test --test notebooks` still runs the notebooks' cells as programs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tools/fetch-plugins.sh
tools/fetch-terrain.sh
if [[ "${OXIDIFF_SKIP_EVCXR:-0}" != 1 ]]; then
    tools/fetch-evcxr.sh
fi
export OXIDIFF_REQUIRE_TERRAIN=1
cargo test --workspace "$@"
if [[ "${OXIDIFF_SKIP_EVCXR:-0}" != 1 ]]; then
    tools/evcxr-notebooks.sh
fi
