#!/usr/bin/env bash
# SD 1.5 architecture, random weights: oxidiff vs diffusers side by side on this machine.
#
#   tools/bench/sd15.sh [DIR] [SIZE] [THREADS]
#
# DIR (default /tmp/oxidiff-sd15-random) receives the random-weight pipeline the first time
# (about 4 GB; needs `pip install torch diffusers transformers`). Each side runs in its own
# process with the same thread count, then the ratios oxidiff / diffusers are printed
# (below 1: oxidiff is faster or smaller).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-/tmp/oxidiff-sd15-random}"
size="${2:-256}"
threads="${3:-1}"
cd "$root"
python3 tools/bench/sd15_diffusers.py "$dir" --make-only
cargo build --release -p oxidiff-examples --bin bench_sd15 >&2
torch_json=$(OMP_NUM_THREADS="$threads" python3 tools/bench/sd15_diffusers.py "$dir" --size "$size" --threads "$threads")
ours_json=$(RAYON_NUM_THREADS="$threads" target/release/bench_sd15 "$dir" --size "$size")
python3 - "$torch_json" "$ours_json" <<'PY'
import json, sys
torch, ours = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"SD 1.5 architecture, random weights, {ours['size']}x{ours['size']}, {ours['steps']} DDIM steps, guidance 7.5, threads {torch['threads']}")
print(f"{'':16}{'oxidiff':>12}{'diffusers':>12}{'ratio':>8}")
for key, label in [("load_s", "load (s)"), ("text_encode_s", "text enc (s)"), ("unet_step_s", "UNet step (s)"),
                   ("vae_decode_s", "VAE decode (s)"), ("end_to_end_s", "end to end (s)"),
                   ("peak_rss_bytes", "peak RSS (GB)")]:
    scale = 1e9 if key == "peak_rss_bytes" else 1
    a, b = ours[key] / scale, torch[key] / scale
    print(f"{label:16}{a:12.3f}{b:12.3f}{a / b:8.2f}")
print(json.dumps({"oxidiff": ours, "diffusers": torch}))
PY
