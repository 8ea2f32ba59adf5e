#!/usr/bin/env bash
# Where a warm process's first image goes on a GPU (issue 20), run on a lent NVIDIA machine by
# the `device` tool after tools/device/prepare.sh (carry .device):
# 1. the compiled ControlNet step (tiny SD 1.x) on XLA's CUDA plugin against diffusers' PNG;
# 2. tiny SD: txt2img --compile --num-images 3, a cold process then a warm one (disk cache),
#    the warm one with OXIDIFF_LOG_COMPILES=1 (every program and eager op loaded, with times);
# 3. the SD 1.5 architecture at 512 in bf16: bench --mode compiled cold, then warm with the log.
# Log lines carry seconds since the process started. Results in $OUT.
set -u
started=$(date +%s)
OUT="${OUT:-/tmp/gpu-first-image}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
step() { echo "== $(date +%T) $*"; }
dev="${GPU_CHECK_DEVICE:-cuda}" # xla:cpu to try the script out here
source tools/device/env.sh
stamp() { # prefixes each line with the seconds since it started
    python3 -u -c 'import sys, time
t = time.perf_counter()
for line in sys.stdin:
    sys.stdout.write(f"{time.perf_counter() - t:8.3f} {line}")'
}
sd15=/tmp/sd15-random
(timeout 300 python3 tools/bench/diffusers_bench.py "$sd15" --make-only --fixture $fx/tiny-sd1 \
    >/tmp/make.log 2>&1 || echo "making $sd15 failed: $(tail -3 /tmp/make.log)") &
maker=$!

step "ControlNet, compiled on cuda"
timeout 120 /tmp/bin/txt2img --model $fx/tiny-sd1 --controlnet $fx/tiny-controlnet-sd1 \
    --control-image $fx/golden/controlnet-input.png --steps 4 --seed 42 --guidance 7.5 \
    --negative-prompt blurry --device "$dev" --compile --json -o /tmp/cn.png \
    "a photo of an astronaut riding a horse" >/tmp/cn.json 2>/tmp/cn.err || tail -5 /tmp/cn.err
compare /tmp/cn.png $fx/golden/controlnet-sd1-single.png "controlnet sd1 cuda-compiled"

step "tiny SD, --num-images 3: cold process, then warm"
for run in cold warm; do
    log=0
    [[ $run == warm ]] && log=1
    OXIDIFF_LOG_COMPILES=$log timeout 150 /tmp/bin/txt2img --model $fx/tiny-sd1 --steps 20 \
        --device "$dev" --compile --num-images 3 --json --force -o /tmp/tiny.png "a red apple" \
        2> >(stamp >"/tmp/tiny-$run.err") | tee "$OUT/tiny-$run.json" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print(sys.argv[1], "batches", [round(s, 3) for s in r.get("batch_seconds", [])], "load", round(r["load_seconds"], 2), "compiled", r.get("compiled", {}).get("xla_compiles"), "eager", r.get("eager_ops"))' "$run"
done
cp /tmp/tiny-warm.err "$OUT/tiny-warm-log.txt"

step "SD 1.5 architecture 512, bf16, compiled: cold, then warm"
wait $maker
for run in cold warm; do
    log=0
    [[ $run == warm ]] && log=1
    left=$((started + ${GPU_CHECK_SECONDS:-330} - $(date +%s)))
    if ((left < 30)); then echo "$run skipped: $left s left"; continue; fi
    OXIDIFF_LOG_COMPILES=$log timeout "$left" /tmp/bin/bench "$sd15" --mode compiled --device "$dev" \
        --size 512 --steps 4 --repeat 3 --e2e-repeat 2 --dtype bf16 \
        2> >(stamp >"/tmp/sd15-$run.err") | tee "$OUT/sd15-$run.json" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print(sys.argv[1], {k: r.get(k) for k in ["load_s", "first_generation_s", "xla_compiles"]}, "steady", r["end_to_end"]["median_s"])' "$run"
done
cp /tmp/sd15-warm.err "$OUT/sd15-warm-log.txt" 2>/dev/null
step "done"
