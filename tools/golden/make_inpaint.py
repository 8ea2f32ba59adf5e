#!/usr/bin/env python3
"""Golden data for inpainting (SD 1.x and SDXL), SDXL image to image and the SDXL refiner.

Run by hand (never by tests), from the repository root, after make_tiny_sd.py,
make_tiny_sdxl.py and make_img2img.py (it reuses golden/img2img-input.png):

    python3 tools/golden/make_inpaint.py

Writes
  tests/fixtures/tiny-sd1-inpaint-unet/      a 9-channel inpainting UNet (in_channels 9) for tiny-sd1
  tests/fixtures/tiny-sdxl-refiner-unet/     an SDXL UNet with 5 time ids (requires_aesthetics_score)
  tests/fixtures/tiny-sdxl-inpaint-unet/     a 9-channel SDXL inpainting UNet for tiny-sdxl
  tests/fixtures/golden/inpaint-mask.png     a 64x64 RGB mask (converted to grayscale and binarized)
  tests/fixtures/golden/resize-{input,mask}.png  75x61 RGB image and grayscale mask, whose
                                             preprocessing (PIL Lanczos resizes) is recorded
  tests/fixtures/golden/inpaint.{json,safetensors}, inpaint-CASE.png for each case below.

Cases (4 steps, seed 42 through one torch.Generator, as the Rust tests replay it):
  sd9-pndm      StableDiffusionInpaintPipeline, tiny-sd1 + the 9-channel UNet, PNDM, strength 1
  sd9-euler     the same with Euler at strength 0.75
  sd4-pndm      tiny-sd1's own 4-channel UNet (the masked-latent method), PNDM, strength 1
  sd4-euler     the same with Euler at strength 0.75
  xl-img2img    StableDiffusionXLImg2ImgPipeline on tiny-sdxl, strength 0.6
  xl-inpaint    StableDiffusionXLInpaintPipeline on tiny-sdxl (4 channels), strength 0.8
  xl9-inpaint   the same with the 9-channel SDXL inpainting UNet
  xl-refiner    tiny-sdxl with denoising_end 0.5 (latents out), then the refiner UNet
                (requires_aesthetics_score, aesthetic 7 / negative 2) with denoising_start 0.5
  xl-refiner-heun  the refiner half again with HeunDiscreteScheduler (second order)
Each records the per-step latents and the final image (np), and the PNG (pil) after checking
that the pil run stepped through the same latents. Reruns give identical bytes.
"""
import os
import shutil
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
import make_tiny_sdxl as sdxl  # noqa: E402
from common import save_canonical, save_json  # noqa: E402

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import (  # noqa: E402
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

PROMPT = "a photo of an astronaut riding a horse"
NEGATIVE = "blurry"
STEPS = 4
SEED = 42
SD_GUIDANCE = 7.5
XL_GUIDANCE = 5.0
REFINER = {"denoising_end": 0.5, "aesthetic_score": 7.0, "negative_aesthetic_score": 2.0}


def mask_image():
    """A 64x64 RGB mask: a bright rectangle, a dark border, and a band of greys around the
    threshold, so grayscale conversion (PIL's integer luma) and binarization both matter."""
    rgb = np.zeros((64, 64, 3), dtype=np.uint8)
    rgb[16:48, 20:56] = (255, 250, 240)
    for x in range(64):
        v = 112 + x // 2  # 112..143 across the threshold 127.5
        rgb[4:10, x] = (v, v + 3, max(v - 20, 0))
    return PIL.Image.fromarray(rgb, "RGB")


def resize_inputs():
    """A 75x61 RGB image and a 75x61 grayscale ("L") mask, sizes that are not multiples of 8,
    so preprocessing resizes them with PIL's Lanczos filter."""
    rng = np.random.default_rng(11)
    y, x = np.mgrid[0:61, 0:75]
    base = np.stack([x * 3, y * 4, 255 - (x + y) * 2], axis=-1).astype(np.float64)
    pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    gray = np.clip((x - 20) * 6 + (y - 30) * 3 + rng.normal(0, 25, x.shape) + 128, 0, 255)
    return PIL.Image.fromarray(pixels, "RGB"), PIL.Image.fromarray(gray.astype(np.uint8), "L")


def record_resizes(pipe, tensors, info):
    """The image and mask processors' outputs for resized inputs: down to a multiple of 8, a
    smaller and a larger requested size; the mask as "L" and as RGB."""
    image, mask = resize_inputs()
    image.save(os.path.join(sd.GOLDEN, "resize-input.png"))
    mask.save(os.path.join(sd.GOLDEN, "resize-mask.png"))
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "resize-input.png"))
    mask = PIL.Image.open(os.path.join(sd.GOLDEN, "resize-mask.png"))
    assert mask.mode == "L"
    sizes = {"default": (None, None), "down": (40, 48), "up": (96, 80)}
    info["resize_sizes"] = {k: list(v) for k, v in sizes.items()}
    for name, (h, w) in sizes.items():
        tensors[f"resize.image.{name}"] = pipe.image_processor.preprocess(image, height=h, width=w)
        tensors[f"resize.mask.{name}"] = pipe.mask_processor.preprocess(mask, height=h, width=w)
        tensors[f"resize.rgb_mask.{name}"] = pipe.mask_processor.preprocess(
            mask.convert("RGB"), height=h, width=w
        )


def build_inpaint_unet(seed):
    """tiny-sd1's UNet layout at two blocks, with 9 input channels (latents, mask, masked latents)."""
    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=9,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        attention_head_dim=8,
        cross_attention_dim=32,
        norm_num_groups=8,
    ).eval()
    sd.perturb(model, seed + 1)
    return model


def build_refiner_unet(seed):
    """tiny-sdxl's UNet at two blocks with 5 time ids (original size, crop, aesthetic score)."""
    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        attention_head_dim=(2, 4),
        cross_attention_dim=sdxl.TE1_HIDDEN + sdxl.TE2_HIDDEN,
        use_linear_projection=True,
        norm_num_groups=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=sdxl.ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=sdxl.TE2_PROJECTION + 5 * sdxl.ADDITION_TIME_EMBED_DIM,
    ).eval()
    sd.perturb(model, seed + 1)
    return model


def build_xl_inpaint_unet(seed):
    """tiny-sdxl's UNet at two blocks with 9 input channels (an SDXL inpainting UNet)."""
    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=9,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        attention_head_dim=(2, 4),
        cross_attention_dim=sdxl.TE1_HIDDEN + sdxl.TE2_HIDDEN,
        use_linear_projection=True,
        norm_num_groups=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=sdxl.ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=sdxl.TE2_PROJECTION + 6 * sdxl.ADDITION_TIME_EMBED_DIM,
    ).eval()
    sd.perturb(model, seed + 1)
    return model


def save_unet(unet, name):
    out = os.path.join(sd.FIXTURES, name)
    shutil.rmtree(out, ignore_errors=True)
    unet.save_pretrained(out, safe_serialization=True)
    sd.canonicalize_safetensors(out)
    return UNet2DConditionModel.from_pretrained(out).eval()


def run_both(pipe, kwargs):
    """Runs `pipe` for np and pil output; returns (per-step latents, timesteps, np image, pil image)."""
    results = []
    for output in ("np", "pil"):
        steps, ts = [], []

        def on_step_end(_pipe, i, t, kw):
            steps.append(kw["latents"].detach().clone())
            ts.append(float(t))
            return kw

        res = pipe(
            **kwargs,
            generator=sd.gen(SEED),
            output_type=output,
            callback_on_step_end=on_step_end,
            callback_on_step_end_tensor_inputs=["latents"],
        )
        results.append((steps, ts, res.images))
    (steps, ts, np_images), (pil_steps, _, pil_images) = results
    assert all(torch.equal(a, b) for a, b in zip(steps, pil_steps))
    return steps, ts, np.asarray(np_images, dtype=np.float32), pil_images[0]


def record(tensors, info, name, steps, ts, image, png):
    for i, st in enumerate(steps):
        tensors[f"{name}.step{i}"] = st
    tensors[f"{name}.image"] = image
    info["timesteps"][name] = ts
    png.save(os.path.join(sd.GOLDEN, f"inpaint-{name}.png"))


def main():
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    mask_image().save(os.path.join(sd.GOLDEN, "inpaint-mask.png"))
    mask = PIL.Image.open(os.path.join(sd.GOLDEN, "inpaint-mask.png"))
    tensors, info = {}, {"diffusers": diffusers.__version__, "timesteps": {}}
    info["settings"] = {
        "prompt": PROMPT,
        "negative_prompt": NEGATIVE,
        "num_inference_steps": STEPS,
        "seed": SEED,
        "sd_guidance_scale": SD_GUIDANCE,
        "xl_guidance_scale": XL_GUIDANCE,
        "strength": {"pndm": 1.0, "euler": 0.75, "xl-img2img": 0.6, "xl-inpaint": 0.8},
        "refiner": REFINER,
    }

    # ---- SD 1.x inpainting, 9-channel and 4-channel UNets
    sd1 = os.path.join(sd.FIXTURES, "tiny-sd1")
    unet9 = save_unet(build_inpaint_unet(5100), "tiny-sd1-inpaint-unet")
    for channels, unet in ((9, unet9), (4, None)):
        extra = {"unet": unet} if unet is not None else {}
        pipe = StableDiffusionInpaintPipeline.from_pretrained(
            sd1, local_files_only=True, safety_checker=None, requires_safety_checker=False, **extra
        )
        pipe.set_progress_bar_config(disable=True)
        if channels == 9:
            tensors["mask_condition"] = pipe.mask_processor.preprocess(mask, height=64, width=64)
            record_resizes(pipe, tensors, info)
        base = dict(pipe.scheduler.config)
        for sched, cls in (("pndm", PNDMScheduler), ("euler", EulerDiscreteScheduler)):
            pipe.scheduler = cls.from_config(base)
            kwargs = dict(
                prompt=PROMPT,
                negative_prompt=NEGATIVE,
                image=image,
                mask_image=mask,
                height=64,
                width=64,
                strength=info["settings"]["strength"][sched],
                num_inference_steps=STEPS,
                guidance_scale=SD_GUIDANCE,
            )
            record(tensors, info, f"sd{channels}-{sched}", *run_both(pipe, kwargs))

    # ---- SDXL image to image and inpainting on tiny-sdxl
    xl = os.path.join(sd.FIXTURES, "tiny-sdxl")
    pipe = StableDiffusionXLImg2ImgPipeline.from_pretrained(xl, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        image=image,
        strength=info["settings"]["strength"]["xl-img2img"],
        num_inference_steps=STEPS,
        guidance_scale=XL_GUIDANCE,
    )
    record(tensors, info, "xl-img2img", *run_both(pipe, kwargs))

    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(xl, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        image=image,
        mask_image=mask,
        height=64,
        width=64,
        strength=info["settings"]["strength"]["xl-inpaint"],
        num_inference_steps=STEPS,
        guidance_scale=XL_GUIDANCE,
    )
    record(tensors, info, "xl-inpaint", *run_both(pipe, kwargs))
    xl_unet9 = save_unet(build_xl_inpaint_unet(5300), "tiny-sdxl-inpaint-unet")
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(xl, local_files_only=True, unet=xl_unet9)
    pipe.set_progress_bar_config(disable=True)
    record(tensors, info, "xl9-inpaint", *run_both(pipe, kwargs))

    # ---- base with denoising_end, then the refiner UNet with denoising_start
    refiner_unet = save_unet(build_refiner_unet(5200), "tiny-sdxl-refiner-unet")
    base = StableDiffusionXLPipeline.from_pretrained(xl, local_files_only=True)
    base.set_progress_bar_config(disable=True)
    base_steps = []

    def on_base_step(_pipe, i, t, kw):
        base_steps.append(kw["latents"].detach().clone())
        return kw

    handoff = base(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=XL_GUIDANCE,
        height=64,
        width=64,
        denoising_end=REFINER["denoising_end"],
        output_type="latent",
        generator=sd.gen(SEED),
        callback_on_step_end=on_base_step,
        callback_on_step_end_tensor_inputs=["latents"],
    ).images
    for i, st in enumerate(base_steps):
        tensors[f"xl-base.step{i}"] = st
    tensors["xl-base.latents"] = handoff
    refiner = StableDiffusionXLImg2ImgPipeline(
        vae=base.vae,
        text_encoder=base.text_encoder,
        text_encoder_2=base.text_encoder_2,
        tokenizer=base.tokenizer,
        tokenizer_2=base.tokenizer_2,
        unet=refiner_unet,
        scheduler=base.scheduler,
        requires_aesthetics_score=True,
    )
    refiner.set_progress_bar_config(disable=True)
    kwargs = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        image=handoff,
        num_inference_steps=STEPS,
        guidance_scale=XL_GUIDANCE,
        denoising_start=REFINER["denoising_end"],
        aesthetic_score=REFINER["aesthetic_score"],
        negative_aesthetic_score=REFINER["negative_aesthetic_score"],
    )
    record(tensors, info, "xl-refiner", *run_both(refiner, kwargs))
    # A second-order refiner: diffusers runs one more evaluation so no Heun step is split.
    refiner.scheduler = HeunDiscreteScheduler.from_config(base.scheduler.config)
    record(tensors, info, "xl-refiner-heun", *run_both(refiner, kwargs))

    save_canonical(os.path.join(sd.GOLDEN, "inpaint.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(sd.GOLDEN, "inpaint.json"), info)
    print("wrote golden/inpaint.*, tiny-sd1-inpaint-unet/, tiny-sdxl-refiner-unet/, tiny-sdxl-inpaint-unet/")


if __name__ == "__main__":
    main()
