"""Makes a Flux-architecture transformer with random weights, saved in bf16 (diffusers format),
for the bf16 load benchmark (examples/src/bin/component_load.rs; never run by tests).

    python tools/bench/make_flux_bf16.py .cache/flux-bf16 [--layers 5] [--single-layers 12]

FLUX.1's widths (3072 = 24 heads x 128, T5 4096, CLIP 768) with fewer blocks: the defaults give
about 3.4 B parameters, 6.9 GB in bf16. The weights are made in bf16 directly (torch's default
dtype), so making them needs about that much memory, not twice it.
"""
import argparse
import os

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--single-layers", type=int, default=12)
    args = ap.parse_args()
    if os.path.isfile(os.path.join(args.dir, "config.json")):
        return
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = FluxTransformer2DModel(num_layers=args.layers, num_single_layers=args.single_layers,
                                   guidance_embeds=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e9:.2f} B parameters, {2 * params / 1e9:.2f} GB in bf16")
    model.save_pretrained(args.dir, max_shard_size="20GB")


if __name__ == "__main__":
    main()
