#!/usr/bin/env python3
"""Single-file ControlNets: the tiny SD 1.x ControlNet in lllyasviel's / A1111's original layout,
and the released ControlNets' layouts (shapes only).

Run by hand (never by tests), from the repository root, after make_controlnet.py:

    python3 tools/golden/make_controlnet_single_file.py

Writes:
- tests/fixtures/single-file/tiny-controlnet-sd1.safetensors: every weight of
  tests/fixtures/tiny-controlnet-sd1 under its original key (`control_model.input_blocks.1.0.
  in_layers.0.weight`, `control_model.zero_convs.0.0.weight`, `control_model.input_hint_block.
  0.weight`, `control_model.middle_block_out.0.weight`; the inverse of diffusers'
  `convert_controlnet_checkpoint`, written out here), float32. The mapping is checked by loading
  the file with diffusers' `ControlNetModel.from_single_file(config=folder)` and comparing every
  weight with the folder's (bit-exact), so the folder's golden images (controlnet-sd1-*.png)
  are this file's too.
- tests/fixtures/single-file/released-controlnet-layouts.json: for lllyasviel's SD 1.5
  ControlNet (control_v11p_sd15_*, original layout), an SD 2.1 ControlNet (thibaud's, original
  layout) and diffusers' SDXL ControlNet (controlnet-canny-sdxl-1.0, diffusers names in one
  file): the file's key -> shape, the diffusers model's key -> shape, and its config, from
  models built on the meta device (no weights). The original layouts are checked against
  diffusers' own conversion back.
Reruns give identical bytes.
"""
import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from diffusers import ControlNetModel  # noqa: E402
from diffusers.loaders import single_file_utils as sfu  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from common import save_canonical  # noqa: E402
from make_single_file import unet_to_ldm  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(FIXTURES, "single-file")
PREFIX = "control_model."

torch.set_num_threads(1)


def controlnet_to_ldm(state, config, prefix=PREFIX):
    """diffusers ControlNetModel names -> lllyasviel's ControlNet names."""
    hint = len(config["conditioning_embedding_out_channels"])
    fixed = {
        "controlnet_cond_embedding.conv_in.": "input_hint_block.0.",
        # blocks.k sits at input_hint_block.2(k+1), with SiLUs between; conv_out after them.
        "controlnet_cond_embedding.conv_out.": f"input_hint_block.{2 * (2 * (hint - 1) + 1)}.",
        "controlnet_mid_block.": "middle_block_out.0.",
    }
    unet_part = {}
    out = {}
    for key, value in state.items():
        ldm = None
        for new, old in fixed.items():
            if key.startswith(new):
                ldm = old + key[len(new):]
        parts = key.split(".")
        if ldm is None and key.startswith("controlnet_cond_embedding.blocks."):
            ldm = f"input_hint_block.{2 * (int(parts[2]) + 1)}.{parts[3]}"
        if ldm is None and parts[0] == "controlnet_down_blocks":
            ldm = f"zero_convs.{parts[1]}.0.{parts[2]}"
        if ldm is None:
            unet_part[key] = value
            continue
        out[prefix + ldm] = value
    unet_config = dict(config)
    unet_config["up_block_types"] = [t.replace("Down", "Up") for t in reversed(config["down_block_types"])]
    for key, value in unet_to_ldm(unet_part, unet_config).items():
        out[prefix + key[len("model.diffusion_model."):]] = value
    return out


def tiny():
    folder = os.path.join(FIXTURES, "tiny-controlnet-sd1")
    state = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    ldm = controlnet_to_ldm(state, config)
    assert len(ldm) == len(state)
    path = os.path.join(OUT, "tiny-controlnet-sd1.safetensors")
    save_canonical(path, ldm)
    back = ControlNetModel.from_single_file(path, config=folder, local_files_only=True).state_dict()
    assert sorted(back) == sorted(state), set(back) ^ set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    print(f"wrote {os.path.relpath(path, ROOT)}: {len(ldm)} tensors, diffusers reads them back bit-exact")


# The released ControlNets' configs: ControlNetModel's defaults are lllyasviel's SD 1.5 ones.
RELEASED = {
    "sd15": dict(layout="original", config=dict()),
    "sd21": dict(layout="original", config=dict(
        cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20], use_linear_projection=True)),
    "sdxl": dict(layout="diffusers", config=dict(
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        block_out_channels=[320, 640, 1280], transformer_layers_per_block=[1, 2, 10],
        attention_head_dim=[5, 10, 20], cross_attention_dim=2048, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816)),
}


def released(name, spec):
    with torch.device("meta"):
        net = ControlNetModel(**spec["config"])
    state = net.state_dict()
    config = json.loads(json.dumps(dict(net.config), default=list))
    if spec["layout"] == "original":
        file = controlnet_to_ldm(state, config)
        assert sfu.infer_diffusers_model_type(file) == "controlnet", name
        back = sfu.convert_controlnet_checkpoint(file, config)
        assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in state.items()}, name
    else:
        file = state
    return {
        "layout": spec["layout"],
        "config": {k: v for k, v in config.items() if not k.startswith("_")},
        "diffusers_shapes": {k: list(v.shape) for k, v in sorted(state.items())},
        "shapes": {k: list(v.shape) for k, v in sorted(file.items())},
    }


def layouts():
    out = {name: released(name, spec) for name, spec in RELEASED.items()}
    path = os.path.join(OUT, "released-controlnet-layouts.json")
    with open(path, "w") as f:
        json.dump(out, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    tiny()
    layouts()
