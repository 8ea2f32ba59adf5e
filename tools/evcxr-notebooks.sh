#!/usr/bin/env bash
# Runs the notebooks of examples/notebooks/ in evcxr itself, one evaluation per code cell as the
# evcxr Jupyter kernel runs them, and fails if a cell fails.
#
#   tools/evcxr-notebooks.sh [NOTEBOOK.ipynb ...]     (default: every notebook)
#
# Needs evcxr (tools/fetch-evcxr.sh installs the pinned version; evcxr_jupyter shares its
# engine) and python3 (only to read the notebooks' JSON). The first run builds oxidiff inside evcxr, about ten minutes
# here; EVCXR_TMPDIR (default /tmp/oxidiff-evcxr) keeps that build for the next run.
#
# How: each code cell becomes one input line of `evcxr --disable-readline --ide-mode`, its line
# breaks written as U+2028, which evcxr turns back into line breaks before evaluating the line as
# one unit. In IDE mode evcxr prints U+0091 after each unit that succeeded and U+0092 after each
# that failed; a notebook passes when every cell printed U+0091.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
# EVCXR, else the one tools/fetch-evcxr.sh installs, else evcxr on PATH.
evcxr="${EVCXR:-}"
if [[ -z "$evcxr" ]]; then
    if [[ -x "$root/.tools/bin/evcxr" ]]; then evcxr="$root/.tools/bin/evcxr"; else evcxr=evcxr; fi
fi
if ! command -v "$evcxr" >/dev/null; then
    echo "error: evcxr not found; install it with tools/fetch-evcxr.sh" \
        "(or: cargo install --locked evcxr_repl)" >&2
    exit 1
fi
# Outside the repository: cargo refuses a crate inside the workspace's folder that is not one of
# its members (the root package "." claims everything below it, whatever `exclude` says). And not
# below $HOME: the run path evcxr's cell libraries get to the toolchain's libstd is computed from
# `deps/` one folder deeper than where they are loaded from, one `..` too many, which only a
# folder whose common ancestor with ~/.rustup is `/` absorbs (dlopen fails otherwise).
export EVCXR_TMPDIR="${EVCXR_TMPDIR:-${TMPDIR:-/tmp}/oxidiff-evcxr}"
mkdir -p "$EVCXR_TMPDIR"

if [ "$#" -eq 0 ]; then
    set -- "$root"/examples/notebooks/*.ipynb
fi

failed=0
for notebook in "$@"; do
    notebook="$(cd "$(dirname "$notebook")" && pwd)/$(basename "$notebook")"
    name="$(basename "$notebook" .ipynb)"
    input="$EVCXR_TMPDIR/$name.input"
    log="$EVCXR_TMPDIR/$name.log"
    cells="$(python3 - "$notebook" "$input" <<'EOF'
import json, sys
notebook, out = sys.argv[1], sys.argv[2]
cells = [c for c in json.load(open(notebook, encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
with open(out, "w", encoding="utf-8") as f:
    for cell in cells:
        source = "".join(cell["source"]).rstrip("\n")
        f.write(source.replace("\n", "\u2028") + "\n")
print(len(cells))
EOF
)"
    echo "== $name: $cells code cells (log: $log)"
    start=$SECONDS
    # The notebooks name their paths relative to their own folder, as Jupyter runs them.
    (cd "$(dirname "$notebook")" && "$evcxr" --disable-readline --ide-mode <"$input") >"$log" 2>&1 || true
    ok="$({ grep -o $'\u0091' "$log" || true; } | wc -l)"
    bad="$({ grep -o $'\u0092' "$log" || true; } | wc -l)"
    # A cell ending in `Images` shows it through `evcxr_display`; where that call does not
    # compile, evcxr silently prints the value's `Debug` form instead.
    debug_shown="$({ grep -o 'Images { count:' "$log" || true; } | wc -l)"
    if [ "$debug_shown" -ne 0 ]; then
        echo "   a cell showed an Images value with Debug instead of evcxr_display" >&2
        bad=$((bad + debug_shown))
    fi
    if [ "$ok" -eq "$cells" ] && [ "$bad" -eq 0 ]; then
        echo "   passed: $ok of $cells cells in $((SECONDS - start)) s"
    else
        echo "   FAILED: $ok of $cells cells succeeded, $bad failed; the end of $log:" >&2
        sed 's/\x1b\[[0-9;]*m//g' "$log" | cut -c1-300 | tail -40 >&2
        failed=1
    fi
done
exit "$failed"
