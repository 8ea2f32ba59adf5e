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
# buckets (one of 128s; and, for padding, one of odd sizes that takes one block and one that is
# padded and masked); tiny-sd1's self-attentions at 64x64 with CFG (8x8, 4x4, 2x2 and 1x1
# latents; 2 and 4 channels a head), in interpret mode only (too small for a TPU's tiles), for
# the test that a pipeline gives the same image with kernels spliced in; and the self-attentions
# of the released models' denoiser programs (tests/fixtures/aot), in bf16 (f32 too for SD 1.5's
# first block), all with classifier-free guidance's batch of 2 except Flux (guidance-distilled):
# - SD 1.5 at 512x512: 8 heads; 64x64, 32x32, 16x16 and 8x8 latents with 40, 80, 160 and 160
#   channels a head (160 padded to 256, see `plan`);
# - SD 2.x at 512x512 (base) and 768x768 (v): 5, 10, 20 and 20 heads of 64 (SD 2.1 at 768 has
#   576 and 144 tokens at its third level and middle);
# - SDXL at 1024x1024: 10 and 20 heads of 64 at 64x64 and 32x32;
# - SD3 Medium and SD3.5 Medium at 1024x1024: 24 heads of 64 over 4096 image and 333 text
#   tokens (CLIP's 77 and T5's 256), and SD3.5 Medium's image-only second attention over the
#   4096; SD3.5 Large: 38 heads;
# - FLUX.1-dev at 1024x1024: 24 heads of 128 over 512 text and 4096 image tokens; FLUX.1-schnell
#   over 256 text tokens (its `max_sequence_length`).
BOTH = ("float32", "bfloat16")
BF16 = ("bfloat16",)
BUCKETS = [
    ((1, 2, 128, 64), ("tpu", "interpret"), BOTH),
    ((2, 8, 64, 2), ("interpret",), BOTH),
    ((2, 8, 16, 2), ("interpret",), BOTH),
    ((2, 8, 4, 4), ("interpret",), BOTH),
    ((2, 8, 1, 4), ("interpret",), BOTH),
    ((2, 8, 4096, 40), ("tpu", "interpret"), BOTH),
    ((1, 2, 144, 64), ("tpu", "interpret"), BOTH),
    ((1, 2, 1100, 160), ("tpu", "interpret"), BOTH),
    ((2, 8, 1024, 80), ("tpu", "interpret"), BF16),
    ((2, 8, 256, 160), ("tpu", "interpret"), BF16),
    ((2, 8, 64, 160), ("tpu", "interpret"), BF16),
    ((2, 5, 4096, 64), ("tpu", "interpret"), BF16),
    ((2, 10, 1024, 64), ("tpu", "interpret"), BF16),
    ((2, 20, 256, 64), ("tpu", "interpret"), BF16),
    ((2, 20, 64, 64), ("tpu", "interpret"), BF16),
    ((2, 5, 9216, 64), ("tpu", "interpret"), BF16),
    ((2, 10, 2304, 64), ("tpu", "interpret"), BF16),
    ((2, 20, 576, 64), ("tpu", "interpret"), BF16),
    ((2, 20, 144, 64), ("tpu", "interpret"), BF16),
    ((2, 10, 4096, 64), ("tpu", "interpret"), BF16),
    ((2, 20, 1024, 64), ("tpu", "interpret"), BF16),
    ((2, 24, 4429, 64), ("tpu", "interpret"), BF16),
    ((2, 24, 4096, 64), ("tpu", "interpret"), BF16),
    ((2, 38, 4429, 64), ("tpu", "interpret"), BF16),
    ((1, 24, 4608, 128), ("tpu", "interpret"), BF16),
    ((1, 24, 4352, 128), ("tpu", "interpret"), BF16),
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


# The longest sequence that is not a multiple of 128 and is still taken as one block (its
# scores, [sequence, sequence] in f32, stay in a TPU core's VMEM); longer ones are padded.
ONE_BLOCK_MAX = 1024


def plan(shape):
    """How the kernel covers `shape`: the sequence and head dim it runs on and its block size.

    The op's blocks must divide the sequence, and its key blocks, once there is more than one,
    must be multiples of 128; head dims over 128 must be multiples of 128. So:
    - a sequence of 128s: blocks of 128 (the op's default);
    - another sequence up to ONE_BLOCK_MAX: one block of the whole sequence;
    - a longer one: padded to the next multiple of 128, the padding masked out with the op's
      segment ids (real tokens attend to real tokens only), blocks of 128;
    - a head dim over 128 that is not a multiple of 128: padded with zeros to the next one
      (zeros add nothing to q k^T, and the output's padded columns are dropped).
    The softmax scale stays the real head dim's."""
    _, _, seq, dim = shape
    if seq % 128 == 0:
        padded_seq, block = seq, 128
    elif seq <= ONE_BLOCK_MAX:
        padded_seq, block = seq, seq
    else:
        padded_seq, block = -(-seq // 128) * 128, 128
    padded_dim = dim if dim <= 128 else -(-dim // 128) * 128
    return padded_seq, padded_dim, block


def export(shape, dtype, interpret):
    batch, _, seq, dim = shape
    scale = dim ** -0.5
    padded_seq, padded_dim, block = plan(shape)
    blocks = fa.BlockSizes(
        block_q=block, block_k_major=block, block_k=block, block_b=1,
        block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
        block_k_major_dq=block, block_k_dq=block, block_q_dq=block,
    )
    pad = ((0, 0), (0, 0), (0, padded_seq - seq), (0, padded_dim - dim))
    segment_ids = None
    if padded_seq != seq:
        ids = (jnp.arange(padded_seq) >= seq).astype(jnp.int32)
        ids = jnp.broadcast_to(ids, (batch, padded_seq))
        segment_ids = fa.SegmentIds(q=ids, kv=ids)

    def f(q, k, v):
        if padded_seq == seq and padded_dim == dim:
            return fa.flash_attention(q, k, v, sm_scale=scale, block_sizes=blocks)
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        out = fa.flash_attention(q, k, v, segment_ids=segment_ids, sm_scale=scale,
                                 block_sizes=blocks)
        return out[:, :, :seq, :dim]

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
    return text, scale, (padded_seq, padded_dim, block, segment_ids is not None)


def main():
    assert jax.__version__ == JAX_VERSION, f"export with jax {JAX_VERSION}, not {jax.__version__}"
    os.makedirs(OUT, exist_ok=True)
    artifacts = []
    for shape, targets, dtypes in BUCKETS:
        for dtype in dtypes:
            for target in targets:
                text, scale, (padded_seq, padded_dim, block, masked) = export(
                    shape, jnp.dtype(dtype), target == "interpret")
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
                    "kernel_shape": [shape[0], shape[1], padded_seq, padded_dim],
                    "block": block,
                    "padding_masked": masked,
                    "sha256": hashlib.sha256(data).hexdigest(),
                })
                print(f"{name}: {len(data)} bytes")
    manifest = {
        "kernel": "flash_attention",
        "source": "jax.experimental.pallas.ops.tpu.flash_attention.flash_attention",
        "jax": JAX_VERSION,
        "layout": "q, k, v and the output [batch, heads, sequence, head_dim]; softmax(q k^T * sm_scale) v",
        "parameters": {
            "causal": False,
            "block_sizes": "128 for every block where the sequence is a multiple of 128, else "
                           f"one block up to {ONE_BLOCK_MAX}, else padded to 128s; block_b 1",
            "padding": "kernel_shape is the shape the op runs on: the sequence padded to 128s "
                       "with segment ids masking the padding (padding_masked), head dims over "
                       "128 padded with zeros to 128s; the artifact takes and returns `shape`",
        },
        "artifacts": artifacts,
    }
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
