"""The benchmark suite's driver: oxidiff (target/release/bench) and diffusers
(tools/bench/diffusers_bench.py) side by side on this machine, alternately, at the same thread
count; prints the ratios oxidiff / diffusers, writes a JSON result file and an SVG chart.
With `--impls diffusers,oxidiff,candle`, candle's own SD 1.5 UNet and VAE (tools/bench/candle,
a cargo project of its own, built on first use into target/bench-candle) is a third column: it
times the UNet step, the VAE decode and the load only. With `sdcpp` among `--impls`,
stable-diffusion.cpp (`sd-cli`, built on first use by tools/bench/sdcpp/build.sh into
target/bench-sdcpp; tools/bench/sdcpp_bench.py times one generation from its log) adds two
columns, its f32 and q8_0 weights.

    tools/bench/run.sh [--configs tiny,sd15-256] [--threads 1,2] [--rounds 2] ...
    python3 tools/bench/run.py --help

Each round runs one process per side (diffusers, then every oxidiff mode; the order flips
every round so neither side always runs first on a warmer machine). Each process loads the
pipeline, makes a first image, then times the UNet step, text encoding and VAE decode
`--repeat` times after a warm-up, and end to end. Times of all rounds are pooled: the tables
give min / median / max over every timed call; load, time to first image and peak RSS give
min / median / max over processes. Ratios are medians (below 1: oxidiff is faster).

Threads: 1 thread means RAYON_NUM_THREADS=1 (burn-flex), torch.set_num_threads(1) and
OMP_NUM_THREADS=1 (torch), and every process pinned to one core with `taskset -c 0` (`--pin-cpu`): XLA's CPU
plugin sizes its intra-op thread pool from the cores the process may run on (it has no thread
option of its own), so pinning is how it gets one thread. With 2 threads nothing is pinned.
The load average (`/proc/loadavg`) is recorded before every process.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The random-weight SD 1.5-architecture folder: made on first use (diffusers_bench.py
# --make-only, about 4.3 GB) in the checkout's ignored .cache/, or wherever --sd15-dir says.
SD15_DIR = os.path.join(ROOT, ".cache", "sd15-random")
# name -> (diffusers folder, image size, steps, timed calls per stage and process, rounds)
CONFIGS = {
    "tiny": ("tests/fixtures/tiny-sd1", 64, 20, 10, 3),
    "sd15-256": (SD15_DIR, 256, 4, 2, 1),
    "sd15-512": (SD15_DIR, 512, 4, 2, 1),
}
STAGES = ["unet_step", "vae_decode", "text_encode", "end_to_end"]
# The same stages' process CPU time (all threads): with 1 thread on one pinned core it is the
# work done, whatever else the machine runs.
CPU = [s + "_cpu" for s in STAGES]
SINGLE = ["load_s", "time_to_first_image_s", "peak_rss_bytes"]
LABELS = {
    "unet_step": "UNet step (CFG)", "vae_decode": "VAE decode", "text_encode": "text encode",
    "end_to_end": "end to end", "load_s": "load", "time_to_first_image_s": "first image",
    "peak_rss_bytes": "peak RSS",
    **{s + "_cpu": "  CPU time" for s in STAGES},
}


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def cpu_features():
    """The vector and matrix extensions the kernels choose between, from /proc/cpuinfo."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                  if line.startswith("flags")), [])
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"]
    return [f for f in wanted if f in flags]


CANDLE_DIR = os.path.join(ROOT, "tools", "bench", "candle")
CANDLE_TARGET = os.path.join(ROOT, "target", "bench-candle")


def build_candle():
    """Builds tools/bench/candle (release) into target/bench-candle; cargo makes it a no-op
    when nothing changed. candle is never a dependency of oxidiff's workspace."""
    env = dict(os.environ, CARGO_TARGET_DIR=CANDLE_TARGET)
    subprocess.run(["cargo", "build", "--release", "--manifest-path",
                    os.path.join(CANDLE_DIR, "Cargo.toml")], cwd=ROOT, env=env, check=True)
    return os.path.join(CANDLE_TARGET, "release", "candle-bench")


def build_sdcpp():
    """Builds stable-diffusion.cpp's sd-cli into target/bench-sdcpp (tools/bench/sdcpp/build.sh;
    a no-op once built) and returns its path."""
    out = subprocess.run(["tools/bench/sdcpp/build.sh"], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def run_one(side, dir_, size, steps, repeat, threads, args):
    env = dict(os.environ)
    env["RAYON_NUM_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    common = ["--size", str(size), "--steps", str(steps), "--repeat", str(repeat),
              "--e2e-repeat", str(args.e2e_repeat), "--dtype", args.dtype]
    if args.variant:
        common += ["--variant", args.variant]
    if side == "candle":
        cmd = [args.candle_bin, dir_, "--size", str(size), "--repeat", str(repeat),
               "--dtype", args.dtype]
    elif side.startswith("sdcpp-"):
        cmd = [sys.executable, "tools/bench/sdcpp_bench.py", dir_, "--sd-cli", args.sdcpp_bin,
               "--size", str(size), "--steps", str(steps), "--quant", side.split("-", 1)[1],
               "--threads", str(threads)]
    elif side == "diffusers":
        cmd = [sys.executable, "tools/bench/diffusers_bench.py", dir_, "--threads", str(threads)]
        if args.device != "cpu":
            cmd += ["--device", args.device]
    else:
        # `compiled-offload`: compiled mode with the text encoders handed back between requests.
        mode = side.removesuffix("-offload")
        cmd = [args.bench_bin, dir_, "--mode", mode]
        if mode != side:
            cmd += ["--offload", "text-encoders"]
        if args.device != "cpu" and side != "cpu":
            cmd += ["--device", args.device]
    if side != "candle" and not side.startswith("sdcpp-"):
        cmd += common
    if threads == 1 and args.device == "cpu" and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(args.pin_cpu)] + cmd
    load = loadavg()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
    result = json.loads(line)
    result["loadavg_before"] = load
    result["command"] = " ".join(cmd)
    medians = "  ".join(f"{stage} {result[stage]['median_s']:.4f}" for stage in STAGES if stage in result)
    print(f"  {side:10} load {load[0]:.2f}  medians (s): {medians}  first image "
          f"{result.get('first_generation_s', float('nan')):.2f}", file=sys.stderr, flush=True)
    return result


def summarize(runs):
    """Pools the processes of one side: stage times over all calls, single values over runs."""
    out = {}
    for stage in STAGES:
        times = [t for r in runs if stage in r for t in r[stage]["times_s"]]
        if times:
            out[stage] = {"min": min(times), "median": statistics.median(times), "max": max(times),
                          "n": len(times), "first_s": [r[stage]["first_s"] for r in runs]}
        cpu = [t for r in runs if stage in r for t in r[stage].get("cpu_times_s", [])]
        if cpu:
            out[stage + "_cpu"] = {"min": min(cpu), "median": statistics.median(cpu),
                                   "max": max(cpu), "n": len(cpu)}
    for key in SINGLE:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = {"min": min(values), "median": statistics.median(values),
                        "max": max(values), "n": len(values)}
    return out


def fmt(key, v):
    return f"{v / 1e9:.2f}G" if key == "peak_rss_bytes" else f"{v:.4g}"


def report(result):
    lines = []
    for case in result["cases"]:
        sides = case["sides"]
        # Ratios compare with diffusers; without it (--impls oxidiff,candle) the table has none.
        base = sides.get("diffusers", {})
        lines.append(f"\n{case['config']} ({case['size']}x{case['size']}, {case['steps']} DDIM "
                     f"steps, guidance 7.5), {case['threads']} thread(s), {case['rounds']} "
                     f"round(s), {result.get('dtype', 'f32')}{', variant ' + result['variant'] if result.get('variant') else ''}; load avg before runs "
                     f"{min(case['loadavg'])}-{max(case['loadavg'])}")
        kernels = {side: runs[0].get("kernels") for side, runs in case["runs"].items() if runs}
        lines.append("kernels: " + "; ".join(f"{side}: {k}" for side, k in kernels.items() if k))
        lines.append(f"{'':24}" + "".join(f"{s:>30}" for s in sides) + "".join(
            f"{s + '/diffusers':>20}" for s in sides if s != "diffusers" and base))
        for key in [k for s, c in zip(STAGES, CPU) for k in (s, c)] + SINGLE:
            if not any(key in d for d in sides.values()):
                continue
            cells = "".join(
                f"{fmt(key, d[key]['min']) + ' ' + fmt(key, d[key]['median']) + ' ' + fmt(key, d[key]['max']) if key in d else '-':>30}"
                for d in sides.values())
            ratios = "".join(f"{sides[s][key]['median'] / base[key]['median'] if key in sides[s] else float('nan'):>20.2f}"
                             for s in sides if s != "diffusers" and key in base)
            unit = "" if key == "peak_rss_bytes" else " (s)"
            lines.append(f"{LABELS[key] + unit:24}{cells}{ratios}")
    lines.append("\ncells: min median max; ratios: medians, oxidiff (or candle) / diffusers (below 1: faster or smaller than diffusers)")
    return "\n".join(lines)


def svg_chart(result, path):
    """Ratios oxidiff / diffusers (medians) as horizontal bars on a log scale, 1.0 marked."""
    import math

    modes = result["modes"] + (["candle"] if "candle" in result.get("impls", []) else [])
    colors = {"cpu": "#1f77b4", "compiled": "#ff7f0e", "eager": "#2ca02c", "candle": "#9467bd",
              "compiled-offload": "#d62728", "eager-offload": "#8c564b"}
    rows = []
    for case in result["cases"]:
        base = case["sides"]["diffusers"]
        title = f"{case['config']}, {case['threads']} thread(s)"
        rows.append(("title", title, None))
        for key in [k for s, c in zip(STAGES, CPU) for k in (s, c)] + SINGLE:
            if key not in base:
                continue
            vals = [(m, case["sides"][m][key]["median"] / base[key]["median"])
                    for m in modes if key in case["sides"].get(m, {})]
            rows.append(("row", LABELS[key], vals))
    bar_h, gap, left, width = 9, 6, 170, 420
    lo, hi = math.log2(1 / 8), math.log2(8)
    x = lambda r: left + (math.log2(min(max(r, 1 / 8), 8)) - lo) / (hi - lo) * width
    y, parts = 40, []
    for kind, label, vals in rows:
        if kind == "title":
            y += 8
            parts.append(f'<text x="4" y="{y + 10}" font-weight="bold">{label}</text>')
            y += 16
            continue
        h = bar_h * len(vals)
        parts.append(f'<text x="{left - 6}" y="{y + h / 2 + 4}" text-anchor="end">{label}</text>')
        for i, (m, r) in enumerate(vals):
            x0, x1 = sorted([x(1.0), x(r)])
            parts.append(f'<rect x="{x0:.1f}" y="{y + i * bar_h}" width="{max(x1 - x0, 1):.1f}" '
                         f'height="{bar_h - 1}" fill="{colors.get(m, "#888")}"/>')
            parts.append(f'<text x="{x1 + 4:.1f}" y="{y + i * bar_h + bar_h - 1}" font-size="9">'
                         f'{r:.2f}</text>')
        y += h + gap
    height = y + 30
    axis = []
    for r in [1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8]:
        xr = x(r)
        axis.append(f'<line x1="{xr:.1f}" y1="30" x2="{xr:.1f}" y2="{height - 20}" '
                    f'stroke="{"#000" if r == 1 else "#ddd"}" stroke-width="{1.5 if r == 1 else 1}"/>')
        axis.append(f'<text x="{xr:.1f}" y="{height - 6}" text-anchor="middle" font-size="10">'
                    f'{r:g}</text>')
    legend = "".join(
        f'<rect x="{left + 120 * i}" y="14" width="10" height="10" fill="{colors.get(m, "#888")}"/>'
        f'<text x="{left + 14 + 120 * i}" y="23">{m if m == "candle" else "oxidiff " + m}</text>'
        for i, m in enumerate(modes))
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 50}" height="{height}" '
           f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>'
           f'<text x="4" y="12" font-size="10">oxidiff / diffusers (median; log scale; left of 1: '
           f'oxidiff faster or smaller)</text>{legend}{"".join(axis)}{"".join(parts)}</svg>\n')
    with open(path, "w") as f:
        f.write(svg)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,sd15-256", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--modes", default="cpu,compiled", help="oxidiff modes: cpu, eager, compiled, and eager-offload or "
                         "compiled-offload (`bench --offload text-encoders`)")
    ap.add_argument("--impls", default="diffusers,oxidiff",
                    help="of diffusers, oxidiff (its --modes), candle (tools/bench/candle: UNet "
                         "step, VAE decode and load only; f32, no --variant: bf16 fails in candle 0.11.1's CPU conv2d), "
                         "sdcpp (stable-diffusion.cpp in f32 and q8_0; f32 files only)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="processes per side and case (default: 3 tiny, 1 SD 1.5)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="timed calls per stage and process (default: 10 tiny, 2 SD 1.5; the text encode at least 10)")
    ap.add_argument("--e2e-repeat", type=int, default=1, help="timed generations after the first")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"],
                    help="both sides' compute dtype (diffusers' torch_dtype, oxidiff's --dtype)")
    ap.add_argument("--variant", default=None,
                    help="both sides read these weight files (diffusers' variant, e.g. fp16: made on first use)")
    ap.add_argument("--sd15-dir", default=None, help="the random-weight SD 1.5 folder (made there on first use; default .cache/sd15-random)")
    ap.add_argument("--device", default="cpu",
                    help="an accelerator both sides run on: cuda (diffusers' torch device; oxidiff's "
                         "eager/compiled modes then use XLA's CUDA plugin instead of xla:cpu)")
    ap.add_argument("--bench-bin", default=os.path.join(ROOT, "target/release/bench"))
    ap.add_argument("--sdcpp-bin", default=None,
                    help="a built stable-diffusion.cpp sd-cli (default: tools/bench/sdcpp/build.sh)")
    ap.add_argument("--candle-bin", default=None,
                    help="a built candle-bench (default: build tools/bench/candle into target/bench-candle)")
    ap.add_argument("--pin-cpu", type=int, default=0,
                    help="the core 1-thread runs are pinned to (another one than a concurrent run's)")
    ap.add_argument("--json", default="tools/bench/results.json")
    ap.add_argument("--svg", default="docs/bench.svg")
    args = ap.parse_args()
    impls = args.impls.split(",")
    modes = args.modes.split(",") if "oxidiff" in impls else []
    if "candle" in impls:
        if args.dtype not in ("f32", "bf16") or args.variant or args.device != "cpu":
            sys.exit("candle runs on the CPU in f32 or bf16 from the f32 weight files only")
        args.candle_bin = args.candle_bin or build_candle()
    sdcpp = []
    if "sdcpp" in impls:
        if args.dtype != "f32" or args.variant or args.device != "cpu":
            sys.exit("stable-diffusion.cpp runs on the CPU from the f32 weight files (its f32 and q8_0 columns)")
        args.sdcpp_bin = args.sdcpp_bin or build_sdcpp()
        sdcpp = ["sdcpp-f32", "sdcpp-q8_0"]
    sides_order = ([s for s in ["diffusers"] if s in impls] + modes
                   + [s for s in ["candle"] if s in impls] + sdcpp)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name")), None),
                    "features": cpu_features()},
        "command": " ".join(sys.argv), "impls": impls, "modes": modes, "device": args.device, "dtype": args.dtype, "variant": args.variant,
        "cases": [],
    }
    print(f"CPU: {result['machine']['cpu']} ({', '.join(result['machine']['features']) or 'no AVX2'}); "
          f"dtype {args.dtype}", file=sys.stderr, flush=True)
    for name in args.configs.split(","):
        dir_, size, steps, repeat, rounds = CONFIGS[name]
        repeat, rounds = args.repeat or repeat, args.rounds or rounds
        if name.startswith("sd15") and args.sd15_dir:
            dir_ = args.sd15_dir
        if not os.path.isfile(os.path.join(dir_, "model_index.json")):
            subprocess.run([sys.executable, "tools/bench/diffusers_bench.py", dir_, "--make-only"],
                           cwd=ROOT, check=True)
        if args.variant:
            subprocess.run([sys.executable, "tools/bench/diffusers_bench.py", dir_, "--make-only",
                            "--variant", args.variant], cwd=ROOT, check=True)
        for threads in [int(t) for t in args.threads.split(",")]:
            print(f"{name}, {threads} thread(s)", file=sys.stderr, flush=True)
            runs = {side: [] for side in sides_order}
            loads = []
            for round_ in range(rounds):
                order = list(sides_order)
                if round_ % 2:
                    order.reverse()
                for side in order:
                    r = run_one(side, dir_, size, steps, repeat, threads, args)
                    loads.append(r["loadavg_before"][0])
                    runs[side].append(r)
            result["cases"].append({
                "config": name, "dir": dir_, "size": size, "steps": steps, "repeat": repeat,
                "threads": threads,
                "rounds": rounds, "loadavg": loads,
                "sides": {side: summarize(rs) for side, rs in runs.items()},
                "runs": runs,
            })
            # Written after every case, so an interrupted run keeps what it measured.
            with open(os.path.join(ROOT, args.json), "w") as f:
                json.dump(result, f, indent=1)
    text = f"CPU: {result['machine']['cpu']} ({', '.join(result['machine']['features'])})\n" + report(result)
    print(text)
    result["table"] = text
    with open(os.path.join(ROOT, args.json), "w") as f:
        json.dump(result, f, indent=1)
    if "diffusers" in impls:
        svg_chart(result, os.path.join(ROOT, args.svg))
    print(f"\nwrote {args.json}" + (f" and {args.svg}" if "diffusers" in impls else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
