#!/usr/bin/env python3
"""Tiny random-weight ControlNets for tiny-sdxl and golden PNGs from diffusers'
`StableDiffusionXLControlNetPipeline`.

Run by hand (never by tests), from the repository root, after make_tiny_sdxl.py and
make_controlnet.py (whose recipe and control image it reuses):

    python3 tools/golden/make_controlnet_sdxl.py

Writes:
- tests/fixtures/tiny-controlnet-sdxl/ and tiny-controlnet-sdxl-b/: `ControlNetModel.from_unet`
  on tiny-sdxl's UNet (so with its `text_time` added conditioning; conditioning embedding
  channels 8, 8, 16, 16), zero convolutions re-randomised as make_controlnet.py does (seeds 21
  and 22).
- tests/fixtures/golden/controlnet-sdxl-{single,multi,guess}.png: whole pipeline runs on
  golden/controlnet-input.png (prompt below, negative prompt "blurry", 4 steps, guidance 5.0,
  seed 42, 64x64, tiny-sdxl's Euler scheduler): one ControlNet at scale 1; both at scales 0.8
  and 0.5 with guidance windows [0, 0.75] and [0.25, 1]; one in guess mode at scale 0.9.
- tests/fixtures/golden/controlnet-sdxl-{img2img,inpaint}.png:
  `StableDiffusionXLControlNetImg2ImgPipeline` and `...InpaintPipeline` (tiny-sdxl's 4-channel
  UNet: the masked-latent method) on golden/img2img-input.png (and inpaint-mask.png) with the
  first ControlNet at scale 0.8 over [0, 0.8], strength 0.75, otherwise as above.
- tests/fixtures/golden/controlnet-sdxl.json: the settings.
Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_json  # noqa: E402
from make_controlnet import PROMPT, make_controlnet  # noqa: E402

import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import StableDiffusionXLControlNetPipeline, UNet2DConditionModel  # noqa: E402

RUNS = {
    "single": dict(nets=[0], controlnet_conditioning_scale=1.0),
    "multi": dict(nets=[0, 1], controlnet_conditioning_scale=[0.8, 0.5],
                  control_guidance_start=[0.0, 0.25], control_guidance_end=[0.75, 1.0]),
    "guess": dict(nets=[0], controlnet_conditioning_scale=0.9, guess_mode=True),
}
SETTINGS = dict(negative_prompt="blurry", num_inference_steps=4, guidance_scale=5.0)


def main():
    base = os.path.join(sd.FIXTURES, "tiny-sdxl")
    unet = UNet2DConditionModel.from_pretrained(os.path.join(base, "unet"))
    nets = [
        make_controlnet(unet, 21, os.path.join(sd.FIXTURES, "tiny-controlnet-sdxl")),
        make_controlnet(unet, 22, os.path.join(sd.FIXTURES, "tiny-controlnet-sdxl-b")),
    ]
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "controlnet-input.png")).convert("RGB")
    info = {"prompt": PROMPT, **SETTINGS, "seed": 42, "runs": {},
            "diffusers": diffusers.__version__, "torch": torch.__version__}
    for name, run in RUNS.items():
        run = dict(run)
        chosen = [nets[i] for i in run.pop("nets")]
        pipe = StableDiffusionXLControlNetPipeline.from_pretrained(
            base, controlnet=chosen[0] if len(chosen) == 1 else chosen, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(PROMPT, image=image if len(chosen) == 1 else [image] * len(chosen),
                   generator=torch.Generator().manual_seed(42), **SETTINGS, **run).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-sdxl-{name}.png"))
        info["runs"][name] = run
    from diffusers import StableDiffusionXLControlNetImg2ImgPipeline, StableDiffusionXLControlNetInpaintPipeline
    init = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    mask = PIL.Image.open(os.path.join(sd.GOLDEN, "inpaint-mask.png"))
    edit = dict(strength=0.75, controlnet_conditioning_scale=0.8, control_guidance_end=0.8)
    for name, cls, extra in [("img2img", StableDiffusionXLControlNetImg2ImgPipeline, {}),
                             ("inpaint", StableDiffusionXLControlNetInpaintPipeline, {"mask_image": mask})]:
        pipe = cls.from_pretrained(base, controlnet=nets[0], local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(PROMPT, image=init, control_image=image, generator=torch.Generator().manual_seed(42),
                   **SETTINGS, **extra, **edit).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-sdxl-{name}.png"))
    info["edit"] = edit
    save_json(os.path.join(sd.GOLDEN, "controlnet-sdxl.json"), info)


if __name__ == "__main__":
    main()
