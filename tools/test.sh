#!/usr/bin/env bash
# The project's test command (the README's, and what CI runs): fetch the pinned PJRT plugins
# (checked by sha256; skipped when already present), then run every test of the workspace.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tools/fetch-plugins.sh
cargo test --workspace "$@"
