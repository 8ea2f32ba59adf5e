#!/usr/bin/env python3
"""Tiny random-weight Flux ControlNets for tiny-flux-dev and golden PNGs from diffusers'
`FluxControlNetPipeline`.

Run by hand (never by tests), from the repository root, after make_tiny_flux.py and
make_controlnet.py (whose control image it reuses):

    python3 tools/golden/make_controlnet_flux.py

Writes:
- tests/fixtures/tiny-controlnet-flux/: `FluxControlNetModel.from_transformer` on tiny-flux-dev's
  transformer with one double and one single block (InstantX's layout: no conditioning
  embedding, no union modes), the zero layers (`controlnet_blocks`, `controlnet_single_blocks`,
  `controlnet_x_embedder`) re-randomised (normal, std 0.3, seed 41) so that the control really
  changes the image.
- tests/fixtures/tiny-controlnet-flux-b/: two double blocks and one single block, seed 42.
- tests/fixtures/golden/controlnet-flux-{single,multi}.png: whole pipeline runs on
  golden/controlnet-input.png with tiny-flux-dev's settings (96x64, 4 steps, guidance 3.5, 24
  tokens) and a generator seeded 42 (the control image's VAE sample is drawn from it first, then
  the latents): the first ControlNet at scale 0.9; both at 0.8 and 0.6 with guidance windows
  [0, 0.75] and [0.25, 1].
- tests/fixtures/golden/controlnet-flux.json: the settings.
Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_json  # noqa: E402
from make_tiny_flux import DEV_RUN  # noqa: E402

import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxTransformer2DModel  # noqa: E402
from diffusers.models import FluxMultiControlNetModel  # noqa: E402

RUNS = {
    "single": dict(nets=[0], controlnet_conditioning_scale=0.9),
    "multi": dict(nets=[0, 1], controlnet_conditioning_scale=[0.8, 0.6],
                  control_guidance_start=[0.0, 0.25], control_guidance_end=[0.75, 1.0]),
}


def make_controlnet(transformer, seed, num_layers, folder):
    torch.manual_seed(seed)
    cfg = transformer.config
    net = FluxControlNetModel.from_transformer(
        transformer, num_layers=num_layers, num_single_layers=1,
        attention_head_dim=cfg.attention_head_dim, num_attention_heads=cfg.num_attention_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        zero = list(net.controlnet_blocks) + list(net.controlnet_single_blocks) + [net.controlnet_x_embedder]
        for module in zero:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    net.save_pretrained(folder, safe_serialization=True)
    sd.canonicalize_safetensors(folder)
    return FluxControlNetModel.from_pretrained(folder)


def main():
    base = os.path.join(sd.FIXTURES, "tiny-flux-dev")
    transformer = FluxTransformer2DModel.from_pretrained(os.path.join(base, "transformer"))
    nets = [
        make_controlnet(transformer, 41, 1, os.path.join(sd.FIXTURES, "tiny-controlnet-flux")),
        make_controlnet(transformer, 42, 2, os.path.join(sd.FIXTURES, "tiny-controlnet-flux-b")),
    ]
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "controlnet-input.png")).convert("RGB")
    s = DEV_RUN
    settings = dict(num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
                    height=s["height"], width=s["width"], max_sequence_length=s["max_sequence_length"])
    info = {"prompt": s["prompt"], **settings, "seed": 42, "runs": {},
            "diffusers": diffusers.__version__, "torch": torch.__version__}
    for name, run in RUNS.items():
        run = dict(run)
        chosen = [nets[i] for i in run.pop("nets")]
        controlnet = chosen[0] if len(chosen) == 1 else FluxMultiControlNetModel(chosen)
        pipe = FluxControlNetPipeline.from_pretrained(base, controlnet=controlnet, local_files_only=True,
                                                      torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(s["prompt"], control_image=image if len(chosen) == 1 else [image] * len(chosen),
                   generator=torch.Generator().manual_seed(42), **settings, **run).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-flux-{name}.png"))
        info["runs"][name] = run
    save_json(os.path.join(sd.GOLDEN, "controlnet-flux.json"), info)


if __name__ == "__main__":
    main()
