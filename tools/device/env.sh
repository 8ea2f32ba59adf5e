# Sourced by the device scripts (tools/device/gpu-*.sh): the machine's description, the
# binaries from .device/ (tools/device/prepare.sh), XLA's CUDA plugin from the machine's jax
# with CUDA's libraries, the compile cache, the diffusers wheel, and `compare`, which prints the
# largest level difference of two PNGs. Expects $OUT and `step`.
step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)"

step "binaries"
mkdir -p /tmp/bin
for b in txt2img bench; do gzip -dc ".device/$b.gz" >"/tmp/bin/$b" && chmod +x "/tmp/bin/$b"; done
site=$(python3 -c "import site; print(site.getsitepackages()[0])")
plugin=$(ls "$site"/jax_plugins/xla_cuda1*/xla_cuda_plugin.so 2>/dev/null | head -1)
echo "plugin: $plugin"
[[ -n "$plugin" ]] && export OXIDIFF_PJRT_PLUGIN="$plugin"
# The plugin dlopens CUDA's libraries from the nvidia-* wheels, as jax does.
LD_LIBRARY_PATH="$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
[[ -d /usr/local/cuda/bin ]] && export PATH="/usr/local/cuda/bin:$PATH"
export OXIDIFF_COMPILE_CACHE=/tmp/oxidiff-cache

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .device/*.whl && export PYTHONPATH=/tmp/site
fx=tests/fixtures
compare() { # OURS GOLDEN LABEL
    python3 - "$1" "$2" "$3" <<'EOF' | tee -a "$OUT/parity.txt"
import sys
import numpy as np
from PIL import Image
ours, golden, label = sys.argv[1:]
try:
    a = np.asarray(Image.open(ours).convert("RGB"), dtype=np.int16)
    b = np.asarray(Image.open(golden).convert("RGB"), dtype=np.int16)
    d = np.abs(a - b)
    print(f"{label:40} max {d.max():3d}  mean {d.mean():.3f}  {'ok' if d.max() <= 2 else 'OVER 2'}")
except Exception as e:
    print(f"{label:40} no image: {e}")
EOF
}
