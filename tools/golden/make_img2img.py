#!/usr/bin/env python3
"""Golden data for SD 1.x image to image on the tiny-sd1 pipeline.

Run by hand (never by tests), from the repository root, after make_tiny_sd.py:

    python3 tools/golden/make_img2img.py

Writes tests/fixtures/golden/img2img-input.png (a seeded 64x64 RGB image),
tests/fixtures/golden/img2img.{json,safetensors} and img2img-S.png for each scheduler S:
diffusers' `StableDiffusionImg2ImgPipeline` on tests/fixtures/tiny-sd1 with strength 0.75,
4 steps (3 run), guidance 7.5, generator seed 42 (the VAE sample, then the initial noise),
recording the preprocessed image, per-step latents and the final image. The input image is
already 64x64, so no resampling (PIL's Lanczos) is involved. Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_canonical, save_json  # noqa: E402

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import EulerDiscreteScheduler, PNDMScheduler, StableDiffusionImg2ImgPipeline  # noqa: E402

SETTINGS = {
    "prompt": "a photo of an astronaut riding a horse",
    "negative_prompt": "blurry",
    "num_inference_steps": 4,
    "guidance_scale": 7.5,
    "strength": 0.75,
    "seed": 42,
}
SCHEDULERS = {"pndm": PNDMScheduler, "euler": EulerDiscreteScheduler}


def input_image():
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:64, 0:64]
    base = np.stack([x * 4, y * 4, (x + y) * 2], axis=-1).astype(np.float64)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(pixels, "RGB")


def main():
    folder = os.path.join(sd.FIXTURES, "tiny-sd1")
    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    image = input_image()
    image.save(os.path.join(sd.GOLDEN, "img2img-input.png"))
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    tensors = {"preprocessed": pipe.image_processor.preprocess(image)}
    info = {"pipeline": dict(SETTINGS), "diffusers": diffusers.__version__, "timesteps": {}}
    base = dict(pipe.scheduler.config)
    s = SETTINGS
    for name, cls in SCHEDULERS.items():
        pipe.scheduler = cls.from_config(base)
        for output in ("np", "pil"):
            steps, ts = [], []

            def on_step_end(_pipe, i, t, kw):
                steps.append(kw["latents"].detach().clone())
                ts.append(float(t))
                return kw

            res = pipe(
                prompt=s["prompt"],
                negative_prompt=s["negative_prompt"],
                image=image,
                strength=s["strength"],
                num_inference_steps=s["num_inference_steps"],
                guidance_scale=s["guidance_scale"],
                generator=sd.gen(s["seed"]),
                output_type=output,
                callback_on_step_end=on_step_end,
                callback_on_step_end_tensor_inputs=["latents"],
            )
            if output == "np":
                for i, st in enumerate(steps):
                    tensors[f"{name}.step{i}"] = st
                tensors[f"{name}.image"] = np.asarray(res.images, dtype=np.float32)
                info["timesteps"][name] = ts
            else:
                assert all(torch.equal(a, tensors[f"{name}.step{i}"]) for i, a in enumerate(steps))
                res.images[0].save(os.path.join(sd.GOLDEN, f"img2img-{name}.png"))
    save_canonical(os.path.join(sd.GOLDEN, "img2img.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(sd.GOLDEN, "img2img.json"), info)
    print("wrote golden/img2img.*")


if __name__ == "__main__":
    main()
