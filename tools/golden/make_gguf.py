#!/usr/bin/env python3
"""Build GGUF fixtures and their references from gguf-py and diffusers.

Run by hand (never by tests), from the repository root, after make_tiny_flux.py (the Flux
pipeline around the quantized transformer is tiny-flux-schnell's):

    python3 tools/golden/make_gguf.py

Writes:
  tests/fixtures/gguf/blocks.gguf        one [3, 512] tensor of every GGML type oxidiff reads:
                                         quantized by gguf-py from random values where gguf-py
                                         can quantize, random blocks with finite scales for the
                                         K types (gguf-py only dequantizes those)
  tests/fixtures/gguf/blocks-dequantized.safetensors  gguf.quants.dequantize of each, f32
  tests/fixtures/tiny-flux-gguf/transformer/config.json  a Flux transformer wide enough for
                                         256-value blocks (inner dim 256), schnell's text sizes
  tests/fixtures/tiny-flux-gguf/flux-{Q8_0,Q4_0,Q4_K}.gguf  its random weights quantized the
                                         way city96's converter writes them (1-D and small
                                         tensors F32, rows that are no whole number of blocks
                                         F16), under diffusers' key names
  tests/fixtures/tiny-flux-gguf/flux-bfl-Q8_0.gguf  the same Q8_0 weights under the original
                                         (BFL) key names, fused q/k/v as city96's files carry
                                         (diffusers' BFL conversion assumes FLUX.1's sizes, so
                                         this one has no diffusers reference of its own: it
                                         must load to exactly the Q8_0 file's model)
  tests/fixtures/golden/gguf.safetensors  one transformer call per file (diffusers'
                                         GGUFQuantizationConfig, compute dtype f32; and the same
                                         model with the weights dequantized by gguf-py in f32)
                                         and its inputs
  tests/fixtures/golden/gguf-flux-{Q8_0,Q4_0,Q4_K}.png  schnell generations with each file
  tests/fixtures/tiny-sd3-gguf/transformer/config.json, sd3-{Q8_0,Q4_0,Q4_K}.gguf  the same
                                         for an SD3 transformer (inner dim 256, tiny-sd3's text
                                         sizes), with one call of each in golden/gguf.safetensors
                                         (`sd3.*`)
  tests/fixtures/golden/gguf-sd3-{Q8_0,Q4_0,Q4_K}.png  tiny-sd3 generations (make_tiny_sd3.py's
                                         settings) with each SD3 file as the transformer
  tests/fixtures/golden/gguf.json         settings and versions
"""
import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import numpy as np
import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save_canonical, save_json  # noqa: E402
from make_tiny_flux import SCHNELL_RUN  # noqa: E402
from make_tiny_sd3 import PIPELINE_SETTINGS as SD3_PIPELINE_SETTINGS  # noqa: E402
from make_tiny_sd import gen, perturb  # noqa: E402

import diffusers  # noqa: E402
import gguf  # noqa: E402
from diffusers import (  # noqa: E402
    FluxPipeline,
    FluxTransformer2DModel,
    GGUFQuantizationConfig,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.utils import logging as dlogging  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

dlogging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")
GGUF_DIR = os.path.join(FIXTURES, "gguf")
FLUX_DIR = os.path.join(FIXTURES, "tiny-flux-gguf")
SD3_DIR = os.path.join(FIXTURES, "tiny-sd3-gguf")
SEED = 7100
QK_K = 256

BLOCK_TYPES = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
]
# Byte ranges of the f16 scales in each K block (d, and dmin where there is one).
K_SCALES = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
FLUX_TYPES = ["Q8_0", "Q4_0", "Q4_K"]



def random_blocks(qtype, rows, cols, rng):
    """Quantized bytes [rows, row_bytes] of `qtype`: gguf-py's quantization of random values,
    or random bytes with finite f16 scales for the K types."""
    t = Q[qtype]
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype not in K_SCALES:
        return gguf.quants.quantize(values, t)
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        scale = rng.uniform(-0.05, 0.05, size=raw.shape[0]).astype(np.float16)
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def quantize_q4_k(values):
    """Q4_K blocks of f32 `values` [rows, cols] (gguf-py has no Q4_K quantizer): per 32 values
    an unsigned 4-bit code with a 6-bit scale and minimum, those relative to f16 `d`/`dmin`."""
    rows, cols = values.shape
    x = values.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=2), 0.0)
    hi = x.max(axis=2)
    scale = np.maximum((hi - lo) / 15.0, 1e-8)
    minimum = -lo
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = (minimum.max(axis=1) / 63.0).astype(np.float16)
    d32 = np.maximum(d.astype(np.float32), 1e-8)[:, None]
    dmin32 = np.maximum(dmin.astype(np.float32), 1e-8)[:, None]
    sc = np.clip(np.round(scale / d32), 0, 63).astype(np.uint8)
    m = np.clip(np.round(minimum / dmin32), 0, 63).astype(np.uint8)
    eff_scale = d.astype(np.float32)[:, None] * sc
    eff_min = dmin.astype(np.float32)[:, None] * m
    safe = np.where(eff_scale > 0, eff_scale, 1.0)
    q = np.clip(np.round((x + eff_min[:, :, None]) / safe[:, :, None]), 0, 15).astype(np.uint8)
    n = x.shape[0]
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = np.zeros((n, 128), dtype=np.uint8)
    for chunk in range(4):
        low, high = q[:, 2 * chunk], q[:, 2 * chunk + 1]
        qs[:, chunk * 32:(chunk + 1) * 32] = low | (high << 4)
    out = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1
    )
    # Check the packing against gguf-py's own dequantization.
    back = gguf.quants.dequantize(out, Q.Q4_K).reshape(rows, cols)
    err = np.abs(back - values).max() / np.abs(values).max()
    assert err < 0.2, err
    return out.reshape(rows, -1)


def write_blocks():
    os.makedirs(GGUF_DIR, exist_ok=True)
    rng = np.random.default_rng(SEED)
    writer = gguf.GGUFWriter(os.path.join(GGUF_DIR, "blocks.gguf"), arch="oxidiff-test")
    expected = {}
    for name in BLOCK_TYPES:
        t = Q[name]
        if name == "F32":
            data = rng.standard_normal((3, 512)).astype(np.float32)
        elif name == "F16":
            data = rng.standard_normal((3, 512)).astype(np.float16)
        else:
            data = random_blocks(name, 3, 512, rng)
        raw = None if name in ("F32", "F16") else t
        writer.add_tensor(name, data, raw_dtype=raw)
        deq = gguf.quants.dequantize(data, t).reshape(3, 512).astype(np.float32)
        assert np.isfinite(deq).all(), name
        expected[name] = torch.from_numpy(deq.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_canonical(os.path.join(GGUF_DIR, "blocks-dequantized.safetensors"), expected)


def build_flux():
    torch.manual_seed(SEED + 1)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=16,
        pooled_projection_dim=8, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
    ).eval()
    perturb(model, SEED + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".linear." in name or name.startswith("proj_out"):
                p.mul_(5.0)
    return model


def fresh_config_folder(model, root):
    """Empties `root`, writes `model`'s `transformer/config.json` there (no weights) and
    returns a copy of its state dict."""
    config_dir = os.path.join(root, "transformer")
    shutil.rmtree(root, ignore_errors=True)
    model.save_pretrained(config_dir)
    for f in os.listdir(config_dir):
        if f != "config.json":
            os.remove(os.path.join(config_dir, f))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_sd3():
    torch.manual_seed(SEED + 3)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=256,
        pooled_projection_dim=16, out_channels=16, pos_embed_max_size=12,
    ).eval()
    perturb(model, SEED + 4)
    return model


def exact_copy(cls, config, path):
    """`cls` built from `config` with every tensor of GGUF `path` dequantized in f32 by gguf-py."""
    exact = cls.from_config(config).eval()
    reader = gguf.GGUFReader(path)
    state = {
        t.name: torch.from_numpy(
            gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy()
        ).reshape([int(n) for n in reversed(t.shape)])
        for t in reader.tensors
    }
    exact.load_state_dict(state, strict=True)
    return exact


def sd3_references(tensors):
    model = build_sd3()
    state = fresh_config_folder(model, SD3_DIR)
    inputs = {
        "hidden_states": torch.randn((2, 16, 8, 8), generator=gen(SEED + 20)),
        "encoder_hidden_states": torch.randn((2, 5, 32), generator=gen(SEED + 21)),
        "pooled_projections": torch.randn((2, 16), generator=gen(SEED + 22)),
        "timestep": torch.tensor([600.0, 600.0]),
    }
    for k, v in inputs.items():
        tensors[f"sd3.input.{k}"] = v
    s = SD3_PIPELINE_SETTINGS
    latents = torch.randn((1, 16, s["height"] // 8, s["width"] // 8), generator=gen(SEED + 80))
    tensors["sd3.initial_latents"] = latents
    for qtype in FLUX_TYPES:
        path = os.path.join(SD3_DIR, f"sd3-{qtype}.gguf")
        write_flux_gguf(path, state, qtype, arch="sd3")
        transformer = SD3Transformer2DModel.from_single_file(
            path, config=SD3_DIR, subfolder="transformer",
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            torch_dtype=torch.float32,
        ).eval()
        with torch.no_grad():
            out = transformer(**inputs).sample
            assert out.std() > 0.1, out.std()
            tensors[f"sd3.{qtype}.out"] = out
            exact = exact_copy(SD3Transformer2DModel, transformer.config, path)
            tensors[f"sd3.{qtype}.out_f32"] = exact(**inputs).sample
        pipe = StableDiffusion3Pipeline.from_pretrained(
            os.path.join(FIXTURES, "tiny-sd3"), transformer=transformer, torch_dtype=torch.float32
        )
        pipe.set_progress_bar_config(disable=True)
        s = SD3_PIPELINE_SETTINGS
        with torch.no_grad():
            image = pipe(
                prompt=s["prompt"], negative_prompt=s["negative_prompt"],
                num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
                height=s["height"], width=s["width"],
                max_sequence_length=s["max_sequence_length"], latents=latents.clone(),
                output_type="pil",
            ).images[0]
        image.save(os.path.join(GOLDEN, f"gguf-sd3-{qtype}.png"))


def city96_type(name, tensor, qtype):
    """The type city96's converter stores `tensor` in for a `qtype` file."""
    # city96 keeps SD3's positional table in full precision (diffusers adds it unquantized).
    if tensor.ndim == 1 or tensor.numel() <= 1024 or "pos_embed.pos_embed" in name:
        return "F32"
    block = gguf.GGML_QUANT_SIZES[Q[qtype]][0]
    if tensor.shape[-1] % block != 0:
        return "F16"
    return qtype


def encode(tensor, qtype):
    values = tensor.detach().to(torch.float32).numpy()
    if qtype == "F32":
        return values, None
    if qtype == "F16":
        return values.astype(np.float16), None
    if qtype == "Q4_K":
        return quantize_q4_k(values), Q.Q4_K
    return gguf.quants.quantize(values, Q[qtype]), Q[qtype]


def to_bfl(state):
    """diffusers' Flux keys back to the original ones (the inverse of diffusers'
    convert_flux_transformer_checkpoint_to_diffusers, for what this model has)."""
    out = {}
    take = lambda k: state.pop(k)  # noqa: E731
    cat = lambda *ks: torch.cat([take(k) for k in ks], dim=0)  # noqa: E731
    for k in list(state):
        if k.startswith("time_text_embed.timestep_embedder.linear_"):
            i = "in" if k.split(".")[2] == "linear_1" else "out"
            out[f"time_in.{i}_layer.{k.split('.')[-1]}"] = take(k)
        elif k.startswith("time_text_embed.text_embedder.linear_"):
            i = "in" if k.split(".")[2] == "linear_1" else "out"
            out[f"vector_in.{i}_layer.{k.split('.')[-1]}"] = take(k)
        elif k.startswith("context_embedder."):
            out["txt_in." + k.split(".")[-1]] = take(k)
        elif k.startswith("x_embedder."):
            out["img_in." + k.split(".")[-1]] = take(k)
        elif k.startswith("proj_out."):
            out["final_layer.linear." + k.split(".")[-1]] = take(k)
        elif k.startswith("norm_out.linear."):
            shift, scale = take(k).chunk(2, dim=0)
            out["final_layer.adaLN_modulation.1." + k.split(".")[-1]] = torch.cat([scale, shift])
    blocks = {k.split(".")[1] for k in state if k.startswith("transformer_blocks.")}
    for i in sorted(blocks):
        p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            out[q + f"img_mod.lin.{kind}"] = take(p + f"norm1.linear.{kind}")
            out[q + f"txt_mod.lin.{kind}"] = take(p + f"norm1_context.linear.{kind}")
            out[q + f"img_attn.qkv.{kind}"] = cat(*(p + f"attn.to_{c}.{kind}" for c in "qkv"))
            out[q + f"txt_attn.qkv.{kind}"] = cat(
                *(p + f"attn.add_{c}_proj.{kind}" for c in "qkv")
            )
            out[q + f"img_attn.proj.{kind}"] = take(p + f"attn.to_out.0.{kind}")
            out[q + f"txt_attn.proj.{kind}"] = take(p + f"attn.to_add_out.{kind}")
            out[q + f"img_mlp.0.{kind}"] = take(p + f"ff.net.0.proj.{kind}")
            out[q + f"img_mlp.2.{kind}"] = take(p + f"ff.net.2.{kind}")
            out[q + f"txt_mlp.0.{kind}"] = take(p + f"ff_context.net.0.proj.{kind}")
            out[q + f"txt_mlp.2.{kind}"] = take(p + f"ff_context.net.2.{kind}")
        out[q + "img_attn.norm.query_norm.scale"] = take(p + "attn.norm_q.weight")
        out[q + "img_attn.norm.key_norm.scale"] = take(p + "attn.norm_k.weight")
        out[q + "txt_attn.norm.query_norm.scale"] = take(p + "attn.norm_added_q.weight")
        out[q + "txt_attn.norm.key_norm.scale"] = take(p + "attn.norm_added_k.weight")
    blocks = {k.split(".")[1] for k in state if k.startswith("single_transformer_blocks.")}
    for i in sorted(blocks):
        p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            out[q + f"modulation.lin.{kind}"] = take(p + f"norm.linear.{kind}")
            out[q + f"linear1.{kind}"] = cat(
                *(p + f"attn.to_{c}.{kind}" for c in "qkv"), p + f"proj_mlp.{kind}"
            )
            out[q + f"linear2.{kind}"] = take(p + f"proj_out.{kind}")
        out[q + "norm.query_norm.scale"] = take(p + "attn.norm_q.weight")
        out[q + "norm.key_norm.scale"] = take(p + "attn.norm_k.weight")
    assert not state, sorted(state)
    return out


def write_flux_gguf(path, state, qtype, arch="flux"):
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, tensor in state.items():
        data, raw = encode(tensor, city96_type(name, tensor, qtype))
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    write_blocks()
    model = build_flux()
    state = fresh_config_folder(model, FLUX_DIR)
    for qtype in FLUX_TYPES:
        write_flux_gguf(os.path.join(FLUX_DIR, f"flux-{qtype}.gguf"), state, qtype)
    write_flux_gguf(os.path.join(FLUX_DIR, "flux-bfl-Q8_0.gguf"), to_bfl(dict(state)), "Q8_0")

    tensors, info = {}, {"versions": {"diffusers": diffusers.__version__,
                                      "gguf": getattr(gguf, "__version__", "?"),
                                      "torch": torch.__version__}}
    img_ids = FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32)
    txt_ids = torch.zeros(7, 3)
    inputs = {
        "hidden_states": torch.randn((2, 24, 64), generator=gen(SEED + 10)),
        "encoder_hidden_states": torch.randn((2, 7, 16), generator=gen(SEED + 11)),
        "pooled_projections": torch.randn((2, 8), generator=gen(SEED + 12)),
        "timestep": torch.tensor([0.75, 0.3]),
    }
    for k, v in inputs.items():
        tensors[f"input.{k}"] = v
    tensors["input.img_ids"] = img_ids
    schnell = os.path.join(FIXTURES, "tiny-flux-schnell")
    s = SCHNELL_RUN
    latents = torch.randn((1, 16, s["height"] // 8, s["width"] // 8), generator=gen(SEED + 70))
    tensors["schnell.initial_latents"] = latents
    packed = FluxPipeline._pack_latents(latents, 1, 16, s["height"] // 8, s["width"] // 8)
    # diffusers converts BFL keys with FLUX.1's sizes written into the conversion (inner dim
    # 3072), so it cannot read the tiny BFL file: that one is checked against the Q8_0 file with
    # diffusers' keys, which holds the same blocks.
    for name in [f"flux-{q}.gguf" for q in FLUX_TYPES]:
        tag = name[len("flux-"):-len(".gguf")]
        transformer = FluxTransformer2DModel.from_single_file(
            os.path.join(FLUX_DIR, name),
            config=FLUX_DIR, subfolder="transformer",
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            torch_dtype=torch.float32,
        ).eval()
        with torch.no_grad():
            out = transformer(**inputs, img_ids=img_ids, txt_ids=txt_ids).sample
        assert out.std() > 0.1, out.std()
        tensors[f"{tag}.out"] = out
        # The same model with every tensor dequantized in f32 by gguf-py (diffusers' CPU path
        # rounds dequantized weights to f16): the tight reference.
        exact = exact_copy(FluxTransformer2DModel, transformer.config, os.path.join(FLUX_DIR, name))
        with torch.no_grad():
            tensors[f"{tag}.out_f32"] = exact(**inputs, img_ids=img_ids, txt_ids=txt_ids).sample
        pipe = FluxPipeline.from_pretrained(schnell, transformer=transformer,
                                            torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            image = pipe(
                prompt=s["prompt"], num_inference_steps=s["num_inference_steps"],
                guidance_scale=s["guidance_scale"], height=s["height"], width=s["width"],
                max_sequence_length=s["max_sequence_length"], latents=packed.clone(),
                output_type="pil",
            ).images[0]
        image.save(os.path.join(GOLDEN, f"gguf-flux-{tag}.png"))
    sd3_references(tensors)
    save_canonical(os.path.join(GOLDEN, "gguf.safetensors"), tensors)
    info["schnell"] = SCHNELL_RUN
    info["sd3"] = SD3_PIPELINE_SETTINGS
    info["types"] = FLUX_TYPES
    save_json(os.path.join(GOLDEN, "gguf.json"), info)
    print("wrote", GGUF_DIR, FLUX_DIR, "and golden/gguf.*")


if __name__ == "__main__":
    main()
