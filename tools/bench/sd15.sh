#!/usr/bin/env bash
# SD 1.5 architecture, random weights: oxidiff (CPU backend, XLA CPU eager, XLA CPU compiled)
# and diffusers side by side on this machine.
#
#   tools/bench/sd15.sh [DIR] [SIZE] [THREADS]
#   REPEAT=5 UNET_ONLY=1 MODES="cpu compiled" tools/bench/sd15.sh ...
#   tools/bench/sd15.sh tests/fixtures/tiny-sd1 64     # the tiny test pipeline
#
# DIR (default /tmp/oxidiff-sd15-random) receives the random-weight pipeline the first time
# (about 4 GB; needs `pip install torch diffusers transformers`). Each side runs in its own
# process, one after the other; with THREADS=1 each is also pinned to one core (taskset), so
# XLA's thread pool gets one core like torch and burn-flex. The UNet step is one denoising
# step at guidance 7.5 (the UNet on batch 2, the guidance combination), timed REPEAT times
# after a warm-up (min / median / max; "first" is the warm-up, which includes XLA compiles).
# Ratios are against diffusers (below 1: oxidiff is faster).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-/tmp/oxidiff-sd15-random}"
size="${2:-256}"
threads="${3:-1}"
repeat="${REPEAT:-3}"
modes="${MODES:-cpu eager compiled}"
extra=()
if [ "${UNET_ONLY:-0}" = 1 ]; then extra=(--unet-only); fi
pin=()
if [ "$threads" = 1 ] && command -v taskset >/dev/null; then pin=(taskset -c 0); fi
cd "$root"
python3 tools/bench/sd15_diffusers.py "$dir" --make-only
cargo build --release -p oxidiff-examples --bin bench_sd15 >&2
results=()
echo "diffusers..." >&2
results+=("$(OMP_NUM_THREADS="$threads" "${pin[@]}" python3 tools/bench/sd15_diffusers.py "$dir" \
  --size "$size" --threads "$threads" --repeat "$repeat" "${extra[@]}")")
for mode in $modes; do
  echo "oxidiff $mode..." >&2
  results+=("$(RAYON_NUM_THREADS="$threads" "${pin[@]}" target/release/bench_sd15 "$dir" \
    --size "$size" --repeat "$repeat" --mode "$mode" "${extra[@]}")")
done
python3 - "$dir" "${results[@]}" <<'PY'
import json, sys
name, runs = sys.argv[1], [json.loads(r) for r in sys.argv[2:]]
torch = runs[0]
label = lambda r: "diffusers" if r["impl"] == "diffusers" else f"oxidiff {r['mode']}"
print(f"{name}: {torch['size']}x{torch['size']}, UNet step at guidance 7.5 (batch 2), threads {torch['threads']}, {torch['unet_step']['repeats']} repeats")
print(f"{'':18}{'first (s)':>11}{'min (s)':>10}{'median':>10}{'max':>10}{'/diffusers':>12}")
for r in runs:
    s = r["unet_step"]
    print(f"{label(r):18}{s['first_s']:11.4f}{s['min_s']:10.4f}{s['median_s']:10.4f}{s['max_s']:10.4f}"
          f"{s['median_s'] / torch['unet_step']['median_s']:12.2f}")
by = {label(r): r for r in runs}
if "oxidiff eager" in by and "oxidiff compiled" in by:
    e, c = by["oxidiff eager"]["unet_step"], by["oxidiff compiled"]["unet_step"]
    print(f"compiled vs eager: {e['median_s'] / c['median_s']:.1f}x faster (medians)")
keys = [("load_s", "load (s)"), ("text_encode_s", "text enc (s)"), ("vae_decode_s", "VAE decode (s)"),
        ("end_to_end_s", "end to end (s)"), ("peak_rss_bytes", "peak RSS (GB)")]
print(f"{'':16}" + "".join(f"{label(r):>19}" for r in runs))
for key, text in keys:
    if all(key in r for r in runs):
        scale = 1e9 if key == "peak_rss_bytes" else 1
        print(f"{text:16}" + "".join(f"{r[key] / scale:19.3f}" for r in runs))
print(json.dumps(runs))
PY
