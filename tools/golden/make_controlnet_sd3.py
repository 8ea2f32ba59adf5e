#!/usr/bin/env python3
"""Tiny random-weight SD3 ControlNets for tiny-sd3 and golden PNGs from diffusers'
`StableDiffusion3ControlNetPipeline`.

Run by hand (never by tests), from the repository root, after make_tiny_sd3.py and
make_controlnet.py (whose control image it reuses):

    python3 tools/golden/make_controlnet_sd3.py

Writes:
- tests/fixtures/tiny-controlnet-sd3/: `SD3ControlNetModel.from_transformer` on tiny-sd3's
  transformer (1 layer: its residual goes to the first block, the second, `context_pre_only`,
  takes none; `from_transformer` cannot copy that block into a full one), with the default
  `force_zeros_for_pooled_projection`, so no VAE shift and zero pooled projections, as
  InstantX's), the zero layers (`controlnet_blocks`, `pos_embed_input`) re-randomised (normal,
  std 0.3, seed 31) so that the control really changes the image.
- tests/fixtures/tiny-controlnet-sd3-b/: the same with
  `force_zeros_for_pooled_projection: false` (the VAE shift applied, the prompt's pooled
  projections), seed 32.
- tests/fixtures/golden/controlnet-sd3-{single,single-b,multi}.png: whole pipeline runs on
  golden/controlnet-input.png with tiny-sd3's settings (48x64, 3 steps, guidance 5.0, 24
  tokens), `torch.manual_seed(42)` (the control image's VAE sample comes from torch's global
  generator) and a generator seeded 42: the first ControlNet at scale 1; the second at 0.7;
  both at 0.8 and 0.5 with guidance windows [0, 0.7] and [0.3, 1].
- tests/fixtures/golden/controlnet-sd3.json: the settings.
Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_json  # noqa: E402
from make_tiny_sd3 import PIPELINE_SETTINGS  # noqa: E402

import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import SD3ControlNetModel, SD3Transformer2DModel, StableDiffusion3ControlNetPipeline  # noqa: E402
from diffusers.models import SD3MultiControlNetModel  # noqa: E402

RUNS = {
    "single": dict(nets=[0], controlnet_conditioning_scale=1.0),
    "single-b": dict(nets=[1], controlnet_conditioning_scale=0.7),
    "multi": dict(nets=[0, 1], controlnet_conditioning_scale=[0.8, 0.5],
                  control_guidance_start=[0.0, 0.3], control_guidance_end=[0.7, 1.0]),
}


def make_controlnet(transformer, seed, num_layers, force_zeros, folder):
    torch.manual_seed(seed)
    net = SD3ControlNetModel.from_transformer(transformer, num_layers=num_layers,
                                              num_extra_conditioning_channels=0)
    if not force_zeros:
        net.register_to_config(force_zeros_for_pooled_projection=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in list(net.controlnet_blocks) + [net.pos_embed_input]:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    net.save_pretrained(folder, safe_serialization=True)
    sd.canonicalize_safetensors(folder)
    return SD3ControlNetModel.from_pretrained(folder)


def main():
    base = os.path.join(sd.FIXTURES, "tiny-sd3")
    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(base, "transformer"))
    nets = [
        make_controlnet(transformer, 31, 1, True, os.path.join(sd.FIXTURES, "tiny-controlnet-sd3")),
        make_controlnet(transformer, 32, 1, False, os.path.join(sd.FIXTURES, "tiny-controlnet-sd3-b")),
    ]
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "controlnet-input.png")).convert("RGB")
    s = PIPELINE_SETTINGS
    settings = dict(negative_prompt=s["negative_prompt"], num_inference_steps=s["num_inference_steps"],
                    guidance_scale=s["guidance_scale"], height=s["height"], width=s["width"],
                    max_sequence_length=s["max_sequence_length"])
    info = {"prompt": s["prompt"], **settings, "seed": 42, "runs": {},
            "diffusers": diffusers.__version__, "torch": torch.__version__}
    for name, run in RUNS.items():
        run = dict(run)
        chosen = [nets[i] for i in run.pop("nets")]
        controlnet = chosen[0] if len(chosen) == 1 else SD3MultiControlNetModel(chosen)
        pipe = StableDiffusion3ControlNetPipeline.from_pretrained(base, controlnet=controlnet,
                                                                  local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(42)
        out = pipe(s["prompt"], control_image=image if len(chosen) == 1 else [image] * len(chosen),
                   generator=torch.Generator().manual_seed(42), **settings, **run).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-sd3-{name}.png"))
        info["runs"][name] = run
    save_json(os.path.join(sd.GOLDEN, "controlnet-sd3.json"), info)


if __name__ == "__main__":
    main()
