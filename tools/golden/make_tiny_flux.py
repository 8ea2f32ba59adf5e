#!/usr/bin/env python3
"""Build tiny random-weight Flux.1 pipelines (dev-like and schnell-like) and their golden data.

Run by hand (never by tests), from the repository root, after make_tiny_sd.py and
make_tiny_pixart.py (their tokenizers are reused):

    python3 tools/golden/make_tiny_flux.py

Writes:
  tests/fixtures/tiny-flux-dev/        a real diffusers FluxPipeline folder (save_pretrained):
                                       guidance-distilled transformer (`guidance_embeds`),
                                       FLUX.1-dev's scheduler config (dynamic shifting)
  tests/fixtures/tiny-flux-schnell/    a FluxPipeline without guidance embedding and with
                                       FLUX.1-schnell's scheduler config (no dynamic shift);
                                       text encoders, tokenizers and VAE are links to the dev
                                       folder's
  tests/fixtures/golden/tiny-flux.safetensors  reference tensors (canonical header)
  tests/fixtures/golden/tiny-flux.json         settings, timesteps, sigmas, versions
  tests/fixtures/golden/tiny-flux-{dev,dev-true-cfg,schnell}.png  the final images

Tokenizers are symbolic links to the fixtures that already carry them: `tokenizer` (CLIP) to
tiny-sd1's, `tokenizer_2` (T5) to tiny-pixart-alpha's. Everything is seeded and written so that
reruns give identical bytes.
"""
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save_canonical, save_json  # noqa: E402
from make_tiny_pixart import canonicalize_safetensors  # noqa: E402
from make_tiny_sd import gen, perturb  # noqa: E402

import diffusers  # noqa: E402
import safetensors  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # noqa: E402
from diffusers.utils import logging as dlogging  # noqa: E402
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

dlogging.disable_progress_bar()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")
NAME = "tiny-flux"
SEED = 4000

CLIP_HIDDEN = 8
T5_DIM = 16
HEADS, HEAD_DIM, AXES = 2, 16, (4, 6, 6)

# FLUX.1-dev's and FLUX.1-schnell's scheduler_config.json.
DEV_SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
)
SCHNELL_SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False,
)

# 96x64 images: latents 16x8x12, packed to 4x6 = 24 tokens of 64 channels.
DEV_RUN = {
    "prompt": "A photo of an astronaut riding a horse on the moon",
    "num_inference_steps": 4,
    "guidance_scale": 3.5,
    "height": 64,
    "width": 96,
    "max_sequence_length": 24,
    "seed": SEED + 50,
}
# True classifier-free guidance (negative prompt and true_cfg_scale > 1), two steps.
TRUE_CFG_RUN = {
    "prompt": "a red cube on a blue sphere",
    "negative_prompt": "blurry, low quality",
    "true_cfg_scale": 2.5,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
    "height": 64,
    "width": 64,
    "max_sequence_length": 16,
    "seed": SEED + 60,
}
# schnell: guidance ignored, explicit latents, 48x80 (latents 6x10, 15 tokens).
SCHNELL_RUN = {
    "prompt": "a lighthouse at dusk, oil painting",
    "num_inference_steps": 2,
    "guidance_scale": 0.0,
    "height": 48,
    "width": 80,
    "max_sequence_length": 16,
}
LONG_PROMPT = " ".join(["a very detailed castle on a hill at sunset with dramatic clouds"] * 8)


def build_clip(seed):
    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=CLIP_HIDDEN, intermediate_size=2 * CLIP_HIDDEN + 3,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
        hidden_act="quick_gelu", projection_dim=CLIP_HIDDEN, layer_norm_eps=1e-5,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    )
    torch.manual_seed(seed)
    model = CLIPTextModel(config).eval()
    perturb(model, seed + 1)
    return model


def build_t5(seed):
    config = T5Config(
        vocab_size=32128, d_model=T5_DIM, d_kv=8, d_ff=23, num_layers=2, num_heads=2,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
        is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = T5EncoderModel(config).eval()
    perturb(model, seed + 1)
    # Stored as bf16 (as Flux's T5 ships): round now so the f32 reference holds those values.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def build_transformer(seed, guidance_embeds):
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=T5_DIM,
        pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=guidance_embeds, axes_dims_rope=AXES,
    ).eval()
    perturb(model, seed + 1)
    # adaLN-Zero and the output layer start at zero in diffusers' init; perturb made them
    # 0.1 N(0, 1): scale them up so every block changes the result clearly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".linear." in name or name.startswith("proj_out"):
                p.mul_(5.0)
    return model


def build_vae(seed):
    torch.manual_seed(seed)
    model = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16,
        norm_num_groups=4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
    ).eval()
    perturb(model, seed + 1)
    return model


def link(folder, name, target):
    path = os.path.join(folder, name)
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    os.symlink(target, path)


def save_dev(pipe):
    out = os.path.join(FIXTURES, "tiny-flux-dev")
    if os.path.exists(out):
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    shutil.rmtree(os.path.join(out, "text_encoder_2"))
    half = T5EncoderModel(pipe.text_encoder_2.config)
    half.load_state_dict(pipe.text_encoder_2.state_dict())
    half.to(torch.bfloat16).save_pretrained(os.path.join(out, "text_encoder_2"), safe_serialization=True)
    link(out, "tokenizer", "../tiny-sd1/tokenizer")
    link(out, "tokenizer_2", "../tiny-pixart-alpha/tokenizer")
    canonicalize_safetensors(out)
    return out


def save_schnell(pipe):
    out = os.path.join(FIXTURES, "tiny-flux-schnell")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    pipe.transformer.save_pretrained(os.path.join(out, "transformer"), safe_serialization=True)
    pipe.scheduler.save_pretrained(os.path.join(out, "scheduler"))
    shutil.copy(os.path.join(FIXTURES, "tiny-flux-dev", "model_index.json"), out)
    for part in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        link(out, part, f"../tiny-flux-dev/{part}")
    canonicalize_safetensors(os.path.join(out, "transformer"))
    return out


def load(folder, built):
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    for part in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        a, b = getattr(built, part).state_dict(), getattr(pipe, part).state_dict()
        assert sorted(a) == sorted(b), (part, set(a) ^ set(b))
        assert all(torch.equal(a[k], b[k]) for k in a), part
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, settings, output_type, latents=None):
    steps = []

    def on_step(p, i, t, kwargs):
        steps.append((float(t), kwargs["latents"].detach().clone()))
        return {}

    kwargs = {k: v for k, v in settings.items() if k != "seed"}
    if "seed" in settings:
        kwargs["generator"] = torch.Generator("cpu").manual_seed(settings["seed"])
    if latents is not None:
        kwargs["latents"] = latents.clone()
    result = pipe(output_type=output_type, callback_on_step_end=on_step, **kwargs)
    return result, steps


def golden_run(pipe, tag, settings, tensors, info, latents=None):
    """One generation: per-step packed latents, the float image and the PNG."""
    res_np, steps = run(pipe, settings, "np", latents)
    info[f"{tag}.timesteps"] = [t for t, _ in steps]
    info[f"{tag}.sigmas"] = [float(s) for s in pipe.scheduler.sigmas.tolist()]
    for i, (_, st) in enumerate(steps):
        assert torch.isfinite(st).all()
        tensors[f"{tag}.step{i}"] = st
    image = np.asarray(res_np.images, dtype=np.float32)
    assert image.shape == (1, settings["height"], settings["width"], 3), image.shape
    assert image.std() > 0.02, image.std()
    tensors[f"{tag}.image"] = image
    res_pil, steps_pil = run(pipe, settings, "pil", latents)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(steps, steps_pil))
    pil = res_pil.images[0]
    assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
    pil.save(os.path.join(GOLDEN, f"{NAME}-{tag}.png"))


def golden(dev_pipe, schnell_pipe):
    tensors, info = {}, {
        "versions": {
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "dev": DEV_RUN, "dev_true_cfg": TRUE_CFG_RUN, "schnell": SCHNELL_RUN,
        "long_prompt": LONG_PROMPT,
    }
    pipe = dev_pipe
    with torch.no_grad():
        # Text: CLIP pooled and T5 hidden states as the pipeline computes them.
        s = DEV_RUN
        L = s["max_sequence_length"]
        clip_ids = pipe.tokenizer(s["prompt"], padding="max_length", max_length=77, truncation=True,
                                  return_tensors="pt").input_ids
        t5_ids = pipe.tokenizer_2(s["prompt"], padding="max_length", max_length=L, truncation=True,
                                  return_tensors="pt").input_ids
        tensors["clip.input_ids"] = clip_ids.to(torch.int64)
        tensors["t5.input_ids"] = t5_ids.to(torch.int64)
        pe, pooled, text_ids = pipe.encode_prompt(s["prompt"], device="cpu", max_sequence_length=L)
        assert torch.equal(pooled, pipe.text_encoder(clip_ids).pooler_output)
        assert torch.equal(pe, pipe.text_encoder_2(t5_ids)[0])
        assert not text_ids.any()
        tensors["prompt_embeds"] = pe
        tensors["pooled_prompt_embeds"] = pooled
        # A prompt longer than 24 T5 tokens: cut (the pipeline warns), the last kept token eos.
        long_pe, long_pooled, _ = pipe.encode_prompt(LONG_PROMPT, device="cpu", max_sequence_length=L)
        tensors["long.prompt_embeds"] = long_pe
        tensors["long.pooled_prompt_embeds"] = long_pooled
        long_ids = pipe.tokenizer_2(LONG_PROMPT, padding="max_length", max_length=L, truncation=True).input_ids
        assert long_ids[-1] == 1 and len(pipe.tokenizer_2(LONG_PROMPT).input_ids) > L

        # Rotary tables of FluxPosEmbed for ids with several values on every axis.
        ids = torch.stack(
            [torch.arange(10) % 3, torch.arange(10) // 2, (torch.arange(10) * 7) % 5], dim=1
        ).to(torch.float32)
        cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(AXES))(ids)
        tensors["rope.ids"], tensors["rope.cos"], tensors["rope.sin"] = ids, cos, sin

        # One transformer call of each: batch 2, 4x6 image tokens, 7 text tokens.
        img_ids = FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32)
        txt_ids = torch.zeros(7, 3)
        hidden = torch.randn((2, 24, 64), generator=gen(SEED + 10))
        ehs = torch.randn((2, 7, T5_DIM), generator=gen(SEED + 11))
        pool = torch.randn((2, CLIP_HIDDEN), generator=gen(SEED + 12))
        t = torch.tensor([0.75, 0.3])
        g = torch.tensor([3.5, 5.0])
        tensors.update({
            "transformer.hidden_states": hidden, "transformer.encoder_hidden_states": ehs,
            "transformer.pooled_projections": pool, "transformer.timestep": t,
            "transformer.guidance": g, "transformer.img_ids": img_ids,
        })
        out = pipe.transformer(hidden_states=hidden, encoder_hidden_states=ehs, pooled_projections=pool,
                               timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=g).sample
        assert out.shape == (2, 24, 64) and out.std() > 0.1, out.std()
        tensors["transformer.dev.out"] = out
        out_s = schnell_pipe.transformer(hidden_states=hidden, encoder_hidden_states=ehs,
                                         pooled_projections=pool, timestep=t, img_ids=img_ids,
                                         txt_ids=txt_ids).sample
        assert out_s.std() > 0.1
        tensors["transformer.schnell.out"] = out_s

        # Whole generations.
        shape = (1, 16, 2 * (DEV_RUN["height"] // 16), 2 * (DEV_RUN["width"] // 16))
        tensors["dev.initial_latents"] = torch.randn(shape, generator=gen(DEV_RUN["seed"]))
        golden_run(dev_pipe, "dev", DEV_RUN, tensors, info)
        golden_run(dev_pipe, "dev-true-cfg", TRUE_CFG_RUN, tensors, info)
        s = SCHNELL_RUN
        latents = torch.randn((1, 16, s["height"] // 8, s["width"] // 8), generator=gen(SEED + 70))
        tensors["schnell.initial_latents"] = latents
        packed = FluxPipeline._pack_latents(latents, 1, 16, s["height"] // 8, s["width"] // 8)
        golden_run(schnell_pipe, "schnell", SCHNELL_RUN, tensors, info, latents=packed)

    for k, v in tensors.items():
        if torch.is_tensor(v) and v.dtype.is_floating_point:
            tensors[k] = v.to(torch.float32)
    save_canonical(os.path.join(GOLDEN, f"{NAME}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, f"{NAME}.json"), info)


def main():
    for need in ("tiny-sd1/tokenizer", "tiny-pixart-alpha/tokenizer"):
        if not os.path.isdir(os.path.join(FIXTURES, need)):
            sys.exit(f"tests/fixtures/{need} is missing: run make_tiny_sd.py / make_tiny_pixart.py first")
    os.makedirs(GOLDEN, exist_ok=True)
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(FIXTURES, "tiny-sd1", "tokenizer"))
    tokenizer_2 = T5TokenizerFast.from_pretrained(os.path.join(FIXTURES, "tiny-pixart-alpha", "tokenizer"))
    vae = build_vae(SEED + 300)
    dev = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER), vae=vae,
        text_encoder=build_clip(SEED + 100), tokenizer=tokenizer,
        text_encoder_2=build_t5(SEED + 200), tokenizer_2=tokenizer_2,
        transformer=build_transformer(SEED + 400, True),
    )
    dev_dir = save_dev(dev)
    schnell = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHNELL_SCHEDULER), vae=vae,
        text_encoder=dev.text_encoder, tokenizer=tokenizer, text_encoder_2=dev.text_encoder_2,
        tokenizer_2=tokenizer_2, transformer=build_transformer(SEED + 500, False),
    )
    schnell_dir = save_schnell(schnell)
    golden(load(dev_dir, dev), load(schnell_dir, schnell))
    print(f"wrote {dev_dir}, {schnell_dir} and golden/{NAME}.*")


if __name__ == "__main__":
    main()
