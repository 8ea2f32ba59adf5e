#!/usr/bin/env python3
"""A tiny random-weight IP-Adapter (h94 layout) for tiny-sd1 and tiny-sdxl, its tiny CLIP
image encoder, and golden data from diffusers' `load_ip_adapter` pipelines.

Run by hand (never by tests), from the repository root, after make_tiny_sd.py and
make_tiny_sdxl.py:

    python3 tools/golden/make_ip_adapter.py

Writes:
- tests/fixtures/ip-adapter/image_encoder/: a `CLIPVisionModelWithProjection` (hidden 32,
  intermediate 37, 2 layers, 4 heads, image_size 64, patch 16, projection_dim 24, quick_gelu),
  seeded; norm weights and biases re-randomised as make_tiny_sd.py does.
- tests/fixtures/ip-adapter/ip-adapter_sd1.safetensors and ip-adapter_sdxl.safetensors: the
  original h94 layout (`image_proj.proj.*`, `image_proj.norm.*`, `ip_adapter.{1,3,5..}.to_k_ip`
  / `to_v_ip`, one pair per cross-attention in diffusers' `attn_processors` order), 4 image
  tokens, random normal weights (std 0.3 for the IP key/value projections) so that the image
  prompt visibly changes the output.
- tests/fixtures/golden/ip-adapter-input.png: a seeded 80x56 picture (not square: the
  processor resizes the short side and centre-crops).
- tests/fixtures/golden/ip-adapter.safetensors: `pixel_values` [1, 3, 64, 64] (the
  `CLIPImageProcessor(size=64, crop_size=64)` that `load_ip_adapter` makes when the pipeline
  has no feature extractor), the encoder's `image_embeds` [1, 24] and the SD 1.x image
  projection's tokens `sd1.image_tokens` [1, 4, 32] (row 0 the image; `sd1.uncond_tokens` the
  projection of zeros, as `encode_image` makes the negative).
- tests/fixtures/golden/ip-adapter-sd1.png and ip-adapter-sdxl.png: whole pipeline runs
  (prompt below, negative prompt "blurry", 4 steps, seed 42, 64x64; guidance 7.5 with PNDM for
  SD 1.x, 5.0 with Euler for SDXL) at `set_ip_adapter_scale(0.8)`.
- tests/fixtures/golden/ip-adapter-sd1-img2img.png: `StableDiffusionImg2ImgPipeline.from_pipe`
  of the SD 1.x run on golden/img2img-input.png at strength 0.75, otherwise the same.
- tests/fixtures/golden/ip-adapter-sd1-controlnet.png: `StableDiffusionControlNetPipeline.from_pipe`
  of the SD 1.x run with tiny-controlnet-sd1 on golden/controlnet-input.png, otherwise the same.
- tests/fixtures/ip-adapter/ip-adapter-plus_sd1.safetensors: IP-Adapter Plus for tiny-sd1 in
  the h94 layout (resampler: 6 queries of width 16, 4 blocks, one 64-wide head), and
  golden/ip-adapter-plus-sd1.png its SD 1.x run as above; ip-adapter.safetensors also holds
  `plus.hidden_states` (the encoder's `hidden_states[-2]`) and `plus.image_tokens` /
  `plus.uncond_tokens` (the resampler on the image's and on an all-zero image's states).
- tests/fixtures/golden/ip-adapter.json: the settings and the attention processor names in
  order.
Reruns give identical bytes.
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
import transformers  # noqa: E402
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline  # noqa: E402
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection  # noqa: E402

PROMPT = "a photo of an astronaut riding a horse"
SCALE = 0.8
OUT = os.path.join(sd.FIXTURES, "ip-adapter")


def make_image_encoder():
    torch.manual_seed(31)
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, image_size=64, patch_size=16,
                              projection_dim=24, hidden_act="quick_gelu")
    model = CLIPVisionModelWithProjection(config).eval()
    gen = torch.Generator().manual_seed(32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layrnorm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("class_embedding"):
                p.copy_(torch.randn(p.shape, generator=gen))
    folder = os.path.join(OUT, "image_encoder")
    model.save_pretrained(folder, safe_serialization=True)
    sd.canonicalize_safetensors(folder)
    return CLIPVisionModelWithProjection.from_pretrained(folder).eval()


def attn2_processors(unet):
    """(name, hidden size) of each cross-attention processor, in `attn_processors` order."""
    out = []
    for name in unet.attn_processors.keys():
        if name.endswith("attn2.processor"):
            module = unet.get_submodule(name[: -len(".processor")])
            out.append((name, module.to_q.out_features))
    return out


def make_weights(unet, seed, path, clip_dim=24, tokens=4):
    gen = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    tensors = {
        "image_proj.proj.weight": torch.randn(tokens * cross, clip_dim, generator=gen) * 0.2,
        "image_proj.proj.bias": torch.randn(tokens * cross, generator=gen) * 0.1,
        "image_proj.norm.weight": 1.0 + 0.1 * torch.randn(cross, generator=gen),
        "image_proj.norm.bias": 0.1 * torch.randn(cross, generator=gen),
    }
    names = attn2_processors(unet)
    for i, (_, hidden) in enumerate(names):
        key = 2 * i + 1
        tensors[f"ip_adapter.{key}.to_k_ip.weight"] = torch.randn(hidden, cross, generator=gen) * 0.3
        tensors[f"ip_adapter.{key}.to_v_ip.weight"] = torch.randn(hidden, cross, generator=gen) * 0.3
    save_canonical(path, {k: v.contiguous() for k, v in tensors.items()})
    return [n for n, _ in names]


def make_plus_weights(unet, seed, path, embed=32, hidden=16, queries=6, depth=4):
    """IP-Adapter Plus in the h94 layout: the `Resampler` (`image_proj.latents`, `proj_in`,
    `layers.i.0` perceiver attention with 64-wide heads, `layers.i.1` feed-forward, `proj_out`,
    `norm_out`) and the same `ip_adapter.N` pairs."""
    gen = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    randn = lambda *shape, std=0.3: torch.randn(*shape, generator=gen) * std  # noqa: E731
    norm = lambda n: (1.0 + randn(n, std=0.1), randn(n, std=0.1))  # noqa: E731
    tensors = {
        "image_proj.latents": randn(1, queries, hidden, std=1.0),
        "image_proj.proj_in.weight": randn(hidden, embed),
        "image_proj.proj_in.bias": randn(hidden, std=0.1),
        "image_proj.proj_out.weight": randn(cross, hidden, std=0.2),
        "image_proj.proj_out.bias": randn(cross, std=0.1),
    }
    tensors["image_proj.norm_out.weight"], tensors["image_proj.norm_out.bias"] = norm(cross)
    for i in range(depth):
        p = f"image_proj.layers.{i}"
        for n in ("0.norm1", "0.norm2", "1.0"):
            tensors[f"{p}.{n}.weight"], tensors[f"{p}.{n}.bias"] = norm(hidden)
        tensors[f"{p}.0.to_q.weight"] = randn(64, hidden, std=0.2)
        tensors[f"{p}.0.to_kv.weight"] = randn(128, hidden, std=0.2)
        tensors[f"{p}.0.to_out.weight"] = randn(hidden, 64, std=0.2)
        tensors[f"{p}.1.1.weight"] = randn(4 * hidden, hidden, std=0.2)
        tensors[f"{p}.1.3.weight"] = randn(hidden, 4 * hidden, std=0.1)
    for i, (_, width) in enumerate(attn2_processors(unet)):
        tensors[f"ip_adapter.{2 * i + 1}.to_k_ip.weight"] = randn(width, cross)
        tensors[f"ip_adapter.{2 * i + 1}.to_v_ip.weight"] = randn(width, cross)
    save_canonical(path, {k: v.contiguous() for k, v in tensors.items()})


def input_image():
    rng = np.random.default_rng(8)
    y, x = np.mgrid[0:56, 0:80]
    pixels = np.stack([(x * 3) % 256, (y * 4) % 256, ((x + y) * 2) % 256], -1).astype(np.int32)
    pixels[((x - 50) ** 2 + (y - 25) ** 2) < 150] = [250, 40, 30]
    pixels = np.clip(pixels + rng.integers(0, 30, pixels.shape), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(pixels, "RGB")


def main():
    os.makedirs(OUT, exist_ok=True)
    make_image_encoder()
    path = os.path.join(sd.GOLDEN, "ip-adapter-input.png")
    input_image().save(path)
    image = PIL.Image.open(path).convert("RGB")
    info = {"prompt": PROMPT, "negative_prompt": "blurry", "steps": 4, "seed": 42, "scale": SCALE,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "processors": {}}
    tensors = {}
    runs = [("sd1", "tiny-sd1", StableDiffusionPipeline, 7.5, 41),
            ("sdxl", "tiny-sdxl", StableDiffusionXLPipeline, 5.0, 42)]
    for name, model, cls, guidance, seed in runs:
        extra = {"safety_checker": None} if name == "sd1" else {}
        pipe = cls.from_pretrained(os.path.join(sd.FIXTURES, model), local_files_only=True, **extra)
        pipe.set_progress_bar_config(disable=True)
        weight_name = f"ip-adapter_{name}.safetensors"
        info["processors"][name] = make_weights(pipe.unet, seed, os.path.join(OUT, weight_name))
        pipe.load_ip_adapter(OUT, subfolder="", weight_name=weight_name,
                             image_encoder_folder="image_encoder", local_files_only=True)
        pipe.set_ip_adapter_scale(SCALE)
        if name == "sd1":
            pixels = pipe.feature_extractor(image, return_tensors="pt").pixel_values
            with torch.no_grad():
                embeds, uncond = pipe.encode_image(image, "cpu", 1)
                proj = pipe.unet.encoder_hid_proj.image_projection_layers[0]
                tensors["pixel_values"] = pixels
                tensors["image_embeds"] = embeds
                tensors["sd1.image_tokens"] = proj(embeds)
                tensors["sd1.uncond_tokens"] = proj(uncond)
        out = pipe(PROMPT, negative_prompt="blurry", ip_adapter_image=image, num_inference_steps=4,
                   guidance_scale=guidance, generator=torch.Generator().manual_seed(42)).images[0]
        out.save(os.path.join(sd.GOLDEN, f"ip-adapter-{name}.png"))
        info[f"{name}_guidance"] = guidance
        if name == "sd1":
            # Image to image shares the pipeline's IP-Adapter (diffusers' from_pipe).
            from diffusers import StableDiffusionImg2ImgPipeline
            edit = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
            edit.set_progress_bar_config(disable=True)
            init = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
            out = edit(PROMPT, image=init, strength=0.75, negative_prompt="blurry",
                       ip_adapter_image=image, num_inference_steps=4, guidance_scale=guidance,
                       generator=torch.Generator().manual_seed(42)).images[0]
            out.save(os.path.join(sd.GOLDEN, "ip-adapter-sd1-img2img.png"))
            info["img2img_strength"] = 0.75
            # With a ControlNet (diffusers' from_pipe keeps the IP-Adapter): the ControlNet
            # attends to the text alone, the UNet to text and image tokens.
            from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
            net = ControlNetModel.from_pretrained(os.path.join(sd.FIXTURES, "tiny-controlnet-sd1"))
            controlled = StableDiffusionControlNetPipeline.from_pipe(pipe, controlnet=net)
            controlled.set_progress_bar_config(disable=True)
            control = PIL.Image.open(os.path.join(sd.GOLDEN, "controlnet-input.png")).convert("RGB")
            out = controlled(PROMPT, image=control, negative_prompt="blurry",
                             ip_adapter_image=image, num_inference_steps=4, guidance_scale=guidance,
                             generator=torch.Generator().manual_seed(42)).images[0]
            out.save(os.path.join(sd.GOLDEN, "ip-adapter-sd1-controlnet.png"))
    # IP-Adapter Plus on tiny-sd1: the resampler over the encoder's penultimate hidden states.
    pipe = StableDiffusionPipeline.from_pretrained(os.path.join(sd.FIXTURES, "tiny-sd1"),
                                                   local_files_only=True, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    make_plus_weights(pipe.unet, 43, os.path.join(OUT, "ip-adapter-plus_sd1.safetensors"))
    pipe.load_ip_adapter(OUT, subfolder="", weight_name="ip-adapter-plus_sd1.safetensors",
                         image_encoder_folder="image_encoder", local_files_only=True)
    pipe.set_ip_adapter_scale(SCALE)
    with torch.no_grad():
        hidden, uncond = pipe.encode_image(image, "cpu", 1, output_hidden_states=True)
        proj = pipe.unet.encoder_hid_proj.image_projection_layers[0]
        tensors["plus.hidden_states"] = hidden
        tensors["plus.image_tokens"] = proj(hidden)
        tensors["plus.uncond_tokens"] = proj(uncond)
    out = pipe(PROMPT, negative_prompt="blurry", ip_adapter_image=image, num_inference_steps=4,
               guidance_scale=7.5, generator=torch.Generator().manual_seed(42)).images[0]
    out.save(os.path.join(sd.GOLDEN, "ip-adapter-plus-sd1.png"))
    save_canonical(os.path.join(sd.GOLDEN, "ip-adapter.safetensors"), tensors)
    save_json(os.path.join(sd.GOLDEN, "ip-adapter.json"), info)


if __name__ == "__main__":
    main()
