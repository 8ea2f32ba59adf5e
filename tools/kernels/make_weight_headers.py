#!/usr/bin/env python3
"""Writes the released SD 1.5 UNet's, SDXL base UNet's and FLUX.1-dev transformer's config and
weights *header* (a safetensors header: each tensor's name, dtype, shape and byte offsets,
without the bytes) into tests/fixtures/aot/, for tracing their compiled programs ahead of time
(`oxidiff::pipelines::aot`) in tests that cannot hold the checkpoints (3.4, 5.1 and 23.8 GB).

Run by hand with diffusers (the models are built on torch's meta device, so nothing is
allocated):

    python3 tools/kernels/make_weight_headers.py

The dtypes are the released files': SD 1.5 in f32 (`diffusion_pytorch_model.safetensors`),
SDXL's `fp16` variant, FLUX.1-dev in bf16. Reruns give identical bytes.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "golden"))
from make_single_file import RELEASED  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "tests", "fixtures", "aot")

# FLUX.1-dev's transformer/config.json.
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])

SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def header(model, dtype):
    """The safetensors header of `model`'s state dict stored in `dtype`, names sorted."""
    tensors = {}
    offset = 0
    for name, tensor in sorted(model.state_dict().items()):
        size = tensor.numel() * SIZES[dtype]
        tensors[name] = {"dtype": dtype, "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    return {"__metadata__": {"format": "pt"}, **tensors}, offset


def write(name, model, dtype):
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    config = {"_class_name": type(model).__name__, **config}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
        f.write("\n")
    data, total = header(model, dtype)
    with open(os.path.join(folder, "diffusion_pytorch_model.header.json"), "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"{name}: {len(data) - 1} tensors, {total / 1e9:.2f} GB in {dtype}")


def main():
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    with torch.device("meta"):
        sd15 = UNet2DConditionModel(**RELEASED["sd15"]["unet"])
        sdxl = UNet2DConditionModel(**RELEASED["sdxl_base"]["unet"])
        flux = FluxTransformer2DModel(**FLUX_DEV)
    write("sd15-unet", sd15, "F32")
    write("sdxl-unet", sdxl, "F16")
    write("flux-dev-transformer", flux, "BF16")


if __name__ == "__main__":
    main()
