#!/usr/bin/env python3
"""Exports JAX's Pallas TPU flash attention as StableHLO artifacts for oxidiff's kernel hub.

Run by hand (never by tests or at run time), with jax 0.10.2 (CPU wheels are enough: a TPU
kernel is exported, not run):

    python3 -m venv /tmp/jax && /tmp/jax/bin/pip install jax==0.10.2
    /tmp/jax/bin/python tools/kernels/export_flash_attention.py

For each shape bucket and dtype below, two artifacts from the same source and parameters:
- `tpu`: `jax.export` for the TPU platform: the kernel as a `stablehlo.custom_call
  @tpu_custom_call` carrying its Mosaic body, which libtpu compiles for the chip it targets
  (the export is the same for v5e and v6e);
- `interpret`: the same `pallas_call` in Pallas' interpret mode (`interpret=True`), lowered for
  the CPU: plain StableHLO (`while` loops over the blocks), so the kernel's logic runs on XLA's
  CPU plugin and is tested there.
Writes kernels/flash_attention/NAME.mlir and kernels/flash_attention/manifest.json (the
kernel's name, source module, jax version, parameters, shapes, dtype, targets, and each
artifact's sha256). Reruns give identical bytes.
"""
import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas
from jax.experimental.pallas.ops.tpu import flash_attention as fa

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "kernels", "flash_attention")
JAX_VERSION = "0.10.2"

# (batch, heads, sequence, head dim), the targets and the dtypes exported for it: the tests'
# bucket; tiny-sd1's self-attentions at 64x64 with CFG (8x8, 4x4, 2x2 and 1x1 latents; 2 and 4
# channels a head), in interpret mode only (too small for a TPU's tiles), for the test that a
# pipeline gives the same image with kernels spliced in; and the self-attentions of the released
# models' denoiser programs (tests/fixtures/aot), in bf16 (f32 too for SD 1.5's first block):
# SD 1.5 at 512x512 with CFG (batch 2, 8 heads; 64x64 and 32x32 latents, 40 and 80 channels a
# head; its 160-channel heads at 16x16 and 8x8 have no kernel: the op takes head dimensions up to
# 128 or multiples of 128, so they keep the plain lowering), SDXL at 1024x1024 with CFG (10 and 20 heads of 64 at 64x64 and 32x32),
# FLUX.1-dev at 1024x1024 (24 heads of 128 over 512 text and 4096 image tokens).
BOTH = ("float32", "bfloat16")
BF16 = ("bfloat16",)
BUCKETS = [
    ((1, 2, 128, 64), ("tpu", "interpret"), BOTH),
    ((2, 8, 64, 2), ("interpret",), BOTH),
    ((2, 8, 16, 2), ("interpret",), BOTH),
    ((2, 8, 4, 4), ("interpret",), BOTH),
    ((2, 8, 1, 4), ("interpret",), BOTH),
    ((2, 8, 4096, 40), ("tpu", "interpret"), BOTH),
    ((2, 8, 1024, 80), ("tpu", "interpret"), BF16),
    ((2, 10, 4096, 64), ("tpu", "interpret"), BF16),
    ((2, 20, 1024, 64), ("tpu", "interpret"), BF16),
    ((1, 24, 4608, 128), ("tpu", "interpret"), BF16),
    # Per device under tensor parallelism (a kernel call runs on each device's own heads):
    # FLUX.1-dev over TPU v5e's 2x2 chips (tp 4: 6 heads a chip), tiny-sd1 over two xla:cpu
    # devices (tp 2: 4 heads each) for the test of a partitioned pipeline.
    ((1, 6, 4608, 128), ("tpu", "interpret"), BF16),
    ((2, 4, 64, 2), ("interpret",), ("float32",)),
    ((2, 4, 16, 2), ("interpret",), ("float32",)),
    ((2, 4, 4, 4), ("interpret",), ("float32",)),
    ((2, 4, 1, 4), ("interpret",), ("float32",)),
]


class _Interpreting:
    """`pallas` with `pallas_call` forced into interpret mode."""

    def __getattr__(self, name):
        return getattr(pallas, name)

    @staticmethod
    def pallas_call(*args, **kwargs):
        kwargs["interpret"] = True
        return pallas.pallas_call(*args, **kwargs)


def export(shape, dtype, interpret):
    scale = shape[3] ** -0.5

    # The op's default blocks (128) where the sequence allows, else one block.
    block = min(128, shape[2])
    blocks = fa.BlockSizes(
        block_q=block, block_k_major=block, block_k=block, block_b=1,
        block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
        block_k_major_dq=block, block_k_dq=block, block_q_dq=block,
    )

    def f(q, k, v):
        return fa.flash_attention(q, k, v, sm_scale=scale, block_sizes=blocks)

    x = jnp.zeros(shape, dtype)
    # The op's inner functions are jitted: their traces are cached, with or without
    # interpret mode, so each export starts from empty caches.
    jax.clear_caches()
    saved = fa.pl
    if interpret:
        fa.pl = _Interpreting()
    try:
        exported = jax.export.export(jax.jit(f), platforms=["cpu" if interpret else "tpu"])(x, x, x)
    finally:
        fa.pl = saved
    # Debug locations name jax's source files relative to site-packages, not this machine.
    text = re.sub(r'"[^"]*site-packages/', '"', exported.mlir_module())
    # This script's own locations without line numbers, so editing it changes no artifact.
    text = re.sub(re.escape(f'"{os.path.abspath(__file__)}"') + r':\d+:\d+( to (\d+)?:\d+)?',
                  '"tools/kernels/export_flash_attention.py":0:0', text)
    return text, scale


def main():
    assert jax.__version__ == JAX_VERSION, f"export with jax {JAX_VERSION}, not {jax.__version__}"
    os.makedirs(OUT, exist_ok=True)
    artifacts = []
    for shape, targets, dtypes in BUCKETS:
        for dtype in dtypes:
            for target in targets:
                text, scale = export(shape, jnp.dtype(dtype), target == "interpret")
                name = f"{target}-{dtype}-{'x'.join(map(str, shape))}.mlir"
                data = text.encode()
                with open(os.path.join(OUT, name), "wb") as f:
                    f.write(data)
                artifacts.append({
                    "file": name,
                    "target": target,
                    "tpu_generations": ["v5e", "v6e"] if target == "tpu" else [],
                    "shape": list(shape),
                    "dtype": dtype,
                    "sm_scale": scale,
                    "sha256": hashlib.sha256(data).hexdigest(),
                })
                print(f"{name}: {len(data)} bytes")
    manifest = {
        "kernel": "flash_attention",
        "source": "jax.experimental.pallas.ops.tpu.flash_attention.flash_attention",
        "jax": JAX_VERSION,
        "layout": "q, k, v and the output [batch, heads, sequence, head_dim]; softmax(q k^T * sm_scale) v",
        "parameters": {"causal": False, "block_sizes": "min(128, sequence) for every block, block_b 1"},
        "artifacts": artifacts,
    }
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
