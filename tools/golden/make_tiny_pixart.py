#!/usr/bin/env python3
"""Build a tiny random-weight PixArt-Alpha pipeline and its golden data.

Run by hand (never by tests), from the repository root:

    python3 tools/golden/make_tiny_pixart.py [--t5-tokenizer PATH/TO/tokenizer.json]

Writes:
  tests/fixtures/tiny-pixart-alpha/                a real diffusers folder (save_pretrained)
  tests/fixtures/tiny-pixart-transformer-1024/     a lone transformer with sample_size 128
                                                   (micro-conditions, interpolation scale 2)
  tests/fixtures/golden/tiny-pixart-alpha.safetensors  reference tensors (canonical header)
  tests/fixtures/golden/tiny-pixart-alpha.json     settings, tokenizer cases, timesteps, versions
  tests/fixtures/golden/tiny-pixart-alpha.png      the final image of the pipeline run
  tests/fixtures/golden/tiny-pixart-sigma.*        the same components as a PixArtSigmaPipeline
                                                   (its default 300 tokens), run at 256x256
  tests/fixtures/golden/tiny-pixart-alpha-1024.*   the Alpha folder with the 1024 transformer:
                                                   1024 bins and micro-conditions, 2 steps

The T5 tokenizer is a real one (t5-v1_1's 32100-piece unigram vocabulary) taken from the
stable-diffusion-cpp-python sdist on PyPI (see README.md). Everything is seeded and every file
is written so that reruns give identical bytes.
"""
import argparse
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
from make_tiny_sd import build_vae, gen, perturb  # noqa: E402

import diffusers  # noqa: E402
import safetensors  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    DPMSolverMultistepScheduler,
    PixArtAlphaPipeline,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
)
from diffusers.utils import logging as dlogging  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import T5Config, T5EncoderModel, T5TokenizerFast  # noqa: E402

dlogging.disable_progress_bar()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")
NAME = "tiny-pixart-alpha"
SEED = 3000
DEFAULT_TOKENIZER = "/tmp/dit-t5/t5_tokenizer.json"

# The run: binning maps 200x128 to the 256-bin's 304x208 (latents 38x26); the decoded image is
# resized and centre-cropped back to 200x128.
PIPELINE_SETTINGS = {
    "prompt": "A Photo of an Astronaut riding a horse  ",
    "negative_prompt": "",
    "num_inference_steps": 4,
    "guidance_scale": 4.5,
    "height": 200,
    "width": 128,
    "max_sequence_length": 120,
    "use_resolution_binning": True,
    "clean_caption": False,
}
TRANSFORMER_TIMESTEP = 981

TOKENIZER_CASES = [
    "a photo of an astronaut riding a horse",
    "A Photo Of An ASTRONAUT, riding a horse!!! (masterpiece:1.2) [sharp] {x}",
    "3 cats and 42 dogs in 1999; pi=3.14, 100% done",
    "café naïve résumé Ünïcödé 😀🚀 東京 straße",
    "   lots   of \t whitespace\n\nand  newlines   ",
    "",
    "<extra_id_0> and </s> inside",
    " ".join(
        "an extremely detailed painting of a castle on a hill at sunset with dramatic clouds,"
        " volumetric light, trending on artstation, by several famous artists".split()
        * 6
    ),
]

# PixArt-alpha/PixArt-XL-2-1024-MS's scheduler_config.json.
SCHEDULER = dict(
    _class_name="DPMSolverMultistepScheduler",
    algorithm_type="dpmsolver++",
    beta_end=0.02,
    beta_schedule="linear",
    beta_start=0.0001,
    dynamic_thresholding_ratio=0.995,
    euler_at_final=False,
    lambda_min_clipped=float("-inf"),
    lower_order_final=True,
    num_train_timesteps=1000,
    prediction_type="epsilon",
    sample_max_value=1.0,
    solver_order=2,
    solver_type="midpoint",
    steps_offset=0,
    thresholding=False,
    timestep_spacing="linspace",
    trained_betas=None,
    use_karras_sigmas=False,
    variance_type=None,
)


def build_text_encoder(seed):
    config = T5Config(
        vocab_size=32128,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        dropout_rate=0.0,
        is_encoder_decoder=False,
        use_cache=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = T5EncoderModel(config).eval()
    perturb(model, seed + 1)
    # The weights are stored as bf16 (as big checkpoints are): round them now, so the f32 model
    # that makes the golden data holds exactly the stored values.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def build_transformer(seed, sample_size, heads=4):
    """Width heads * 8; the micro-conditions need a width divisible by 3 (3 heads)."""
    torch.manual_seed(seed)
    model = PixArtTransformer2DModel(
        num_attention_heads=heads,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=heads * 8,
        attention_bias=True,
        sample_size=sample_size,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=32,
    ).eval()
    perturb(model, seed + 1)
    return model


def canonicalize_safetensors(folder):
    """Rewrite every .safetensors under `folder` with a sorted header (keeps bf16)."""
    for dirpath, _, files in os.walk(folder):
        for fn in sorted(files):
            if not fn.endswith(".safetensors"):
                continue
            path = os.path.join(dirpath, fn)
            with safe_open(path, framework="pt") as f:
                meta = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            save_canonical(path, tensors, meta)


def save_tokenizer(tokenizer_json, folder):
    tok = T5TokenizerFast(tokenizer_file=tokenizer_json, extra_ids=100)
    tok.model_max_length = 512
    tok.save_pretrained(folder)
    return T5TokenizerFast.from_pretrained(folder)


def run_pipeline(pipe, latents, output_type):
    steps = []

    def on_step(i, t, lat):
        steps.append((int(t), lat.detach().clone()))

    s = PIPELINE_SETTINGS
    result = pipe(
        prompt=s["prompt"],
        negative_prompt=s["negative_prompt"],
        num_inference_steps=s["num_inference_steps"],
        guidance_scale=s["guidance_scale"],
        height=s["height"],
        width=s["width"],
        latents=latents.clone(),
        output_type=output_type,
        clean_caption=s["clean_caption"],
        use_resolution_binning=s["use_resolution_binning"],
        max_sequence_length=s["max_sequence_length"],
        callback=on_step,
        callback_steps=1,
    )
    return result, steps


def golden(folder, built, transformer_1024_dir):
    pipe = PixArtAlphaPipeline.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    for part in ("text_encoder", "transformer", "vae"):
        a, b = getattr(built, part).state_dict(), getattr(pipe, part).state_dict()
        assert sorted(a) == sorted(b), (part, set(a) ^ set(b))
        assert all(torch.equal(a[k], b[k]) for k in a), part
    pipe.set_progress_bar_config(disable=True)
    tok, te, tr = pipe.tokenizer, pipe.text_encoder, pipe.transformer
    s = PIPELINE_SETTINGS
    L = s["max_sequence_length"]
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
        "pipeline": dict(PIPELINE_SETTINGS),
        "transformer_timestep": TRANSFORMER_TIMESTEP,
    }

    cases = []
    for text in TOKENIZER_CASES:
        enc = tok(text, padding="max_length", max_length=L, truncation=True, add_special_tokens=True)
        full = tok(text, add_special_tokens=True).input_ids
        cases.append(
            {
                "text": text,
                "ids": [int(i) for i in enc.input_ids],
                "attention_mask": [int(i) for i in enc.attention_mask],
                "untruncated_len": len(full),
            }
        )
    info["tokenizer"] = cases

    with torch.no_grad():
        # T5 as the pipeline calls it: [prompt, negative] after lower().strip(), with the mask.
        texts = [s["prompt"].lower().strip(), s["negative_prompt"].lower().strip()]
        enc = tok(texts, padding="max_length", max_length=L, truncation=True, add_special_tokens=True, return_tensors="pt")
        ids, mask = enc.input_ids.to(torch.int64), enc.attention_mask.to(torch.int64)
        emb = te(ids, attention_mask=mask)[0]
        tensors["t5.input_ids"] = ids
        tensors["t5.attention_mask"] = mask
        tensors["t5.last_hidden_state"] = emb
        pe, pm, ne, nm = pipe.encode_prompt(
            s["prompt"], True, negative_prompt=s["negative_prompt"], device="cpu",
            clean_caption=False, max_sequence_length=L,
        )
        assert torch.equal(pe[0], emb[0]) and torch.equal(ne[0], emb[1])
        assert torch.equal(pm[0], mask[0]) and torch.equal(nm[0], mask[1])
        # T5 without a mask (all ones), as other callers use it.
        tensors["t5.unmasked.last_hidden_state"] = te(ids)[0]

        # One transformer call, CFG batch order [negative, prompt], at a non-native latent size
        # (the sincos position embedding is recomputed for 4x6 patches).
        sample = torch.randn((2, 4, 8, 12), generator=gen(SEED + 10))
        ehs = torch.stack([emb[1], emb[0]])
        emask = torch.stack([mask[1], mask[0]])
        t = torch.tensor([TRANSFORMER_TIMESTEP, TRANSFORMER_TIMESTEP])
        out = tr(sample, encoder_hidden_states=ehs, encoder_attention_mask=emask, timestep=t).sample
        tensors["transformer.sample"] = sample
        tensors["transformer.encoder_hidden_states"] = ehs
        tensors["transformer.encoder_attention_mask"] = emask
        tensors["transformer.out"] = out
        assert out.shape == (2, 8, 8, 12) and out.std() > 0.05, out.std()
        info["transformer_out_std"] = float(out.std())

        # The sample_size 128 transformer: micro-conditions (resolution, aspect ratio) and
        # interpolation scale 2, at its native 64x64 patch grid would be big; 8x8 latents.
        tr2 = PixArtTransformer2DModel.from_pretrained(transformer_1024_dir, torch_dtype=torch.float32).eval()
        assert tr2.use_additional_conditions
        sample2 = torch.randn((2, 4, 8, 8), generator=gen(SEED + 11))
        res = torch.tensor([[1024.0, 768.0], [1024.0, 768.0]])
        ar = torch.tensor([[1024.0 / 768.0], [1024.0 / 768.0]])
        out2 = tr2(
            sample2, encoder_hidden_states=ehs, encoder_attention_mask=emask, timestep=t,
            added_cond_kwargs={"resolution": res, "aspect_ratio": ar},
        ).sample
        tensors["transformer_1024.sample"] = sample2
        tensors["transformer_1024.resolution"] = res
        tensors["transformer_1024.aspect_ratio"] = ar
        tensors["transformer_1024.out"] = out2
        assert out2.std() > 0.05

        # The pipeline end to end, with binning (200x128 -> 304x208 -> 200x128).
        from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_256_BIN

        bh, bw = pipe.image_processor.classify_height_width_bin(s["height"], s["width"], ASPECT_RATIO_256_BIN)
        info["binned_height"], info["binned_width"] = bh, bw
        latents = torch.randn((1, 4, bh // 8, bw // 8), generator=gen(SEED + 13))
        tensors["pipe.latents"] = latents
        res_np, steps = run_pipeline(pipe, latents, "np")
        info["timesteps"] = [int(x) for x in pipe.scheduler.timesteps.tolist()]
        assert [t for t, _ in steps] == info["timesteps"]
        for i, (_, st) in enumerate(steps):
            assert torch.isfinite(st).all()
            tensors[f"pipe.step{i}"] = st
        image = np.asarray(res_np.images, dtype=np.float32)
        assert image.shape == (1, s["height"], s["width"], 3), image.shape
        tensors["pipe.image"] = image
        info["image_stats"] = {"mean": float(image.mean()), "std": float(image.std())}
        res_pil, steps_pil = run_pipeline(pipe, latents, "pil")
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(steps, steps_pil))
        pil = res_pil.images[0]
        assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
        pil.save(os.path.join(GOLDEN, f"{NAME}.png"))

    for k, v in tensors.items():
        if torch.is_tensor(v) and v.dtype.is_floating_point:
            tensors[k] = v.to(torch.float32)
    save_canonical(os.path.join(GOLDEN, f"{NAME}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, f"{NAME}.json"), info)


SIGMA_SETTINGS = {
    "prompt": "a small cabin in a snowy forest at night",
    "negative_prompt": "low quality",
    "num_inference_steps": 3,
    "guidance_scale": 4.5,
    "height": 256,
    "width": 256,
}


def golden_sigma(alpha_folder):
    """The Alpha components under model_index `PixArtSigmaPipeline` (what the test assembles)."""
    import json

    name = "tiny-pixart-sigma"
    tmp = os.path.join(GOLDEN, ".tmp-sigma")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    shutil.copytree(alpha_folder, tmp)
    index_path = os.path.join(tmp, "model_index.json")
    index = json.load(open(index_path))
    index["_class_name"] = "PixArtSigmaPipeline"
    with open(index_path, "w") as f:
        json.dump(index, f)
    pipe = PixArtSigmaPipeline.from_pretrained(tmp, local_files_only=True, torch_dtype=torch.float32)
    shutil.rmtree(tmp)
    pipe.set_progress_bar_config(disable=True)
    s = SIGMA_SETTINGS
    latents = torch.randn((1, 4, s["height"] // 8, s["width"] // 8), generator=gen(SEED + 20))
    tensors = {"pipe.latents": latents}
    info = {"name": name, "pipeline": dict(s), "max_sequence_length": 300}

    def run(output_type):
        steps = []
        res = pipe(
            prompt=s["prompt"], negative_prompt=s["negative_prompt"],
            num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
            height=s["height"], width=s["width"], latents=latents.clone(), output_type=output_type,
            clean_caption=False, callback=lambda i, t, lat: steps.append((int(t), lat.detach().clone())),
            callback_steps=1,
        )
        return res, steps

    with torch.no_grad():
        pe, pm, _, _ = pipe.encode_prompt(s["prompt"], True, device="cpu", clean_caption=False)
        assert pe.shape[1] == 300 and pm.shape[1] == 300
        res_np, steps = run("np")
        info["timesteps"] = [t for t, _ in steps]
        for i, (_, st) in enumerate(steps):
            tensors[f"pipe.step{i}"] = st
        image = np.asarray(res_np.images, dtype=np.float32)
        tensors["pipe.image"] = image
        res_pil, _ = run("pil")
        pil = res_pil.images[0]
        assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
        pil.save(os.path.join(GOLDEN, f"{name}.png"))
    save_canonical(os.path.join(GOLDEN, f"{name}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, f"{name}.json"), info)


def golden_alpha_1024(alpha_folder, transformer_1024_dir):
    """The Alpha folder with the sample_size 128 transformer: the 1024 bins and the
    micro-conditions the pipeline passes; two steps (diffusers fails on one with DPM-Solver),
    the final latents only (no 1152x896 VAE decode; each latent tensor is 258 KB)."""
    name = "tiny-pixart-alpha-1024"
    tmp = os.path.join(GOLDEN, ".tmp-alpha-1024")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    shutil.copytree(alpha_folder, tmp)
    shutil.rmtree(os.path.join(tmp, "transformer"))
    shutil.copytree(transformer_1024_dir, os.path.join(tmp, "transformer"))
    pipe = PixArtAlphaPipeline.from_pretrained(tmp, local_files_only=True, torch_dtype=torch.float32)
    shutil.rmtree(tmp)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.sample_size == 128
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_1024_BIN

    s = {"prompt": "a lighthouse", "height": 1000, "width": 760, "num_inference_steps": 2, "guidance_scale": 4.5}
    bh, bw = pipe.image_processor.classify_height_width_bin(s["height"], s["width"], ASPECT_RATIO_1024_BIN)
    latents = torch.randn((1, 4, bh // 8, bw // 8), generator=gen(SEED + 30))
    steps = []
    with torch.no_grad():
        out = pipe(
            prompt=s["prompt"], num_inference_steps=s["num_inference_steps"],
            guidance_scale=s["guidance_scale"], height=s["height"], width=s["width"],
            latents=latents.clone(), output_type="latent", clean_caption=False,
            callback=lambda i, t, lat: steps.append((int(t), lat.detach().clone())), callback_steps=1,
        ).images
    assert torch.equal(out, steps[-1][1])
    tensors = {"pipe.latents": latents, "pipe.final": steps[-1][1]}
    info = {
        "name": name, "pipeline": s, "binned_height": bh, "binned_width": bw,
        "timesteps": [t for t, _ in steps], "keys": sorted(tensors),
    }
    save_canonical(os.path.join(GOLDEN, f"{name}.safetensors"), tensors)
    save_json(os.path.join(GOLDEN, f"{name}.json"), info)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t5-tokenizer", default=DEFAULT_TOKENIZER, help="a T5 tokenizer.json")
    args = ap.parse_args()
    if not os.path.exists(args.t5_tokenizer):
        sys.exit(f"{args.t5_tokenizer} not found: see tools/golden/README.md for how to get it")
    os.makedirs(GOLDEN, exist_ok=True)
    out = os.path.join(FIXTURES, NAME)
    if os.path.exists(out):
        shutil.rmtree(out)
    tmp_tok = os.path.join(GOLDEN, ".tmp-t5-tokenizer")
    if os.path.exists(tmp_tok):
        shutil.rmtree(tmp_tok)
    tokenizer = save_tokenizer(args.t5_tokenizer, tmp_tok)
    shutil.rmtree(tmp_tok)
    assert tokenizer("a photo of an astronaut riding a horse").input_ids == [
        3, 9, 1202, 13, 46, 30059, 7494, 3, 9, 4952, 1,
    ]

    pipe = PixArtAlphaPipeline(
        tokenizer=tokenizer,
        text_encoder=build_text_encoder(SEED + 100),
        vae=build_vae(SEED + 300),
        transformer=build_transformer(SEED + 200, 32),
        scheduler=DPMSolverMultistepScheduler.from_config(SCHEDULER),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    # The text encoder in bf16, as large checkpoints ship it.
    shutil.rmtree(os.path.join(out, "text_encoder"))
    half = T5EncoderModel(pipe.text_encoder.config)
    half.load_state_dict(pipe.text_encoder.state_dict())
    half.to(torch.bfloat16).save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)
    canonicalize_safetensors(out)
    with safe_open(os.path.join(out, "text_encoder", "model.safetensors"), framework="pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())

    tr_dir = os.path.join(FIXTURES, "tiny-pixart-transformer-1024")
    if os.path.exists(tr_dir):
        shutil.rmtree(tr_dir)
    build_transformer(SEED + 400, 128, heads=3).save_pretrained(tr_dir, safe_serialization=True)
    canonicalize_safetensors(tr_dir)

    golden(out, pipe, tr_dir)
    golden_sigma(out)
    golden_alpha_1024(out, tr_dir)
    print(f"wrote {out}, {tr_dir} and golden/{NAME}.*")


if __name__ == "__main__":
    main()
