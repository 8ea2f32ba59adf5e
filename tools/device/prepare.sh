#!/usr/bin/env bash
# Prepares .device/ (ignored) for tools/device/gpu-check.sh: stripped, gzipped release builds of
# txt2img and the benchmark binary (x86-64), the golden latents of the parity cases as .npy, and
# the diffusers wheel the device machine lacks. Run here, then carry .device on the device call.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
python="${PYTHON:-python3}"
mkdir -p .device
cargo build --release -p oxidiff --bin txt2img -p oxidiff-examples --bin bench
for b in txt2img bench; do
    strip -o ".device/$b" "$target/release/$b"
    gzip -9f ".device/$b"
done
"$python" - <<'EOF'
import numpy as np
from safetensors.numpy import load_file
for name in ["tiny-sd1", "tiny-sd3", "tiny-pixart-alpha"]:
    latents = load_file(f"tests/fixtures/golden/{name}.safetensors")["pipe.latents"]
    np.save(f".device/{name}-latents.npy", latents.astype(np.float32))
EOF
"$python" -m pip download -q --no-deps --only-binary=:all: -d .device diffusers==0.42.1 importlib_metadata==10.2.0
du -sh .device
