#!/usr/bin/env python3
"""Writes the config and weights *header* of the released denoisers (the SD 1.5, SD 2.1 and SDXL
base UNets; the SD3 Medium, SD3.5 Medium, SD3.5 Large and FLUX.1-dev transformers) (a safetensors header: each tensor's name, dtype, shape and byte offsets,
without the bytes) into tests/fixtures/aot/, for tracing their compiled programs ahead of time
(`oxidiff::pipelines::aot`) in tests that cannot hold the checkpoints (2 to 24 GB each).

Run by hand with diffusers (the models are built on torch's meta device, so nothing is
allocated):

    python3 tools/kernels/make_weight_headers.py

The dtypes are the released files': SD 1.5 in f32 (`diffusion_pytorch_model.safetensors`),
SD 2.1's and SDXL's `fp16` variants, SD3 Medium in f16, SD3.5 and FLUX.1-dev in bf16. Reruns
give identical bytes.
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

# The transformer/config.json of stable-diffusion-3-medium-diffusers, stable-diffusion-3.5-medium
# and stable-diffusion-3.5-large (the rest are SD3Transformer2DModel's defaults).
SD3_MEDIUM = dict(num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                  pos_embed_max_size=192)
SD35_MEDIUM = dict(SD3_MEDIUM, pos_embed_max_size=384, qk_norm="rms_norm",
                   dual_attention_layers=tuple(range(13)))
SD35_LARGE = dict(num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                  pos_embed_max_size=192, qk_norm="rms_norm")

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
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

    with torch.device("meta"):
        models = [
            ("sd15-unet", UNet2DConditionModel(**RELEASED["sd15"]["unet"]), "F32"),
            ("sd21-unet", UNet2DConditionModel(**RELEASED["sd21"]["unet"]), "F16"),
            ("sdxl-unet", UNet2DConditionModel(**RELEASED["sdxl_base"]["unet"]), "F16"),
            ("sd3-medium-transformer", SD3Transformer2DModel(**SD3_MEDIUM), "F16"),
            ("sd35-medium-transformer", SD3Transformer2DModel(**SD35_MEDIUM), "BF16"),
            ("sd35-large-transformer", SD3Transformer2DModel(**SD35_LARGE), "BF16"),
            ("flux-dev-transformer", FluxTransformer2DModel(**FLUX_DEV), "BF16"),
        ]
    for name, model, dtype in models:
        write(name, model, dtype)


if __name__ == "__main__":
    main()
