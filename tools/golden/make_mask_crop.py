"""Golden data for inpainting with `padding_mask_crop` (SD 1.x and SDXL).

    python3 tools/golden/make_mask_crop.py

Run by hand (never by tests) after make_inpaint.py and make_single_file_edit.py (it uses the
tiny-sd1-inpaint folder, tiny-sdxl and golden/img2img-input.png). With `padding_mask_crop`
diffusers finds the masked region (`VaeImageProcessor.get_crop_region`: the box of nonzero mask
pixels, padded and widened to the output's aspect ratio), crops image and mask to it, resizes
them to the output size (`resize_mode="fill"`), inpaints, and pastes the result back over the
original image (`apply_overlay`, blending by the unbinarized mask). Writes

  tests/fixtures/golden/crop-mask.png        a 64x64 grayscale mask: a white rectangle and a
                                             grey ramp beside it, black elsewhere
  tests/fixtures/golden/mask-crop.{json,safetensors}, mask-crop-CASE.png

Cases (4 steps, seed 42, prompt and negative prompt of make_inpaint.py, output 64 wide and 48
high, so the widened region's aspect ratio is not the output's and the fill rows are used):
  sd9-crop   StableDiffusionInpaintPipeline on tiny-sd1-inpaint (9-channel UNet), PNDM,
             strength 1, padding_mask_crop 4
  xl-crop    StableDiffusionXLInpaintPipeline on tiny-sdxl (masked latents), strength 0.8,
             padding_mask_crop 4
Each records the crop region, the preprocessed image and mask, per-step latents and the PNG
(diffusers allows only PIL output with a crop). Reruns give identical bytes.
"""
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
import make_inpaint as ip  # noqa: E402
from common import save_canonical, save_json  # noqa: E402

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline  # noqa: E402

PAD = 4
WIDTH, HEIGHT = 64, 48


def crop_mask():
    m = np.zeros((64, 64), dtype=np.uint8)
    m[20:30, 10:34] = 255
    for x in range(34, 40):
        m[22:28, x] = 40 + 30 * (x - 34)  # 40..190: blended, not binarized, by the overlay
    return PIL.Image.fromarray(m, "L")


def run(pipe, kwargs, tensors, info, name):
    steps, ts = [], []

    def on_step_end(_pipe, i, t, kw):
        steps.append(kw["latents"].detach().clone())
        ts.append(float(t))
        return kw

    image = pipe(
        **kwargs,
        generator=sd.gen(ip.SEED),
        output_type="pil",
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=["latents"],
    ).images[0]
    for i, st in enumerate(steps):
        tensors[f"{name}.step{i}"] = st
    info["timesteps"][name] = ts
    image.save(os.path.join(sd.GOLDEN, f"mask-crop-{name}.png"))


def main():
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    crop_mask().save(os.path.join(sd.GOLDEN, "crop-mask.png"))
    mask = PIL.Image.open(os.path.join(sd.GOLDEN, "crop-mask.png"))
    tensors, info = {}, {"diffusers": diffusers.__version__, "timesteps": {}}
    info["settings"] = {
        "prompt": ip.PROMPT,
        "negative_prompt": ip.NEGATIVE,
        "num_inference_steps": ip.STEPS,
        "seed": ip.SEED,
        "sd_guidance_scale": ip.SD_GUIDANCE,
        "xl_guidance_scale": ip.XL_GUIDANCE,
        "padding_mask_crop": PAD,
        "width": WIDTH,
        "height": HEIGHT,
        "strength": {"sd9-crop": 1.0, "xl-crop": 0.8},
    }
    common = dict(
        prompt=ip.PROMPT, negative_prompt=ip.NEGATIVE, image=image, mask_image=mask,
        height=HEIGHT, width=WIDTH, num_inference_steps=ip.STEPS, padding_mask_crop=PAD,
    )

    pipe = StableDiffusionInpaintPipeline.from_pretrained(
        os.path.join(sd.FIXTURES, "tiny-sd1-inpaint"), local_files_only=True,
        safety_checker=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    assert pipe.unet.config.in_channels == 9
    region = pipe.mask_processor.get_crop_region(mask, WIDTH, HEIGHT, pad=PAD)
    info["crop_region"] = list(region)
    tensors["crop.image"] = pipe.image_processor.preprocess(
        image, height=HEIGHT, width=WIDTH, crops_coords=region, resize_mode="fill"
    )
    tensors["crop.mask"] = pipe.mask_processor.preprocess(
        mask, height=HEIGHT, width=WIDTH, crops_coords=region, resize_mode="fill"
    )
    run(pipe, dict(common, strength=1.0, guidance_scale=ip.SD_GUIDANCE), tensors, info, "sd9-crop")

    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(
        os.path.join(sd.FIXTURES, "tiny-sdxl"), local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    run(pipe, dict(common, strength=0.8, guidance_scale=ip.XL_GUIDANCE), tensors, info, "xl-crop")

    tensors = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}
    save_canonical(os.path.join(sd.GOLDEN, "mask-crop.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(sd.GOLDEN, "mask-crop.json"), info)
    print(f"crop region {region}; wrote golden/crop-mask.png, golden/mask-crop.*")


if __name__ == "__main__":
    main()
