#!/usr/bin/env bash
# Install evcxr (the engine of the evcxr Jupyter kernel) for tools/evcxr-notebooks.sh:
#
#   tools/fetch-evcxr.sh [DIR]
#
# DIR defaults to <repo>/.tools; the binary lands in DIR/bin/evcxr. It is `evcxr_repl` at the
# version pinned below, built by `cargo install --locked` from crates.io (about 5 minutes on
# 2 cores, once). Nothing is built when DIR/bin/evcxr or an `evcxr` on PATH already is that
# version.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.tools}"
version="0.22.0"
bin="$dir/bin/evcxr"

has_version() { "$1" --version 2>/dev/null | grep -qx "evcxr_repl $version"; }
if [[ -x "$bin" ]] && has_version "$bin"; then
    exit 0
fi
# One already on PATH at the pinned version will do (tools/evcxr-notebooks.sh falls back to it).
if command -v evcxr >/dev/null && has_version evcxr; then
    exit 0
fi
echo "fetch-evcxr: building evcxr_repl $version into $dir (cargo install, once)" >&2
if ! cargo install --locked --root "$dir" --version "$version" evcxr_repl; then
    echo "error: could not install evcxr_repl $version from crates.io into $dir;" \
        "check the network, or set OXIDIFF_SKIP_EVCXR=1 to leave the evcxr notebook run out" >&2
    exit 1
fi
