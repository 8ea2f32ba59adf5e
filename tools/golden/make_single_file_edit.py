"""Single-file inpainting and SDXL refiner checkpoints, and diffusers' `from_single_file` on them.

    python3 tools/golden/make_single_file_edit.py

Run by hand (never by tests) after make_single_file.py, make_inpaint.py and make_refiner.py.
The two checkpoints are derived from the tiny single files of make_single_file.py, so only
their UNets are stored (the text encoders and VAE would be a few MB more of the same bytes):

  inpaint  tiny-sd1.safetensors with its UNet replaced by tiny-sd1-inpaint-unet (9 input
           channels) in the LDM layout: what an SD 1.x inpainting checkpoint holds.
  xl-inpaint  tiny-sdxl.safetensors with its UNet replaced by tiny-sdxl-inpaint-unet (9 input
           channels): an SDXL inpainting checkpoint (diffusers' `xl_inpaint`).
  refiner  tiny-sdxl.safetensors without the first text encoder, its OpenCLIP encoder moved
           from `conditioner.embedders.1.model.` to `conditioner.embedders.0.model.` (where
           the refiner keeps its only encoder) and its UNet replaced by tiny-sdxl-refiner's
           (5 time ids): what the SDXL refiner's single file holds.

Each recipe is written to the golden JSON and followed by the Rust test to make the same file.
diffusers' `from_single_file(config=folder)` loads each file (the folders are
tests/fixtures/tiny-sd1-inpaint and tiny-sdxl-inpaint, written here: tiny-sd1's / tiny-sdxl's
components with the 9-channel UNet, and tests/fixtures/tiny-sdxl-refiner); the UNet of each is
checked to be the folder's UNet rounded to float16, bit for bit. (For xl-inpaint, as in
make_single_file.py, text_encoder_2 is given diffusers' own `convert_open_clip_checkpoint`
conversion: `from_single_file` tells the tiny SDXL's two 8-wide encoders apart by width and
would take the first for both.) Writes

  tests/fixtures/single-file/tiny-sd1-inpaint.unet.safetensors    the UNet part (F16, LDM keys)
  tests/fixtures/single-file/tiny-sdxl-refiner.unet.safetensors   the UNet part (F16, LDM keys)
  tests/fixtures/single-file/tiny-sdxl-inpaint.unet.safetensors   the UNet part (F16, LDM keys)
  tests/fixtures/tiny-sd1-inpaint/, tiny-sdxl-inpaint/            the inpainting config folders
  tests/fixtures/golden/single-file-edit.{json,safetensors}, single-file-edit-CASE.png

Cases (4 steps, seed 42 through one torch.Generator, prompt and negative prompt of
make_inpaint.py, golden/img2img-input.png and golden/inpaint-mask.png at 64x64):
  sd9-inpaint      StableDiffusionInpaintPipeline.from_single_file, PNDM, strength 1
  refiner-image    StableDiffusionXLImg2ImgPipeline.from_single_file, strength 0.6,
                   aesthetic scores 7 / 2
  xl9-inpaint      StableDiffusionXLInpaintPipeline.from_single_file, strength 0.8
Reruns give identical bytes.
"""
import json
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_single_file as msf  # noqa: E402  (offline, 1 thread, LDM key mapping)
import make_tiny_sd as sd  # noqa: E402
import make_inpaint as ip  # noqa: E402
from common import save_canonical, save_json  # noqa: E402

import PIL.Image  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
from diffusers import (  # noqa: E402
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    UNet2DConditionModel,
)
from safetensors.torch import load_file  # noqa: E402

SINGLE = os.path.join(sd.FIXTURES, "single-file")
UNET = "model.diffusion_model."
REFINER_STRENGTH = 0.6

RECIPES = {
    "inpaint": {
        "base": "tiny-sd1.safetensors",
        "unet": "tiny-sd1-inpaint.unet.safetensors",
        "drop": [UNET],
        "rename": [],
        "config": "tiny-sd1-inpaint",
    },
    "xl-inpaint": {
        "base": "tiny-sdxl.safetensors",
        "unet": "tiny-sdxl-inpaint.unet.safetensors",
        "drop": [UNET],
        "rename": [],
        "config": "tiny-sdxl-inpaint",
    },
    "refiner": {
        "base": "tiny-sdxl.safetensors",
        "unet": "tiny-sdxl-refiner.unet.safetensors",
        "drop": [UNET, "conditioner.embedders.0.transformer."],
        "rename": [["conditioner.embedders.1.model.", "conditioner.embedders.0.model."]],
        "config": "tiny-sdxl-refiner",
    },
}


def write_inpaint_folder(base="tiny-sd1", cls="StableDiffusionInpaintPipeline"):
    """`base`'s components with its 9-channel UNet, as an inpainting pipeline folder."""
    out = os.path.join(sd.FIXTURES, f"{base}-inpaint")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name in sorted(os.listdir(os.path.join(sd.FIXTURES, base))):
        if name not in ("unet", "model_index.json"):
            os.symlink(os.path.join("..", base, name), os.path.join(out, name))
    os.symlink(os.path.join("..", f"{base}-inpaint-unet"), os.path.join(out, "unet"))
    with open(os.path.join(sd.FIXTURES, base, "model_index.json")) as f:
        index = json.load(f)
    index["_class_name"] = cls
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return out


def write_unet_part(name, unet_dir):
    """The folder's UNet in the LDM layout, float16, as the recipe's `unet` file."""
    unet = UNet2DConditionModel.from_pretrained(unet_dir).eval()
    ldm = msf.unet_to_ldm(unet.state_dict(), unet.config)
    half = {k: v.detach().to(torch.float16).contiguous() for k, v in ldm.items()}
    save_canonical(os.path.join(SINGLE, RECIPES[name]["unet"]), half)
    return unet


def compose(recipe):
    """The recipe's checkpoint: the base file without the dropped prefixes, renamed, plus the UNet."""
    base = load_file(os.path.join(SINGLE, recipe["base"]))
    out = {}
    for key, value in base.items():
        if any(key.startswith(p) for p in recipe["drop"]):
            continue
        for old, new in recipe["rename"]:
            if key.startswith(old):
                key = new + key[len(old):]
        out[key] = value
    unet = load_file(os.path.join(SINGLE, recipe["unet"]))
    assert not set(unet) & set(out)
    out.update(unet)
    return out


def check_unet(pipe, folder_unet, what):
    a = folder_unet.state_dict()
    b = pipe.unet.state_dict()
    assert sorted(a) == sorted(b), what
    bad = [k for k in a if not torch.equal(a[k].to(torch.float16).to(torch.float32), b[k])]
    assert not bad, f"{what}: {bad[:5]}"


def main():
    inpaint_folder = write_inpaint_folder()
    refiner_folder = os.path.join(sd.FIXTURES, "tiny-sdxl-refiner")
    unet9 = write_unet_part("inpaint", os.path.join(sd.FIXTURES, "tiny-sd1-inpaint-unet"))
    refiner_unet = write_unet_part("refiner", os.path.join(refiner_folder, "unet"))
    xl_folder = write_inpaint_folder("tiny-sdxl", "StableDiffusionXLInpaintPipeline")
    xl_unet9 = write_unet_part("xl-inpaint", os.path.join(sd.FIXTURES, "tiny-sdxl-inpaint-unet"))
    image = PIL.Image.open(os.path.join(sd.GOLDEN, "img2img-input.png")).convert("RGB")
    mask = PIL.Image.open(os.path.join(sd.GOLDEN, "inpaint-mask.png"))
    tensors, info = {}, {
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
        "recipes": RECIPES,
        "timesteps": {},
        "settings": {
            "prompt": ip.PROMPT,
            "negative_prompt": ip.NEGATIVE,
            "num_inference_steps": ip.STEPS,
            "seed": ip.SEED,
            "sd_guidance_scale": ip.SD_GUIDANCE,
            "xl_guidance_scale": ip.XL_GUIDANCE,
            "inpaint_strength": 1.0,
            "xl_inpaint_strength": 0.8,
            "refiner_strength": REFINER_STRENGTH,
            "aesthetic_score": ip.REFINER["aesthetic_score"],
            "negative_aesthetic_score": ip.REFINER["negative_aesthetic_score"],
        },
    }

    def record(name, steps, ts, np_image, png):
        for i, st in enumerate(steps):
            tensors[f"{name}.step{i}"] = st
        tensors[f"{name}.image"] = np_image
        info["timesteps"][name] = ts
        png.save(os.path.join(sd.GOLDEN, f"single-file-edit-{name}.png"))

    with tempfile.TemporaryDirectory() as tmp:
        # ---- SD 1.x inpainting checkpoint
        path = os.path.join(tmp, "tiny-sd1-inpaint.safetensors")
        ckpt = compose(RECIPES["inpaint"])
        info["recipes"]["inpaint"]["tensors"] = len(ckpt)
        save_canonical(path, ckpt)
        pipe = StableDiffusionInpaintPipeline.from_single_file(
            path, config=inpaint_folder, local_files_only=True, torch_dtype=torch.float32,
            safety_checker=None, requires_safety_checker=False,
        )
        pipe.set_progress_bar_config(disable=True)
        assert pipe.unet.config.in_channels == 9
        assert type(pipe.scheduler).__name__ == "PNDMScheduler"
        check_unet(pipe, unet9, "inpaint UNet")
        kwargs = dict(
            prompt=ip.PROMPT, negative_prompt=ip.NEGATIVE, image=image, mask_image=mask,
            height=64, width=64, strength=1.0, num_inference_steps=ip.STEPS,
            guidance_scale=ip.SD_GUIDANCE,
        )
        record("sd9-inpaint", *ip.run_both(pipe, kwargs))

        # ---- SDXL refiner
        path = os.path.join(tmp, "tiny-sdxl-refiner.safetensors")
        ckpt = compose(RECIPES["refiner"])
        info["recipes"]["refiner"]["tensors"] = len(ckpt)
        save_canonical(path, ckpt)
        pipe = StableDiffusionXLImg2ImgPipeline.from_single_file(
            path, config=refiner_folder, local_files_only=True, torch_dtype=torch.float32,
        )
        pipe.set_progress_bar_config(disable=True)
        assert pipe.text_encoder is None and pipe.config.requires_aesthetics_score
        check_unet(pipe, refiner_unet, "refiner UNet")
        for part in ("vae", "text_encoder_2"):
            for key, value in getattr(pipe, part).state_dict().items():
                assert not value.is_meta and torch.isfinite(value).all(), f"{part}.{key}"
        kwargs = dict(
            prompt=ip.PROMPT, negative_prompt=ip.NEGATIVE, image=image,
            strength=REFINER_STRENGTH, num_inference_steps=ip.STEPS,
            guidance_scale=ip.XL_GUIDANCE,
            aesthetic_score=ip.REFINER["aesthetic_score"],
            negative_aesthetic_score=ip.REFINER["negative_aesthetic_score"],
        )
        record("refiner-image", *ip.run_both(pipe, kwargs))

        # ---- SDXL inpainting checkpoint
        path = os.path.join(tmp, "tiny-sdxl-inpaint.safetensors")
        ckpt = compose(RECIPES["xl-inpaint"])
        info["recipes"]["xl-inpaint"]["tensors"] = len(ckpt)
        save_canonical(path, ckpt)
        pipe = StableDiffusionXLInpaintPipeline.from_single_file(
            path, config=xl_folder, local_files_only=True, torch_dtype=torch.float32,
        )
        pipe.set_progress_bar_config(disable=True)
        assert pipe.unet.config.in_channels == 9
        check_unet(pipe, xl_unet9, "SDXL inpaint UNet")
        converted = msf.text_encoder_2_reference(pipe, load_file(path))
        converted = {k: v.to(torch.float32) for k, v in converted.items()}
        missing, unexpected = pipe.text_encoder_2.load_state_dict(converted, strict=False, assign=True)
        assert not unexpected and all(k.endswith("position_ids") for k in missing), (missing, unexpected)
        for part in ("vae", "text_encoder", "text_encoder_2"):
            for key, value in getattr(pipe, part).state_dict().items():
                assert not value.is_meta and torch.isfinite(value).all(), f"{part}.{key}"
        kwargs = dict(
            prompt=ip.PROMPT, negative_prompt=ip.NEGATIVE, image=image, mask_image=mask,
            height=64, width=64, strength=0.8, num_inference_steps=ip.STEPS,
            guidance_scale=ip.XL_GUIDANCE,
        )
        record("xl9-inpaint", *ip.run_both(pipe, kwargs))

    save_canonical(os.path.join(sd.GOLDEN, "single-file-edit.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(sd.GOLDEN, "single-file-edit.json"), info)
    for r in RECIPES.values():
        p = os.path.join(SINGLE, r["unet"])
        print(f"wrote {os.path.relpath(p, sd.ROOT if hasattr(sd, 'ROOT') else '.')} ({os.path.getsize(p)} bytes)")
    print("wrote tiny-sd1-inpaint/, tiny-sdxl-inpaint/, golden/single-file-edit.*")


if __name__ == "__main__":
    main()
