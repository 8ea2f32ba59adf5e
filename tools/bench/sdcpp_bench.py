#!/usr/bin/env python3
"""stable-diffusion.cpp's SD 1.x generation on the random-weight SD 1.5 folder, timed from its own
log and printed as one JSON line in the bench binary's format (the `sdcpp` column of
tools/bench/run.py).

    python3 tools/bench/sdcpp_bench.py DIR --sd-cli PATH --size 256 --steps 4 --quant f32|q8_0 [--threads 1]

sd-cli (tools/bench/sdcpp/build.sh) reads one GGUF file: the folder is converted once per
quantization into target/bench-sdcpp/models (`sd-cli -M convert`; q8_0 quantizes the 2-D
weights it can and keeps the rest f32). Its SD 1.x detection needs the text encoder's
`text_model.` key prefix, which the folder's transformers-5 text encoder leaves out, so the
conversion reads a staged copy with the prefix beside links to unet/ and vae/.

One process generates one image (Euler, CFG 7.5, seed 0) and its log gives: the text encode
(`get_learned_condition`), the sampling (whose mean per step is the UNet step: sd.cpp runs the
conditional and unconditional UNet calls one after the other, the same work as a batch-2 step),
the VAE decode (`decode_first_stage`), loading, the whole generation (end to end) and the whole
process (first image). Each value is one sample: repeat processes (run.py's rounds) for more. Peak RSS is
sd-cli's `ru_maxrss`.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "target", "bench-sdcpp", "models")


def stage_folder(dir_, stage):
    """`stage` as sd.cpp's diffusers loader wants `dir_`: unet/ and vae/ linked, the text
    encoder's keys under `text_model.`."""
    from safetensors.numpy import load_file, save_file

    for part in ("unet", "vae"):
        os.symlink(os.path.abspath(os.path.join(dir_, part)), os.path.join(stage, part))
    os.makedirs(os.path.join(stage, "text_encoder"))
    tensors = load_file(os.path.join(dir_, "text_encoder", "model.safetensors"))
    prefixed = {k if k.startswith("text_model.") else "text_model." + k: v for k, v in tensors.items()}
    save_file(prefixed, os.path.join(stage, "text_encoder", "model.safetensors"))


def model_file(dir_, sd_cli, quant):
    """The GGUF of `dir_` in `quant`, converted on first use."""
    name = os.path.basename(os.path.normpath(dir_))
    path = os.path.join(MODELS, f"{name}-{quant}.gguf")
    if os.path.isfile(path):
        return path
    os.makedirs(MODELS, exist_ok=True)
    with tempfile.TemporaryDirectory() as stage:
        stage_folder(dir_, stage)
        partial = path + ".partial"
        convert = subprocess.run([sd_cli, "-M", "convert", "-m", stage, "-o", partial,
                                  "--type", quant], capture_output=True, text=True)
        if convert.returncode != 0:
            sys.exit(f"converting {dir_} to {quant} failed:\n{(convert.stdout + convert.stderr)[-3000:]}")
        os.replace(partial, path)
    return path


def seconds(log, pattern):
    """The seconds of the last log line matching `pattern` (one `([0-9.]+)s` group)."""
    found = re.findall(pattern, log)
    if not found:
        sys.exit(f"sd-cli's log has no line matching {pattern!r}:\n{log[-3000:]}")
    return float(found[-1])


def stage(seconds_):
    return {"times_s": [seconds_], "median_s": seconds_, "min_s": seconds_, "max_s": seconds_,
            "first_s": None, "repeats": 1}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--sd-cli", required=True)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quant", default="f32", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = model_file(args.dir, args.sd_cli, args.quant)
    with tempfile.TemporaryDirectory() as out:
        cmd = [args.sd_cli, "-m", model, "-p", "a photo of an astronaut riding a horse",
               "-W", str(args.size), "-H", str(args.size), "--steps", str(args.steps),
               "--cfg-scale", "7.5", "--sampling-method", "euler", "--seed", "0",
               "-t", str(args.threads), "-o", os.path.join(out, "sdcpp.png")]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = proc.stdout.read()
        # This process's own resource usage: the conversion above is another child.
        _, status, usage = os.wait4(proc.pid, 0)
        process_s = time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{log[-3000:]}")
    sampling = seconds(log, r"sampling completed, taking ([0-9.]+)s")
    generation = seconds(log, r"generate_image completed in ([0-9.]+)s")
    result = {
        "impl": "stable-diffusion.cpp",
        "kernels": f"ggml CPU, weights {args.quant}",
        "dtype": args.quant,
        "size": args.size,
        "steps": args.steps,
        "threads": args.threads,
        "text_encode": stage(seconds(log, r"get_learned_condition completed, taking ([0-9.]+)s")),
        "unet_step": stage(sampling / args.steps),
        "vae_decode": stage(seconds(log, r"decode_first_stage completed, taking ([0-9.]+)s")),
        "end_to_end": stage(generation),
        "load_s": seconds(log, r"loading tensors completed, taking ([0-9.]+)s"),
        "first_generation_s": generation,
        # The whole process, as the bench binary's load and first image.
        "time_to_first_image_s": process_s,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "model_file": os.path.relpath(model, ROOT),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
