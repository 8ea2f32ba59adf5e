#!/usr/bin/env python3
"""Half-precision golden data: diffusers' own bf16 and f16 runs of the tiny pipelines.

Run by hand (never by tests), from the repository root, after the make_tiny_*.py scripts and
make_refiner.py (it reads their fixture folders and changes none of them):

    python3 tools/golden/make_half.py

Loads each tiny pipeline folder with `from_pretrained(..., torch_dtype=...)` in float32,
bfloat16 and (where diffusers' CPU path runs it) float16, as diffusers users load them, and
runs the request of `tests/dtype.rs` (seeded, so the initial latents are torch's draw, which
oxidiff's `TorchCpuGenerator` repeats). Writes

  tests/fixtures/golden/half.safetensors  CASE.DTYPE.latents (every dtype; final latents,
                                          unpacked for Flux), CASE.DTYPE.image (half dtypes;
                                          `output_type="np"`), all stored as float32
  tests/fixtures/golden/half.json         the requests, each half run's distance to the f32
                                          run (`distance_to_f32`) and to an f32 run on its
                                          rounded weights (`distance_to_rounded_weights`), the
                                          same with torch's AVX2 kernels (`..._avx2`) and
                                          between the two kernel sets (`cpu_variation`), versions

Distances are what `tests/common`'s `relative_error` computes: the largest absolute difference
over the largest absolute f32 value. `cpu_variation` reruns every half case in a child process
with `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` (torch's AVX2 kernels, as on a
CPU without AVX-512/AMX) and records how far that run is from the f32 run and from the
default one: torch's bf16 kernels differ between CPUs by about as much as bf16 differs from f32.
The f32 run on rounded weights (every parameter cast to the half dtype and back) splits a half
run's distance to f32 in two: the weights' rounding, which any implementation loading the same
cast weights shares, and the arithmetic's (for the tiny Flux's bf16 nearly all of it, and yet
shared by eager implementations that round each op's output at the same op boundaries).
Reruns give identical bytes.
"""
import os
import subprocess
import sys
import warnings

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_canonical, save_json  # noqa: E402

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
import safetensors  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    FluxPipeline,
    PixArtAlphaPipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
)

# diffusers 0.42 renamed `torch_dtype` to `dtype`; users still load with the old name.
warnings.filterwarnings("ignore", message=".*`torch_dtype` is deprecated")

NAME = "half"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
PROMPT = "a red apple"

# tests/dtype.rs's requests (seed 3, two steps, small sizes, guidance 7.5: its requests take
# `GenerateRequest::default()`'s, not each pipeline's own default), and make_refiner.py's
# `xl-refiner-te2-image` (its f16 is left out: diffusers upcasts SDXL's VAE for f16 only).
CASES = {
    "sd1": dict(
        cls=StableDiffusionPipeline, folder="tiny-sd1", seed=3, dtypes=("f32", "bf16", "f16"),
        load=dict(safety_checker=None),
        call=dict(prompt=PROMPT, num_inference_steps=2, guidance_scale=7.5),
    ),
    "flux": dict(
        cls=FluxPipeline, folder="tiny-flux-dev", seed=3, dtypes=("f32", "bf16", "f16"),
        call=dict(prompt=PROMPT, num_inference_steps=2, guidance_scale=7.5, width=64, height=32,
                  max_sequence_length=16),
    ),
    "sd3": dict(
        cls=StableDiffusion3Pipeline, folder="tiny-sd3", seed=3, dtypes=("f32", "bf16", "f16"),
        call=dict(prompt=PROMPT, negative_prompt="blurry", num_inference_steps=2, guidance_scale=7.5,
                  width=48, height=32,
                  max_sequence_length=16),
    ),
    "pixart": dict(
        cls=PixArtAlphaPipeline, folder="tiny-pixart-alpha", seed=3, dtypes=("f32", "bf16", "f16"),
        call=dict(prompt=PROMPT, negative_prompt="blurry", num_inference_steps=2, guidance_scale=7.5,
                  width=32, height=48,
                  max_sequence_length=16, use_resolution_binning=False, clean_caption=False),
    ),
    "sdxl-refiner": dict(
        cls=StableDiffusionXLImg2ImgPipeline, folder="tiny-sdxl-refiner", seed=42, dtypes=("f32", "bf16"),
        call=dict(prompt="a photo of an astronaut riding a horse", negative_prompt="blurry",
                  num_inference_steps=4, guidance_scale=5.0, strength=0.6, aesthetic_score=7.0,
                  negative_aesthetic_score=2.0),
        image="img2img-input.png",
    ),
}


def relative_error(actual, expected):
    """tests/common's `relative_error`: max |a - e| over max |e|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-12))


MODULES = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def run(case, dtype, weights_rounded_to=None):
    """One generation: (final latents, float image), both float32 numpy arrays. With
    `weights_rounded_to`, an f32 run whose weights are first rounded to that dtype."""
    c = CASES[case]
    pipe = c["cls"].from_pretrained(
        os.path.join(sd.FIXTURES, c["folder"]), local_files_only=True, torch_dtype=DTYPES[dtype],
        **c.get("load", {}),
    )
    pipe.set_progress_bar_config(disable=True)
    for part in MODULES:
        module = getattr(pipe, part, None)
        if module is not None:
            assert module.dtype == DTYPES[dtype], (case, part, module.dtype)
            if weights_rounded_to:
                with torch.no_grad():
                    for p in module.parameters():
                        p.copy_(p.to(DTYPES[weights_rounded_to]).to(p.dtype))
    kwargs = dict(c["call"], generator=sd.gen(c["seed"]), output_type="np")
    if "image" in c:
        kwargs["image"] = PIL.Image.open(os.path.join(sd.GOLDEN, c["image"])).convert("RGB")
    steps = []
    if c["cls"] is PixArtAlphaPipeline:
        kwargs.update(callback=lambda i, t, lat: steps.append(lat.detach().clone()), callback_steps=1)
    else:
        def on_step_end(_pipe, i, t, kw):
            steps.append(kw["latents"].detach().clone())
            return kw

        kwargs.update(callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
    with torch.no_grad():
        images = pipe(**kwargs).images
    latents = steps[-1].to(torch.float32)
    if c["cls"] is FluxPipeline:
        latents = FluxPipeline._unpack_latents(latents, c["call"]["height"], c["call"]["width"],
                                               pipe.vae_scale_factor)
    image = np.asarray(images, dtype=np.float32)
    assert np.isfinite(image).all() and torch.isfinite(latents).all(), (case, dtype)
    return latents.numpy(), image


def half_runs():
    """Every half case: {"CASE.DTYPE": (latents, image)}."""
    return {f"{case}.{d}": run(case, d) for case, c in CASES.items() for d in c["dtypes"] if d != "f32"}


def distance_table(runs, reference):
    """{case: {dtype: {"latents": d, "image": d}}}: each of `runs` ({"CASE.DTYPE": (latents,
    image)}) against `reference(key)`."""
    table = {}
    for key, (latents, image) in runs.items():
        case, dtype = key.split(".")
        ref_latents, ref_image = reference(key)
        table.setdefault(case, {})[dtype] = {
            "latents": relative_error(latents, ref_latents),
            "image": relative_error(image, ref_image),
        }
    return table


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--half-runs-to":
        np.savez(sys.argv[2], **{f"{k}.{part}": v[i] for k, v in half_runs().items()
                                 for i, part in enumerate(("latents", "image"))})
        return
    f32 = {case: run(case, "f32") for case in CASES}
    runs = half_runs()
    # f32 arithmetic on each half run's rounded weights: what is left of the half run's
    # distance to f32 is its arithmetic's rounding.
    rounded = {key: run(key.split(".")[0], "f32", key.split(".")[1]) for key in runs}
    tensors = {f"{case}.f32.latents": latents for case, (latents, _) in f32.items()}
    for key, (latents, image) in runs.items():
        tensors[f"{key}.latents"], tensors[f"{key}.image"] = latents, image

    # The same half runs with torch's AVX2 kernels, in a child (the capability is read at start).
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    tmp = os.path.join("/tmp", f"make_half_avx2_{os.getpid()}.npz")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--half-runs-to", tmp], env=env, check=True)
    with np.load(tmp) as saved:
        avx2 = {key: (saved[f"{key}.latents"], saved[f"{key}.image"]) for key in runs}
    os.remove(tmp)

    def f32_of(key):
        return f32[key.split(".")[0]]

    tables = {
        "distance_to_f32": distance_table(runs, f32_of),
        "distance_to_f32_avx2": distance_table(avx2, f32_of),
        "distance_to_rounded_weights": distance_table(runs, rounded.get),
        "distance_to_rounded_weights_avx2": distance_table(avx2, rounded.get),
        "cpu_variation": distance_table(avx2, runs.get),
    }
    requests = {}
    for case, c in CASES.items():
        requests[case] = dict(c["call"], folder=c["folder"], seed=c["seed"], dtypes=list(c["dtypes"]),
                              pipeline=c["cls"].__name__)
        if "image" in c:
            requests[case]["image"] = c["image"]
    info = {
        "versions": {
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "requests": requests,
        "keys": sorted(tensors),
        **tables,
    }
    save_canonical(os.path.join(sd.GOLDEN, f"{NAME}.safetensors"), tensors)
    save_json(os.path.join(sd.GOLDEN, f"{NAME}.json"), info)
    for what, table in tables.items():
        for case, by_dtype in table.items():
            for dtype, d in by_dtype.items():
                print(f"{what:32} {case:13} {dtype:5} latents {d['latents']:.2e} image {d['image']:.2e}")


if __name__ == "__main__":
    main()
