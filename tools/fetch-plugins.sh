#!/usr/bin/env bash
# Fetch the pinned PJRT plugins that oxidiff-backend-tpu loads and tests against.
#
#   tools/fetch-plugins.sh [--only cpu|tpu] [DIR]
#
# DIR defaults to $OXIDIFF_PLUGIN_DIR, else <repo>/.plugins (where the crate's
# plugin discovery and tests look). Wheels are downloaded with
# `pip download --no-deps` into $OXIDIFF_WHEEL_CACHE (default DIR/wheels),
# checked against the sha256 recorded below, and only the plugin's .so is
# unpacked, to DIR/<package>-<version>/<file>.so (also checked by sha256).
# Running it again skips every plugin whose .so is present with the right hash.
#
# To move a pin: change the version, run `pip download --no-deps` for it once,
# and record the wheel's and the unpacked .so's sha256 here.
set -euo pipefail

only=""
if [[ "${1:-}" == "--only" ]]; then
    only="${2:?--only needs cpu or tpu}"
    shift 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-${OXIDIFF_PLUGIN_DIR:-$root/.plugins}}"
wheels="${OXIDIFF_WHEEL_CACHE:-$dir/wheels}"
python="${PYTHON:-python3}"

# kind | package==version | pip platform flags | wheel file | wheel sha256 | .so inside the wheel | .so sha256
plugins=(
    "cpu|lammps-jax-pjrt-cpu==0.11.2|--python-version 3.11 --platform manylinux_2_27_x86_64|lammps_jax_pjrt_cpu-0.11.2-py3-none-manylinux_2_27_x86_64.whl|1319390d948b39f69f7dade496b7c385149d9ca6097a6b62114da113216d9ad1|lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so|ad1309ac822b1b24d51b7f9947c7c9fa9ef5d67f390584cbc3d1fa2428fed9c2"
    "tpu|libtpu==0.0.52|--python-version 3.11 --platform manylinux_2_31_x86_64|libtpu-0.0.52-cp311-cp311-manylinux_2_31_x86_64.whl|f5e2e596eaea9357fbb5a6755a7a9007c6ab75bfde4a55191b03eff402971140|libtpu/libtpu.so|f86de4d04a058e6b5101f73e0824b95f27e2cec996d2b9191d9cffda75c03077"
)

sha_ok() { # FILE SHA256
    [[ -f "$1" ]] && echo "$2  $1" | sha256sum --check --status -
}

mkdir -p "$dir" "$wheels"
for entry in "${plugins[@]}"; do
    IFS='|' read -r kind spec platform wheel wheel_sha member so_sha <<<"$entry"
    if [[ -n "$only" && "$only" != "$kind" ]]; then
        continue
    fi
    name="${spec%%==*}"
    version="${spec##*==}"
    dest="$dir/$name-$version/$(basename "$member")"
    if sha_ok "$dest" "$so_sha"; then
        echo "ok      $dest"
        continue
    fi
    if ! sha_ok "$wheels/$wheel" "$wheel_sha"; then
        echo "fetch   $spec"
        rm -f "$wheels/$wheel"
        # shellcheck disable=SC2086 # $platform is a list of flags
        "$python" -m pip download --quiet --no-deps --only-binary=:all: $platform \
            --dest "$wheels" "$spec"
        if ! sha_ok "$wheels/$wheel" "$wheel_sha"; then
            echo "error: $wheels/$wheel is missing or does not have sha256 $wheel_sha" >&2
            exit 1
        fi
    fi
    echo "unpack  $member -> $dest"
    mkdir -p "$(dirname "$dest")"
    "$python" - "$wheels/$wheel" "$member" "$dest.partial" <<'EOF'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
EOF
    if ! sha_ok "$dest.partial" "$so_sha"; then
        echo "error: $member unpacked from $wheel does not have sha256 $so_sha" >&2
        rm -f "$dest.partial"
        exit 1
    fi
    chmod 0755 "$dest.partial"
    mv "$dest.partial" "$dest"
    echo "ok      $dest"
done
