#!/usr/bin/env python3
"""Tiny random-weight Flux ControlNet-Union (InstantX) and XLabs-style Flux ControlNets for
tiny-flux-dev, and golden PNGs from diffusers' `FluxControlNetPipeline`.

Run by hand (never by tests), from the repository root, after make_tiny_flux.py and
make_controlnet.py (whose control image it reuses):

    python3 tools/golden/make_controlnet_flux_variants.py

Writes:
- tests/fixtures/tiny-controlnet-flux-union/: `FluxControlNetModel` with tiny-flux-dev's
  transformer config, one double and one single block, `num_mode: 4`; the shared layers copied
  from the transformer as `from_transformer` does, the zero layers (`controlnet_blocks`,
  `controlnet_single_blocks`, `controlnet_x_embedder`) and `controlnet_mode_embedder`
  re-randomised (normal, std 0.3, seed 43) so that the control and its mode change the image.
- tests/fixtures/tiny-controlnet-flux-xlabs/: XLabs' layout: `conditioning_embedding_channels:
  16`, `patch_size: 2` (the embedding of the pixel image, 8x smaller, packed in 2x2 patches
  like the latents), one double and one single block; the zero layers and the embedding's
  `conv_out` re-randomised (std 0.3, seed 44).
- tests/fixtures/golden/controlnet-flux-{union,union-multi,xlabs}.png: whole pipeline runs on
  golden/controlnet-input.png with tiny-flux-dev's settings (96x64, 4 steps, guidance 3.5, 24
  tokens) and a generator seeded 42: the union net with `control_mode=2` at scale 0.9; the
  union net alone in a `FluxMultiControlNetModel` with two conditions (the image and its left-
  right mirror, modes 0 and 3, scales 0.8 and 0.6, windows [0, 0.75] and [0.25, 1]); the XLabs
  net at scale 0.9 (no VAE encode: the pixel image goes in, the latents are the first draw).
- tests/fixtures/tiny-flux-transformer-3/: a smaller random `FluxTransformer2DModel` (1 head of
  8, `axes_dims_rope` (2, 2, 4), 3 double and 1 single blocks, 16 latent channels, seed 45),
  where repeating two ControlNet samples over three double blocks (XLabs'
  `controlnet_blocks_repeat`: 0, 1, 0) differs from spreading them (0, 0, 1); tiny-flux-dev
  has two double blocks, where both agree.
- tests/fixtures/golden/controlnet-flux-variants.safetensors: one call of that transformer
  (`repeat.*` inputs, two double and one single random sample) with
  `controlnet_blocks_repeat` True and False (`repeat.out_repeat`, `repeat.out_spread`).
- tests/fixtures/golden/controlnet-flux-variants.json: the settings.
Reruns give identical bytes.
"""
import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_canonical, save_json  # noqa: E402
from make_tiny_flux import DEV_RUN  # noqa: E402

import PIL.Image  # noqa: E402
import PIL.ImageOps  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxTransformer2DModel  # noqa: E402
from diffusers.models import FluxMultiControlNetModel  # noqa: E402

RUNS = {
    "union": dict(net="union", images=["plain"], control_mode=2, controlnet_conditioning_scale=0.9),
    "union-multi": dict(net="union", images=["plain", "mirror"], control_mode=[0, 3],
                        controlnet_conditioning_scale=[0.8, 0.6],
                        control_guidance_start=[0.0, 0.25], control_guidance_end=[0.75, 1.0]),
    "xlabs": dict(net="xlabs", images=["plain"], controlnet_conditioning_scale=0.9),
}


def make_controlnet(transformer, seed, extra, folder):
    torch.manual_seed(seed)
    cfg = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    cfg.update(num_layers=1, num_single_layers=1, **extra)
    net = FluxControlNetModel.from_config(cfg)
    # What `from_transformer` copies.
    for name in ["pos_embed", "time_text_embed", "context_embedder", "x_embedder"]:
        getattr(net, name).load_state_dict(getattr(transformer, name).state_dict())
    net.transformer_blocks.load_state_dict(transformer.transformer_blocks.state_dict(), strict=False)
    net.single_transformer_blocks.load_state_dict(transformer.single_transformer_blocks.state_dict(),
                                                  strict=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        zero = list(net.controlnet_blocks) + list(net.controlnet_single_blocks) + [net.controlnet_x_embedder]
        if net.union:
            zero.append(net.controlnet_mode_embedder)
        if net.input_hint_block is not None:
            zero.append(net.input_hint_block.conv_out)
        for module in zero:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    net.save_pretrained(folder, safe_serialization=True)
    sd.canonicalize_safetensors(folder)
    # No absolute paths in the saved config.
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("_name_or_path", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return FluxControlNetModel.from_pretrained(folder)


def make_repeat_golden():
    folder = os.path.join(sd.FIXTURES, "tiny-flux-transformer-3")
    torch.manual_seed(45)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=3, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=1, joint_attention_dim=8, pooled_projection_dim=8, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    sd.canonicalize_safetensors(folder)
    gen = torch.Generator().manual_seed(46)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    h, w, text = 2, 3, 4
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    img_ids = img_ids.reshape(h * w, 3)
    inputs = {
        "repeat.hidden_states": rand(1, h * w, 16),
        "repeat.encoder_hidden_states": rand(1, text, 8),
        "repeat.pooled_projections": rand(1, 8),
        "repeat.timestep": torch.tensor([0.7]),
        "repeat.guidance": torch.tensor([3.5]),
        "repeat.img_ids": img_ids,
        "repeat.block_0": rand(1, h * w, 8),
        "repeat.block_1": rand(1, h * w, 8),
        "repeat.single_0": rand(1, h * w, 8),
    }
    out = dict(inputs)
    for name, repeat in [("repeat", True), ("spread", False)]:
        with torch.no_grad():
            out[f"repeat.out_{name}"] = model(
                hidden_states=inputs["repeat.hidden_states"],
                encoder_hidden_states=inputs["repeat.encoder_hidden_states"],
                pooled_projections=inputs["repeat.pooled_projections"],
                timestep=inputs["repeat.timestep"], guidance=inputs["repeat.guidance"],
                img_ids=img_ids, txt_ids=torch.zeros(text, 3),
                controlnet_block_samples=[inputs["repeat.block_0"], inputs["repeat.block_1"]],
                controlnet_single_block_samples=[inputs["repeat.single_0"]],
                controlnet_blocks_repeat=repeat, return_dict=False)[0]
    save_canonical(os.path.join(sd.GOLDEN, "controlnet-flux-variants.safetensors"), out)


def main():
    base = os.path.join(sd.FIXTURES, "tiny-flux-dev")
    transformer = FluxTransformer2DModel.from_pretrained(os.path.join(base, "transformer"))
    nets = {
        "union": make_controlnet(transformer, 43, dict(num_mode=4),
                                 os.path.join(sd.FIXTURES, "tiny-controlnet-flux-union")),
        "xlabs": make_controlnet(transformer, 44, dict(conditioning_embedding_channels=16, patch_size=2),
                                 os.path.join(sd.FIXTURES, "tiny-controlnet-flux-xlabs")),
    }
    plain = PIL.Image.open(os.path.join(sd.GOLDEN, "controlnet-input.png")).convert("RGB")
    images = {"plain": plain, "mirror": PIL.ImageOps.mirror(plain)}
    s = DEV_RUN
    settings = dict(num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
                    height=s["height"], width=s["width"], max_sequence_length=s["max_sequence_length"])
    info = {"prompt": s["prompt"], **settings, "seed": 42, "runs": {},
            "diffusers": diffusers.__version__, "torch": torch.__version__}
    for name, run in RUNS.items():
        run = dict(run)
        net = nets[run["net"]]
        chosen = [images[i] for i in run["images"]]
        multi = len(chosen) > 1
        controlnet = FluxMultiControlNetModel([net]) if multi else net
        pipe = FluxControlNetPipeline.from_pretrained(base, controlnet=controlnet, local_files_only=True,
                                                      torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        kwargs = {k: v for k, v in run.items() if k not in ("net", "images")}
        out = pipe(s["prompt"], control_image=chosen if multi else chosen[0],
                   generator=torch.Generator().manual_seed(42), **settings, **kwargs).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-flux-{name}.png"))
        info["runs"][name] = run
    make_repeat_golden()
    info["repeat"] = "tiny-flux-transformer-3, 3 double blocks, 2 samples, timestep 0.7, guidance 3.5"
    save_json(os.path.join(sd.GOLDEN, "controlnet-flux-variants.json"), info)


if __name__ == "__main__":
    main()
