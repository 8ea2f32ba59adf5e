#!/usr/bin/env bash
# Every test binary of the workspace with libtest's --shuffle (issue 26: the suite passes in
# random order within each binary). RUSTC_BOOTSTRAP=1 is set for the test binaries only, at run
# time, so nothing is rebuilt; each runs from its package folder, as cargo runs it. Doc-tests
# are left out (libtest shuffles only test binaries). Prints each binary's seed, to rerun one.
set -uo pipefail
list="$(mktemp)"
trap 'rm -f "$list"' EXIT
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo test --workspace --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"], m["manifest_path"].rsplit("/", 1)[0])
' > "$list"
total=0; failed=0
while read -r bin dir; do
  out=$(cd "$dir" && CARGO_MANIFEST_DIR="$dir" RUSTC_BOOTSTRAP=1 OXIDIFF_REQUIRE_TERRAIN=1 "$bin" -Z unstable-options --shuffle 2>&1)
  rc=$?
  seed=$(echo "$out" | grep -o "shuffle seed: [0-9]*" | head -1)
  res=$(echo "$out" | grep "^test result" | tail -1)
  echo "$(basename "$bin") [$seed] rc=$rc $res"
  n=$(echo "$res" | sed -n 's/.* \([0-9]*\) passed.*/\1/p'); total=$((total + ${n:-0}))
  if [ $rc -ne 0 ]; then failed=$((failed+1)); echo "$out" | grep -E "panicked|FAILED" | head -5; fi
done < "$list"
echo "shuffled: $total tests passed; $failed binaries failed"
[ "$failed" -eq 0 ]
