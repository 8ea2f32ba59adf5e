#!/usr/bin/env python3
"""Build a tiny random-weight Stable Diffusion 3 pipeline and its golden data.

Run by hand (never by tests), from the repository root, after make_tiny_sdxl.py and
make_tiny_pixart.py (their fixtures are reused):

    python3 tools/golden/make_tiny_sd3.py

Writes:
  tests/fixtures/tiny-sd3/                 a real diffusers folder (save_pretrained); the
                                           components already in other fixtures are symlinks:
                                           text_encoder_2, tokenizer, tokenizer_2 -> tiny-sdxl,
                                           text_encoder_3, tokenizer_3 -> tiny-pixart-alpha
  tests/fixtures/tiny-sd35-transformer/    a lone SD3.5-style transformer (qk_norm rms_norm,
                                           dual attention in block 0, three blocks)
  tests/fixtures/golden/tiny-sd3.safetensors   reference tensors (canonical header)
  tests/fixtures/golden/tiny-sd3.json      settings, timesteps, versions
  tests/fixtures/golden/tiny-sd3.png       the final image of the pipeline run

Everything is seeded and every file is written so that reruns give identical bytes.
"""
import json
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
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.utils import logging as dlogging  # noqa: E402
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
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
NAME = "tiny-sd3"
SEED = 5000

# Components reused from other fixtures (symlinked, not copied).
REUSED = {
    "text_encoder_2": "../tiny-sdxl/text_encoder_2",
    "tokenizer": "../tiny-sdxl/tokenizer",
    "tokenizer_2": "../tiny-sdxl/tokenizer_2",
    "text_encoder_3": "../tiny-pixart-alpha/text_encoder",
    "tokenizer_3": "../tiny-pixart-alpha/tokenizer",
}

PIPELINE_SETTINGS = {
    "prompt": "A photo of an astronaut riding a horse on the moon",
    "negative_prompt": "blurry, low quality",
    "num_inference_steps": 3,
    "guidance_scale": 5.0,
    "height": 64,
    "width": 48,
    "max_sequence_length": 24,
}
TRANSFORMER_TIMESTEP = 750.0
LONG_PROMPT = " ".join(
    "an extremely detailed painting of a castle on a hill at sunset with dramatic clouds,"
    " volumetric light, trending on artstation".split()
    * 4
)
LONG_MAX_SEQUENCE_LENGTH = 16

SLG = dict(
    skip_guidance_layers=[1],
    skip_layer_guidance_scale=2.8,
    skip_layer_guidance_start=0.0,
    skip_layer_guidance_stop=1.0,
)

# stabilityai/stable-diffusion-3-medium-diffusers' scheduler_config.json.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)


def build_clip_l(seed):
    """CLIP-L stand-in with projection (quick_gelu as OpenAI's CLIP), stored in fp16."""
    config = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=8,
        intermediate_size=19,
        projection_dim=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = CLIPTextModelWithProjection(config).eval()
    perturb(model, seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))
    return model


def build_transformer(seed, num_layers=2, qk_norm=None, dual_attention_layers=()):
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=16,
        pos_embed_max_size=12,
        dual_attention_layers=tuple(dual_attention_layers),
        qk_norm=qk_norm,
    ).eval()
    perturb(model, seed + 1)
    return model


def build_vae(seed):
    torch.manual_seed(seed)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    perturb(model, seed + 1)
    return model


def link_reused(folder):
    for name, target in REUSED.items():
        path = os.path.join(folder, name)
        shutil.rmtree(path)
        os.symlink(target, path)


def run(pipe, latents, output_type, **extra):
    steps = []

    def on_step(p, i, t, kwargs):
        steps.append((float(t), kwargs["latents"].detach().clone()))
        return {}

    s = PIPELINE_SETTINGS
    args = dict(
        prompt=s["prompt"],
        negative_prompt=s["negative_prompt"],
        num_inference_steps=s["num_inference_steps"],
        guidance_scale=s["guidance_scale"],
        height=s["height"],
        width=s["width"],
        max_sequence_length=s["max_sequence_length"],
        latents=latents.clone(),
        output_type=output_type,
        callback_on_step_end=on_step,
    )
    args.update(extra)
    result = pipe(**args)
    return result, steps


def load(folder, **kw):
    pipe = StableDiffusion3Pipeline.from_pretrained(
        folder, local_files_only=True, torch_dtype=torch.float32, **kw
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def golden(folder, built, sd35_dir):
    pipe = load(folder)
    for part in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"):
        a, b = getattr(built, part).state_dict(), getattr(pipe, part).state_dict()
        assert sorted(a) == sorted(b), (part, set(a) ^ set(b))
        assert all(torch.equal(a[k], b[k]) for k in a), part
    s = PIPELINE_SETTINGS
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
        "pipeline": dict(s),
        "transformer_timestep": TRANSFORMER_TIMESTEP,
        "long_prompt": LONG_PROMPT,
        "long_max_sequence_length": LONG_MAX_SEQUENCE_LENGTH,
    }
    with torch.no_grad():
        pe, ne, pp, npool = pipe.encode_prompt(
            s["prompt"], None, None, device="cpu", do_classifier_free_guidance=True,
            negative_prompt=s["negative_prompt"], max_sequence_length=s["max_sequence_length"],
        )
        assert pe.shape == (1, 77 + s["max_sequence_length"], 32), pe.shape
        assert pp.shape == (1, 16)
        tensors["encode.prompt_embeds"] = pe
        tensors["encode.negative_prompt_embeds"] = ne
        tensors["encode.pooled_prompt_embeds"] = pp
        tensors["encode.negative_pooled_prompt_embeds"] = npool

        # A prompt longer than both CLIP's 77 and T5's max_sequence_length tokens: both cut.
        lpe, _, lpp, _ = pipe.encode_prompt(
            LONG_PROMPT, None, None, device="cpu", do_classifier_free_guidance=False,
            max_sequence_length=LONG_MAX_SEQUENCE_LENGTH,
        )
        assert len(pipe.tokenizer_3(LONG_PROMPT).input_ids) > LONG_MAX_SEQUENCE_LENGTH
        assert len(pipe.tokenizer(LONG_PROMPT).input_ids) > 77
        tensors["long.prompt_embeds"] = lpe
        tensors["long.pooled_prompt_embeds"] = lpp

        # One transformer call on the CFG batch [negative, prompt] at 8x6 latents (a 4x3 patch
        # grid cropped from the 12x12 position table).
        sample = torch.randn((2, 16, 8, 6), generator=gen(SEED + 10))
        ehs = torch.cat([ne, pe])
        pooled = torch.cat([npool, pp])
        t = torch.tensor([TRANSFORMER_TIMESTEP, TRANSFORMER_TIMESTEP])
        out = pipe.transformer(sample, encoder_hidden_states=ehs, pooled_projections=pooled, timestep=t).sample
        assert out.shape == sample.shape and out.std() > 0.05, out.std()
        tensors["transformer.sample"] = sample
        tensors["transformer.encoder_hidden_states"] = ehs
        tensors["transformer.pooled_projections"] = pooled
        tensors["transformer.out"] = out

        sd35 = SD3Transformer2DModel.from_pretrained(sd35_dir, torch_dtype=torch.float32).eval()
        assert sd35.config.qk_norm == "rms_norm" and sd35.transformer_blocks[0].attn2 is not None
        out35 = sd35(sample, encoder_hidden_states=ehs, pooled_projections=pooled, timestep=t).sample
        assert out35.std() > 0.05
        tensors["transformer_sd35.out"] = out35

        # The pipeline end to end.
        latents = torch.randn((1, 16, s["height"] // 8, s["width"] // 8), generator=gen(SEED + 13))
        tensors["pipe.latents"] = latents
        res_np, steps = run(pipe, latents, "np")
        info["timesteps"] = [float(x) for x in pipe.scheduler.timesteps.tolist()]
        assert [t for t, _ in steps] == info["timesteps"]
        for i, (_, st) in enumerate(steps):
            assert torch.isfinite(st).all()
            tensors[f"pipe.step{i}"] = st
        image = np.asarray(res_np.images, dtype=np.float32)
        assert image.shape == (1, s["height"], s["width"], 3), image.shape
        tensors["pipe.image"] = image
        res_pil, _ = run(pipe, latents, "pil")
        pil = res_pil.images[0]
        assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
        pil.save(os.path.join(GOLDEN, f"{NAME}.png"))

        # The SD3.5-style transformer in the same pipeline: final latents.
        pipe35 = load(folder, transformer=sd35)
        out_lat, _ = run(pipe35, latents, "latent")
        tensors["pipe_sd35.final"] = out_lat.images
        # Skip-layer guidance (block 1 left out on steps 1 and 2 of 3).
        out_slg, _ = run(pipe35, latents, "latent", **SLG)
        tensors["pipe_sd35_slg.final"] = out_slg.images
        assert not torch.allclose(out_slg.images, out_lat.images)
        info["skip_layer_guidance"] = SLG

        # The scheduler with `use_dynamic_shifting` (mu from the 4x3 = 12 image tokens).
        dynamic = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=True)
        pipe_dyn = load(folder, scheduler=dynamic)
        out_dyn, steps_dyn = run(pipe_dyn, latents, "latent")
        info["dynamic_timesteps"] = [t for t, _ in steps_dyn]
        assert info["dynamic_timesteps"] != info["timesteps"]
        tensors["dynamic.final"] = out_dyn.images

        # Without T5 (text_encoder_3=None): zeros in its place, as diffusers does.
        pipe_no_t5 = load(folder, text_encoder_3=None, tokenizer_3=None)
        pe0, ne0, _, _ = pipe_no_t5.encode_prompt(
            s["prompt"], None, None, device="cpu", do_classifier_free_guidance=True,
            negative_prompt=s["negative_prompt"], max_sequence_length=s["max_sequence_length"],
        )
        assert torch.equal(pe0[:, 77:], torch.zeros_like(pe0[:, 77:]))
        tensors["no_t5.prompt_embeds"] = pe0
        no_t5, _ = run(pipe_no_t5, latents, "latent")
        tensors["no_t5.final"] = no_t5.images

    for k, v in tensors.items():
        if torch.is_tensor(v) and v.dtype.is_floating_point:
            tensors[k] = v.to(torch.float32)
    save_canonical(os.path.join(GOLDEN, f"{NAME}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, f"{NAME}.json"), info)


def main():
    os.makedirs(GOLDEN, exist_ok=True)
    for name, target in REUSED.items():
        if not os.path.isdir(os.path.normpath(os.path.join(FIXTURES, NAME, target))):
            sys.exit(f"{target} missing: run make_tiny_sdxl.py and make_tiny_pixart.py first")
    out = os.path.join(FIXTURES, NAME)
    if os.path.exists(out):
        shutil.rmtree(out)
    reused_from = {k: os.path.normpath(os.path.join(out, v)) for k, v in REUSED.items()}
    pipe = StableDiffusion3Pipeline(
        transformer=build_transformer(SEED + 200),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_vae(SEED + 300),
        text_encoder=build_clip_l(SEED + 100),
        tokenizer=CLIPTokenizer.from_pretrained(reused_from["tokenizer"]),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(reused_from["text_encoder_2"]).eval(),
        tokenizer_2=CLIPTokenizer.from_pretrained(reused_from["tokenizer_2"]),
        text_encoder_3=T5EncoderModel.from_pretrained(reused_from["text_encoder_3"], torch_dtype=torch.float32).eval(),
        tokenizer_3=T5TokenizerFast.from_pretrained(reused_from["tokenizer_3"]),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    # CLIP-L in fp16 (its 49408-row embedding is most of its size).
    shutil.rmtree(os.path.join(out, "text_encoder"))
    half = CLIPTextModelWithProjection(pipe.text_encoder.config)
    half.load_state_dict(pipe.text_encoder.state_dict())
    half.to(torch.float16).save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)
    link_reused(out)
    canonicalize_safetensors(out)
    with open(os.path.join(out, "model_index.json")) as f:
        index = json.load(f)
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"], index

    sd35_dir = os.path.join(FIXTURES, "tiny-sd35-transformer")
    if os.path.exists(sd35_dir):
        shutil.rmtree(sd35_dir)
    build_transformer(SEED + 400, num_layers=3, qk_norm="rms_norm", dual_attention_layers=(0,)).save_pretrained(
        sd35_dir, safe_serialization=True
    )
    canonicalize_safetensors(sd35_dir)

    golden(out, pipe, sd35_dir)
    print(f"wrote {out}, {sd35_dir} and golden/{NAME}.*")


if __name__ == "__main__":
    main()
