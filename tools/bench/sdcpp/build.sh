#!/usr/bin/env bash
# Builds stable-diffusion.cpp's `sd-cli` for the `sdcpp` column of tools/bench/run.py: the sdist
# of stable-diffusion-cpp-python (pinned, sha256 checked) from PyPI vendors it; CMake and Ninja
# come as wheels into a venv of their own. Everything lands in target/bench-sdcpp and nothing
# of it is part of oxidiff or its tests. Prints the path of sd-cli; a no-op once it is built.
# About 4 minutes on one core (ggml's CPU backend built for this machine, -march=native).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
out="$root/target/bench-sdcpp"
version=0.4.7
sha256=998d1957260dd5ae4e18a8acc0c14b0a8757aaa9f96515197b6d5bbf46df9282
sdist="$out/stable_diffusion_cpp_python-$version.tar.gz"
cli="$out/build/bin/sd-cli"
if [[ -x "$cli" ]]; then
    echo "$cli"
    exit 0
fi
mkdir -p "$out"
if [[ ! -x "$out/venv/bin/cmake" ]]; then
    python3 -m venv "$out/venv"
    "$out/venv/bin/pip" install -q scikit-build-core==1.1.2 cmake==4.4.5 ninja==1.13.2 >&2
fi
if [[ ! -f "$sdist" ]]; then
    # --no-build-isolation: pip reads the sdist's metadata with this venv's scikit-build-core
    # instead of building CMake from source for an isolated one.
    "$out/venv/bin/pip" download -q --no-deps --no-binary stable-diffusion-cpp-python \
        --no-build-isolation "stable-diffusion-cpp-python==$version" -d "$out" >&2
fi
echo "$sha256  $sdist" | sha256sum -c --quiet - >&2
rm -rf "$out/src" && mkdir -p "$out/src"
tar xzf "$sdist" -C "$out/src"
PATH="$out/venv/bin:$PATH" cmake -S "$out/src/stable_diffusion_cpp_python-$version/vendor/stable-diffusion.cpp" \
    -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSD_BUILD_EXAMPLES=ON >&2
PATH="$out/venv/bin:$PATH" ninja -C "$out/build" sd-cli >&2
echo "$cli"
