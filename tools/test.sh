#!/usr/bin/env bash
# The project's test command (the README's, and what CI runs): fetch the pinned PJRT plugins
# and the pretrained terrain model (checked by sha256; skipped when already present), then run
# every test of the workspace. With the terrain model fetched, OXIDIFF_REQUIRE_TERRAIN=1 makes
# examples/terrain fail to build rather than silently leave its onnxruntime parity test out.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tools/fetch-plugins.sh
tools/fetch-terrain.sh
export OXIDIFF_REQUIRE_TERRAIN=1
cargo test --workspace "$@"
