#!/usr/bin/env python3
"""Golden data for an SDXL refiner folder without the first text encoder, as stabilityai's
stable-diffusion-xl-refiner-1.0 ships (`text_encoder: [null, null]`, `tokenizer: [null, null]`,
`requires_aesthetics_score: true`).

Run by hand (never by tests), from the repository root, after make_tiny_sdxl.py and
make_inpaint.py (it continues the `xl-base.latents` handoff recorded there):

    python3 tools/golden/make_refiner.py

Writes
  tests/fixtures/tiny-sdxl-refiner/           the refiner folder: model_index.json, a small UNet
                                              (cross_attention_dim = text_encoder_2's hidden size,
                                              5 time ids) and symlinks to tiny-sdxl's
                                              text_encoder_2, tokenizer_2, vae and scheduler
  tests/fixtures/golden/refiner.{json,safetensors}, refiner-CASE.png

Cases: StableDiffusionXLImg2ImgPipeline.from_pretrained on that folder (4 steps, seed 42,
guidance 5, aesthetic scores 7 / 2, prompt and negative prompt as make_inpaint.py)
  xl-refiner-te2        denoising_start 0.5 on tiny-sdxl's denoising_end 0.5 latents
  xl-refiner-te2-image  golden/img2img-input.png at strength 0.6 (what the img2img binary does)
Reruns give identical bytes.
"""
import json
import os
import shutil
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (threads, determinism, offline mode)
import make_tiny_sdxl as sdxl  # noqa: E402
import make_inpaint as ip  # noqa: E402
from common import save_canonical, save_json  # noqa: E402

import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import StableDiffusionXLImg2ImgPipeline, UNet2DConditionModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

NAME = "tiny-sdxl-refiner"
CASE = "xl-refiner-te2"
STRENGTH = 0.6
SHARED = ("text_encoder_2", "tokenizer_2", "vae", "scheduler")


def record(tensors, info, name, steps, ts, image, png):
    for i, st in enumerate(steps):
        tensors[f"{name}.step{i}"] = st
    tensors[f"{name}.image"] = image
    info["timesteps"][name] = ts
    png.save(os.path.join(sd.GOLDEN, f"refiner-{name}.png"))


def build_unet(seed):
    """A refiner UNet: context from text_encoder_2 alone, 5 time ids; channels (8, 16) keep it
    small."""
    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        attention_head_dim=(2, 4),
        cross_attention_dim=sdxl.TE2_HIDDEN,
        use_linear_projection=True,
        norm_num_groups=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=sdxl.ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=sdxl.TE2_PROJECTION + 5 * sdxl.ADDITION_TIME_EMBED_DIM,
    ).eval()
    sd.perturb(model, seed + 1)
    return model


def write_folder():
    base = os.path.join(sd.FIXTURES, "tiny-sdxl")
    out = os.path.join(sd.FIXTURES, NAME)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name in SHARED:
        os.symlink(os.path.join("..", "tiny-sdxl", name), os.path.join(out, name))
    unet = build_unet(5400)
    unet.save_pretrained(os.path.join(out, "unet"), safe_serialization=True)
    sd.canonicalize_safetensors(os.path.join(out, "unet"))
    with open(os.path.join(base, "model_index.json")) as f:
        index = json.load(f)
    index["_class_name"] = "StableDiffusionXLImg2ImgPipeline"
    index["text_encoder"] = [None, None]
    index["tokenizer"] = [None, None]
    index["requires_aesthetics_score"] = True
    index["force_zeros_for_empty_prompt"] = False
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return out


def main():
    folder = write_folder()
    handoff = load_file(os.path.join(sd.GOLDEN, "inpaint.safetensors"))["xl-base.latents"]
    pipe = StableDiffusionXLImg2ImgPipeline.from_pretrained(folder, local_files_only=True)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    assert pipe.config.requires_aesthetics_score
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(
        prompt=ip.PROMPT,
        negative_prompt=ip.NEGATIVE,
        image=handoff,
        num_inference_steps=ip.STEPS,
        guidance_scale=ip.XL_GUIDANCE,
        denoising_start=ip.REFINER["denoising_end"],
        aesthetic_score=ip.REFINER["aesthetic_score"],
        negative_aesthetic_score=ip.REFINER["negative_aesthetic_score"],
    )
    tensors, info = {}, {"diffusers": diffusers.__version__, "timesteps": {}}
    info["settings"] = {
        "prompt": ip.PROMPT,
        "negative_prompt": ip.NEGATIVE,
        "num_inference_steps": ip.STEPS,
        "seed": ip.SEED,
        "xl_guidance_scale": ip.XL_GUIDANCE,
        "refiner": ip.REFINER,
    }
    info["settings"]["strength"] = STRENGTH
    record(tensors, info, CASE, *ip.run_both(pipe, kwargs))
    kwargs.pop("denoising_start")
    kwargs["image"] = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    kwargs["strength"] = STRENGTH
    record(tensors, info, f"{CASE}-image", *ip.run_both(pipe, kwargs))
    save_canonical(os.path.join(sd.GOLDEN, "refiner.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(sd.GOLDEN, "refiner.json"), info)
    print(f"wrote {NAME}/, golden/refiner.*")


if __name__ == "__main__":
    main()
