#!/usr/bin/env python3
"""Tiny random-weight ControlNets for tiny-sd1 and golden data from diffusers'
`StableDiffusionControlNetPipeline`.

Run by hand (never by tests), from the repository root, after make_tiny_sd.py:

    python3 tools/golden/make_controlnet.py

Writes:
- tests/fixtures/tiny-controlnet-sd1/ and tiny-controlnet-sd1-b/: `ControlNetModel.from_unet`
  on tiny-sd1's UNet (conditioning embedding channels 8, 8, 16, 16), with the zero convolutions
  (`controlnet_down_blocks`, `controlnet_mid_block`, the embedding's `conv_out`) re-randomised
  (normal, std 0.3, seeds 11 and 12) so that the control really changes the image.
- tests/fixtures/golden/controlnet-input.png: a seeded 64x64 "edge map".
- tests/fixtures/golden/controlnet.{json,safetensors}: the first ControlNet's residuals on
  seeded inputs at conditioning scale 0.7, in guess mode at scale 1, and the UNet's noise
  prediction with the first residuals added.
- tests/fixtures/golden/controlnet-sd1-{single,multi,guess,shared}.png: whole pipeline runs
  (prompt below, negative prompt "blurry", 4 steps, guidance 7.5, seed 42, 64x64, PNDM):
  one ControlNet at scale 1; both at scales 0.8 and 0.5 with guidance windows [0, 0.75] and
  [0.25, 1]; one in guess mode at scale 0.9; both at 0.8 and 0.5 sharing the window [0.25, 1]
  (what txt2img's one pair of window flags gives).
- tests/fixtures/golden/controlnet-sd1-{img2img,inpaint}.png: `StableDiffusionControlNetImg2Img`
  and `...InpaintPipeline` on golden/img2img-input.png (and inpaint-mask.png) with the first
  ControlNet at scale 0.8 over [0, 0.8], strength 0.75, otherwise as above.
Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
from common import save_canonical, save_json  # noqa: E402

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, UNet2DConditionModel  # noqa: E402

PROMPT = "a photo of an astronaut riding a horse"
RUNS = {
    "single": dict(nets=[0], controlnet_conditioning_scale=1.0),
    "multi": dict(nets=[0, 1], controlnet_conditioning_scale=[0.8, 0.5],
                  control_guidance_start=[0.0, 0.25], control_guidance_end=[0.75, 1.0]),
    "guess": dict(nets=[0], controlnet_conditioning_scale=0.9, guess_mode=True),
    "shared": dict(nets=[0, 1], controlnet_conditioning_scale=[0.8, 0.5],
                   control_guidance_start=0.25, control_guidance_end=1.0),
}


def make_controlnet(unet, seed, folder):
    torch.manual_seed(seed)  # the layers from_unet does not copy start from torch's default init
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 16, 16))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        zero = list(net.controlnet_down_blocks) + [net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
        for conv in zero:
            for p in conv.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        # The embedding's other convolutions too, so the seeds give two different nets.
        for p in net.controlnet_cond_embedding.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    net.save_pretrained(folder, safe_serialization=True)
    sd.canonicalize_safetensors(folder)
    return ControlNetModel.from_pretrained(folder)


def control_image():
    rng = np.random.default_rng(5)
    pixels = np.zeros((64, 64, 3), np.uint8)
    y, x = np.mgrid[0:64, 0:64]
    pixels[((x - 32) ** 2 + (y - 30) ** 2 < 400) & ((x - 32) ** 2 + (y - 30) ** 2 > 300)] = 255
    pixels[(abs(x - y) < 2)] = 255
    pixels = np.clip(pixels.astype(np.int32) + rng.integers(0, 40, pixels.shape), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(pixels, "RGB")


def main():
    base = os.path.join(sd.FIXTURES, "tiny-sd1")
    unet = UNet2DConditionModel.from_pretrained(os.path.join(base, "unet"))
    nets = [
        make_controlnet(unet, 11, os.path.join(sd.FIXTURES, "tiny-controlnet-sd1")),
        make_controlnet(unet, 12, os.path.join(sd.FIXTURES, "tiny-controlnet-sd1-b")),
    ]
    path = os.path.join(sd.GOLDEN, "controlnet-input.png")
    control_image().save(path)
    image = PIL.Image.open(path).convert("RGB")

    gen = torch.Generator().manual_seed(9)
    sample = torch.randn(2, 4, 8, 8, generator=gen)
    context = torch.randn(2, 77, 32, generator=gen)
    cond = torch.rand(2, 3, 64, 64, generator=gen)
    t = torch.tensor([500.0])
    with torch.no_grad():
        down, mid = nets[0](sample, t, context, cond, conditioning_scale=0.7, return_dict=False)
        gdown, gmid = nets[0](sample, t, context, cond, conditioning_scale=1.0, guess_mode=True,
                              return_dict=False)
        noise = unet(sample, t, context, down_block_additional_residuals=down,
                     mid_block_additional_residual=mid).sample
    tensors = {"sample": sample, "context": context, "cond": cond, "timestep": t,
               "mid": mid, "guess.mid": gmid, "unet.out": noise}
    tensors.update({f"down.{i}": d for i, d in enumerate(down)})
    tensors.update({f"guess.down.{i}": d for i, d in enumerate(gdown)})
    save_canonical(os.path.join(sd.GOLDEN, "controlnet.safetensors"), tensors)

    info = {"prompt": PROMPT, "negative_prompt": "blurry", "steps": 4, "guidance_scale": 7.5,
            "seed": 42, "residuals": len(down), "runs": {}, "diffusers": diffusers.__version__,
            "torch": torch.__version__}
    for name, run in RUNS.items():
        run = dict(run)
        chosen = [nets[i] for i in run.pop("nets")]
        pipe = StableDiffusionControlNetPipeline.from_pretrained(
            base, controlnet=chosen[0] if len(chosen) == 1 else chosen, safety_checker=None,
            local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(PROMPT, image=image if len(chosen) == 1 else [image] * len(chosen),
                   negative_prompt="blurry", num_inference_steps=4, guidance_scale=7.5,
                   generator=torch.Generator().manual_seed(42), **run).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-sd1-{name}.png"))
        info["runs"][name] = {k: v for k, v in run.items()}
    # Image to image and inpainting (tiny-sd1's 4-channel UNet: the masked-latent method) with
    # the first ControlNet at scale 0.8 over [0, 0.8], strength 0.75.
    from diffusers import StableDiffusionControlNetImg2ImgPipeline, StableDiffusionControlNetInpaintPipeline
    init = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    mask = PIL.Image.open(os.path.join(sd.GOLDEN, "inpaint-mask.png"))
    edit = dict(negative_prompt="blurry", num_inference_steps=4, guidance_scale=7.5, strength=0.75,
                controlnet_conditioning_scale=0.8, control_guidance_end=0.8)
    for name, cls, extra in [("img2img", StableDiffusionControlNetImg2ImgPipeline, {}),
                             ("inpaint", StableDiffusionControlNetInpaintPipeline, {"mask_image": mask})]:
        pipe = cls.from_pretrained(base, controlnet=nets[0], safety_checker=None, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(PROMPT, image=init, control_image=image, generator=torch.Generator().manual_seed(42),
                   **extra, **edit).images[0]
        out.save(os.path.join(sd.GOLDEN, f"controlnet-sd1-{name}.png"))
    info["edit"] = edit
    save_json(os.path.join(sd.GOLDEN, "controlnet.json"), info)


if __name__ == "__main__":
    main()
