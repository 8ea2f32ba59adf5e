#!/usr/bin/env python3
"""Build a tiny random-weight SDXL pipeline and its golden data.

Run by hand (never by tests), from the repository root:

    python3 tools/golden/make_tiny_sdxl.py [--bpe PATH/TO/bpe_simple_vocab_16e6.txt.gz]

Writes:
  tests/fixtures/tiny-sdxl/                   a real diffusers folder (save_pretrained)
  tests/fixtures/golden/tiny-sdxl.safetensors  reference tensors (canonical header)
  tests/fixtures/golden/tiny-sdxl.json         settings, timesteps, versions
  tests/fixtures/golden/tiny-sdxl-euler.png    final image of the 4-step generation

The layout follows stabilityai/stable-diffusion-xl-base-1.0 at toy sizes: two CLIP text
encoders (the second with projection; `tokenizer_2` pads with `!`; legacy eos id 2 in both
configs, as the real ones), a UNet with `addition_embed_type: text_time`, SDXL's block types
and per-block `transformer_layers_per_block`, a VAE with scaling factor 0.13025 and SDXL's
EulerDiscreteScheduler config. Seeded, reproducible bytes (see common.py); the tokenizer,
perturbation and saving helpers are make_tiny_sd.py's.
"""
import argparse
import json
import os
import shutil
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_sd as sd  # noqa: E402  (sets threads, determinism, offline mode)
from common import save_canonical, save_json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
import safetensors  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
)

NAME = "tiny-sdxl"
SEED = 3000
SETTINGS = {
    "prompt": "a photo of an astronaut riding a horse",
    "negative_prompt": "blurry",
    "num_inference_steps": 4,
    "guidance_scale": 5.0,
    "height": 64,
    "width": 64,
    "original_size": [96, 80],
    "crops_coords_top_left": [8, 4],
    "target_size": [64, 64],
    "denoising_end": 0.5,
}
UNET_TIMESTEP = 981
UNET_TIME_IDS = [[96, 80, 8, 4, 64, 64], [64, 64, 0, 0, 64, 48]]
# stabilityai/stable-diffusion-xl-base-1.0's scheduler_config.json.
SDXL_SCHEDULER = dict(
    _class_name="EulerDiscreteScheduler",
    beta_end=0.012,
    beta_schedule="scaled_linear",
    beta_start=0.00085,
    clip_sample=False,
    interpolation_type="linear",
    num_train_timesteps=1000,
    prediction_type="epsilon",
    sample_max_value=1.0,
    set_alpha_to_one=False,
    skip_prk_steps=True,
    steps_offset=1,
    timestep_spacing="leading",
    trained_betas=None,
    use_karras_sigmas=False,
)
# Text encoder widths: a real 49408-token vocabulary costs 200 KB per hidden unit, so both are
# narrow.
TE1_HIDDEN, TE2_HIDDEN, TE2_PROJECTION = 8, 8, 8
ADDITION_TIME_EMBED_DIM = 4


def text_config(hidden, act, projection):
    return CLIPTextConfig(
        vocab_size=49408,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 3,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act=act,
        projection_dim=projection,
        layer_norm_eps=1e-5,
        # As in the real SDXL configs (legacy ids: the pooled token is the highest id).
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    )


def build_text_encoders(seed):
    torch.manual_seed(seed)
    te1 = CLIPTextModel(text_config(TE1_HIDDEN, "quick_gelu", TE1_HIDDEN)).eval()
    sd.perturb(te1, seed + 1)
    torch.manual_seed(seed + 2)
    te2 = CLIPTextModelWithProjection(text_config(TE2_HIDDEN, "gelu", TE2_PROJECTION)).eval()
    sd.perturb(te2, seed + 3)
    return te1, te2


def build_unet(seed):
    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        attention_head_dim=(2, 4, 8),
        transformer_layers_per_block=(1, 1, 2),
        cross_attention_dim=TE1_HIDDEN + TE2_HIDDEN,
        use_linear_projection=True,
        norm_num_groups=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=TE2_PROJECTION + 6 * ADDITION_TIME_EMBED_DIM,
        upcast_attention=False,
    ).eval()
    sd.perturb(model, seed + 1)
    return model


def build_vae(seed):
    torch.manual_seed(seed)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=0.13025,
        force_upcast=True,
    ).eval()
    sd.perturb(model, seed + 1)
    return model


def make_tokenizer(vocab, merges, pad):
    tmp = os.path.join(sd.GOLDEN, ".tmp-tokenizer")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    sd.write_tokenizer(tmp, vocab, merges, pad)
    tok = CLIPTokenizer.from_pretrained(tmp)
    shutil.rmtree(tmp)
    assert tok.pad_token == pad
    return tok


def save_pipeline(pipe, vocab, merges):
    out = os.path.join(sd.FIXTURES, NAME)
    if os.path.exists(out):
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    for folder, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        shutil.rmtree(os.path.join(out, folder))
        sd.write_tokenizer(os.path.join(out, folder), vocab, merges, pad)
    sd.canonicalize_safetensors(out)
    return out


def run(pipe, latents, output_type, **kwargs):
    steps = []

    def on_step_end(_pipe, i, t, kw):
        steps.append(kw["latents"].detach().clone())
        return kw

    s = SETTINGS
    result = pipe(
        prompt=s["prompt"],
        num_inference_steps=s["num_inference_steps"],
        guidance_scale=s["guidance_scale"],
        height=s["height"],
        width=s["width"],
        original_size=tuple(s["original_size"]),
        crops_coords_top_left=tuple(s["crops_coords_top_left"]),
        target_size=tuple(s["target_size"]),
        latents=latents.clone(),
        output_type=output_type,
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=["latents"],
        **kwargs,
    )
    return result, steps


def golden(folder, built):
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True, add_watermarker=False)
    for part in ("text_encoder", "text_encoder_2", "unet", "vae"):
        a, b = getattr(built, part).state_dict(), getattr(pipe, part).state_dict()
        assert sorted(a) == sorted(b), part
        assert all(torch.equal(a[k], b[k]) for k in a), part
    assert isinstance(pipe.scheduler, EulerDiscreteScheduler)
    assert pipe.config.force_zeros_for_empty_prompt
    pipe.set_progress_bar_config(disable=True)
    s = SETTINGS
    tensors = {}
    info = {
        "name": NAME,
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "pipeline": dict(SETTINGS),
        "unet_timestep": UNET_TIMESTEP,
        "unet_time_ids": UNET_TIME_IDS,
        "text_rows": ["prompt", "negative_prompt", "empty string"],
    }
    with torch.no_grad():
        texts = [s["prompt"], s["negative_prompt"], ""]
        for i, (tok, te) in enumerate(((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2))):
            key = "te1" if i == 0 else "te2"
            ids = tok(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
            out = te(ids.to(torch.int64), output_hidden_states=True)
            tensors[f"{key}.input_ids"] = ids.to(torch.int64)
            tensors[f"{key}.penultimate"] = out.hidden_states[-2]
            if i == 1:
                tensors["te2.text_embeds"] = out.text_embeds
        assert (tensors["te2.input_ids"][0] == 0).any(), "tokenizer_2 pads with `!` (id 0)"

        # encode_prompt: with a negative prompt, with none (zeros), with an empty string.
        pe, ne, pp, npool = pipe.encode_prompt(s["prompt"], device="cpu", negative_prompt=s["negative_prompt"])
        tensors["encode.prompt_embeds"] = pe
        tensors["encode.negative_prompt_embeds"] = ne
        tensors["encode.pooled_prompt_embeds"] = pp
        tensors["encode.negative_pooled_prompt_embeds"] = npool
        _, zn, _, zp = pipe.encode_prompt(s["prompt"], device="cpu")
        assert torch.count_nonzero(zn) == 0 and torch.count_nonzero(zp) == 0
        _, en, _, ep = pipe.encode_prompt(s["prompt"], device="cpu", negative_prompt="")
        tensors["encode.empty_negative_prompt_embeds"] = en
        tensors["encode.empty_negative_pooled_prompt_embeds"] = ep
        assert torch.count_nonzero(en) > 0

        # One UNet call with the added condition.
        sample = torch.randn((2, 4, 8, 8), generator=sd.gen(SEED + 10))
        ehs = torch.cat([ne, pe])
        text_embeds = torch.cat([npool, pp])
        time_ids = torch.tensor(UNET_TIME_IDS, dtype=torch.float32)
        unet_out = pipe.unet(
            sample,
            torch.tensor(UNET_TIMESTEP),
            encoder_hidden_states=ehs,
            added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids},
        ).sample
        tensors["unet.sample"] = sample
        tensors["unet.encoder_hidden_states"] = ehs
        tensors["unet.text_embeds"] = text_embeds
        tensors["unet.time_ids"] = time_ids
        tensors["unet.out"] = unet_out
        info["unet_out_std"] = float(unet_out.std())
        assert unet_out.std() > 0.05

        # Whole generations.
        latents = torch.randn((1, 4, 8, 8), generator=sd.gen(SEED + 13))
        tensors["pipe.latents"] = latents
        res, steps = run(pipe, latents, "np", negative_prompt=s["negative_prompt"])
        info["timesteps"] = [float(t) for t in pipe.scheduler.timesteps.tolist()]
        info["sigmas"] = sd.to_py(pipe.scheduler.sigmas)
        info["init_noise_sigma"] = float(pipe.scheduler.init_noise_sigma)
        assert len(steps) == s["num_inference_steps"]
        for i, st in enumerate(steps):
            tensors[f"pipe.step{i}"] = st
        image = np.asarray(res.images, dtype=np.float32)
        assert image.shape == (1, 64, 64, 3)
        tensors["pipe.image"] = image
        info["image_stats"] = {"mean": float(image.mean()), "std": float(image.std())}
        res_pil, steps_pil = run(pipe, latents, "pil", negative_prompt=s["negative_prompt"])
        assert all(torch.equal(a, b) for a, b in zip(steps, steps_pil))
        pil = res_pil.images[0]
        assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
        pil.save(os.path.join(sd.GOLDEN, f"{NAME}-euler.png"))

        # No negative prompt: all-zero negative embeddings (force_zeros_for_empty_prompt).
        res, _ = run(pipe, latents, "latent")
        tensors["pipe.zeros.latents"] = res.images
        # Refiner-style early stop.
        res, steps = run(pipe, latents, "latent", negative_prompt=s["negative_prompt"], denoising_end=s["denoising_end"])
        info["denoising_end_steps"] = len(steps)
        assert 0 < len(steps) < s["num_inference_steps"]
        tensors["pipe.denoising_end.latents"] = res.images

    for k, v in tensors.items():
        if torch.is_tensor(v) and v.dtype.is_floating_point:
            tensors[k] = v.to(torch.float32)
    save_canonical(os.path.join(sd.GOLDEN, f"{NAME}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(sd.GOLDEN, f"{NAME}.json"), info)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bpe", help="path to open_clip's bpe_simple_vocab_16e6.txt.gz")
    args = ap.parse_args()
    candidates = [args.bpe] if args.bpe else list(sd.DEFAULT_BPE)
    bpe = next((c for c in candidates if c and os.path.exists(c)), None)
    if bpe is None:
        sys.exit("bpe_simple_vocab_16e6.txt.gz not found; see make_tiny_sd.py's docstring, or pass --bpe PATH")
    vocab, merges = sd.clip_vocab_and_merges(bpe)
    os.makedirs(sd.GOLDEN, exist_ok=True)
    te1, te2 = build_text_encoders(SEED + 100)
    pipe = StableDiffusionXLPipeline(
        vae=build_vae(SEED + 300),
        text_encoder=te1,
        text_encoder_2=te2,
        tokenizer=make_tokenizer(vocab, merges, "<|endoftext|>"),
        tokenizer_2=make_tokenizer(vocab, merges, "!"),
        unet=build_unet(SEED + 200),
        scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    folder = save_pipeline(pipe, vocab, merges)
    golden(folder, pipe)
    print(f"wrote {folder} and golden/{NAME}.*")


if __name__ == "__main__":
    main()
