#!/usr/bin/env bash
# The GPU check, run on a lent NVIDIA machine by the `device` tool (never by CI or tests):
#
#   tools/device/prepare.sh            # here: release binaries, golden latents, diffusers wheel
#   device run: tools/device/gpu-check.sh   (carry .device)
#
# 1. Parity: the tiny SD 1.x, SD3 and PixArt fixtures through `txt2img` on XLA's CUDA plugin,
#    eager and compiled, against diffusers' golden PNGs (max level difference, 2 is the bar the
#    CPU tests hold), and the same runs on the CPU backend as a control.
# 2. Speed: the SD 1.5 architecture (random weights, made there with diffusers) at 512x512
#    through tools/bench/run.py: oxidiff compiled on the GPU against diffusers (torch, CUDA), in
#    f32 and bf16.
# Everything lands in $OUT (log.txt, parity.txt, bench-*.json); each step has its own time limit
# so that one hang does not cost the rest.
set -u
started=$(date +%s)
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
step() { echo "== $(date +%T) $*"; }
budget="${GPU_CHECK_BENCH-f32,bf16}"
dev="${GPU_CHECK_DEVICE:-cuda}" # xla:cpu to try the script out here

source tools/device/env.sh

step "parity (txt2img; max |level difference| against diffusers' PNG)"
case_args() { # NAME -> the CLI arguments of tests/cli/parity.rs for that fixture
    case "$1" in
    sd1) echo "--model $fx/tiny-sd1 --latents .device/tiny-sd1-latents.npy --steps 4 --guidance 7.5 --scheduler pndm" ;;
    sd3) echo "--model $fx/tiny-sd3 --latents .device/tiny-sd3-latents.npy --steps 3 --guidance 5.0 --max-sequence-length 24 --width 48 --height 64" ;;
    pixart) echo "--model $fx/tiny-pixart-alpha --latents .device/tiny-pixart-alpha-latents.npy --steps 4 --width 128 --height 200" ;;
    esac
}
prompt_of() {
    case "$1" in
    sd1) echo "a photo of an astronaut riding a horse" ;;
    sd3) echo "A photo of an astronaut riding a horse on the moon" ;;
    pixart) echo "A Photo of an Astronaut riding a horse  " ;;
    esac
}
negative_of() {
    case "$1" in
    sd1) echo "blurry" ;;
    sd3) echo "blurry, low quality" ;;
    pixart) echo "" ;;
    esac
}
golden_of() {
    case "$1" in
    sd1) echo tiny-sd1-pndm.png ;;
    sd3) echo tiny-sd3.png ;;
    pixart) echo tiny-pixart-alpha.png ;;
    esac
}
# The SD 1.5 folder is made (CPU work) while the parity runs use the GPU.
sd15=/tmp/sd15-random
(timeout 300 python3 tools/bench/diffusers_bench.py "$sd15" --make-only --fixture $fx/tiny-sd1 \
    >/tmp/make.log 2>&1 || echo "making $sd15 failed: $(tail -3 /tmp/make.log)") &
maker=$!
# Eager mode compiles every distinct op once; on a GPU that is slow, so one fixture runs eager.
parity() { # NAME:MODE...
    for run in "$@"; do
        name=${run%%:*} mode=${run#*:}
        case "$mode" in
        cpu) extra=(--device cpu) ;;
        cuda-eager) extra=(--device "$dev") ;;
        cuda-compiled) extra=(--device "$dev" --compile) ;;
        esac
        neg=()
        [[ -n "$(negative_of $name)" ]] && neg=(--negative-prompt "$(negative_of $name)")
        png="/tmp/$name-$mode.png"
        rm -f "$png"
        start=$(date +%s.%N)
        # shellcheck disable=SC2046
        timeout "$([[ $mode == cuda-eager ]] && echo 100 || echo 120)" /tmp/bin/txt2img $(case_args $name) "${neg[@]}" "${extra[@]}" --json -o "$png" \
            "$(prompt_of $name)" >"/tmp/$name-$mode.json" 2>"/tmp/$name-$mode.err"
        rc=$?
        echo "$name $mode: rc $rc, $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s"
        [[ $rc -ne 0 ]] && tail -5 "/tmp/$name-$mode.err"
        compare "$png" "$fx/golden/$(golden_of $name)" "$name $mode"
    done
}
parity sd1:cpu sd1:cuda-eager sd1:cuda-compiled
cp /tmp/sd1-cuda-compiled.json /tmp/sd1-cuda-eager.json "$OUT/" 2>/dev/null

step "SD 1.5 architecture, 512x512: oxidiff compiled on CUDA against diffusers on CUDA"
wait $maker
deadline=$((started + ${GPU_CHECK_SECONDS:-540}))
bench() { # DTYPE
    local left=$((deadline - $(date +%s)))
    if ((left < 90)); then echo "bench $1 skipped: ${left} s left"; return; fi
    step "bench $1 (${left} s left)"
    timeout "$left" python3 tools/bench/run.py --configs sd15-512 --sd15-dir "$sd15" --device cuda \
        --modes compiled --threads "$(nproc)" --rounds 1 --repeat 5 --e2e-repeat 2 --dtype "$1" \
        --bench-bin /tmp/bin/bench --json "$OUT/bench-$1.json" --svg "/tmp/bench-$1.svg" \
        || echo "bench $1 failed ($?)"
}
[[ ",$budget," == *,f32,* ]] && bench f32
step "parity, the DiT pipelines compiled"
parity sd3:cuda-compiled pixart:cuda-compiled
[[ ",$budget," == *,bf16,* ]] && bench bf16
step "done"
