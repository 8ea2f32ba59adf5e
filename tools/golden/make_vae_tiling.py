#!/usr/bin/env python3
"""Golden data for tiled and sliced VAE encode/decode (diffusers' `enable_tiling()` and
`enable_slicing()`).

Run by hand (never by tests), from the repository root, after make_tiny_sd.py and
make_tiny_sdxl.py:

    python3 tools/golden/make_vae_tiling.py

Writes tests/fixtures/golden/vae-tiling.{json,safetensors}: tiny-sd1's VAE with 64-pixel tiles
(`tile_sample_min_size = 64`, `tile_latent_min_size = 8`, overlap 0.25) on seeded inputs whose
sizes leave partial tiles at the edges: the tiled decode of latents [2, 4, 16, 20] (the json
records how far it is from the untiled one) and the tiled encode (mean and logvar) of
an image [1, 3, 128, 96]. And vae-tiling-sd1.png / vae-tiling-sdxl.png: whole txt2img runs at
128x128 with the same tiles (prompt as below, negative prompt "blurry", 4 steps, seed 42, the
folders' schedulers). Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_canonical, save_json  # noqa: E402

import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline  # noqa: E402

TILE = 64
SETTINGS = {
    "prompt": "a photo of an astronaut riding a horse",
    "negative_prompt": "blurry",
    "num_inference_steps": 4,
    "seed": 42,
    "width": 128,
    "height": 128,
    "tile_sample_min_size": TILE,
}


def tile(vae):
    vae.enable_tiling()
    vae.tile_sample_min_size = TILE
    vae.tile_latent_min_size = TILE // (2 ** (len(vae.config.block_out_channels) - 1))


def main():
    vae = AutoencoderKL.from_pretrained(os.path.join(sd.FIXTURES, "tiny-sd1", "vae"), local_files_only=True)
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 4, 16, 20, generator=gen)
    x = torch.rand(1, 3, 128, 96, generator=gen) * 2 - 1
    with torch.no_grad():
        untiled = vae.decode(z).sample
        tile(vae)
        tiled = vae.decode(z).sample
        dist = vae.encode(x).latent_dist
    tensors = {
        "latents": z,
        "image": x,
        "decode.tiled": tiled,
        "encode.mean": dist.mean,
        "encode.logvar": dist.logvar,
    }
    save_canonical(os.path.join(sd.GOLDEN, "vae-tiling.safetensors"), tensors)
    info = {
        "settings": dict(SETTINGS),
        "tile_latent_min_size": vae.tile_latent_min_size,
        "tiled_vs_untiled_max_abs": float((tiled - untiled).abs().max()),
        "diffusers": diffusers.__version__,
        "torch": torch.__version__,
    }
    s = SETTINGS
    for name, cls in [("sd1", StableDiffusionPipeline), ("sdxl", StableDiffusionXLPipeline)]:
        folder = os.path.join(sd.FIXTURES, f"tiny-{name}")
        kwargs = {"safety_checker": None} if name == "sd1" else {}
        pipe = cls.from_pretrained(folder, local_files_only=True, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        tile(pipe.vae)
        image = pipe(
            s["prompt"],
            negative_prompt=s["negative_prompt"],
            num_inference_steps=s["num_inference_steps"],
            width=s["width"],
            height=s["height"],
            generator=torch.Generator().manual_seed(s["seed"]),
        ).images[0]
        image.save(os.path.join(sd.GOLDEN, f"vae-tiling-{name}.png"))
        info[f"{name}_guidance_scale"] = pipe.guidance_scale
    save_json(os.path.join(sd.GOLDEN, "vae-tiling.json"), info)


if __name__ == "__main__":
    main()
