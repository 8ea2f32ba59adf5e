#!/usr/bin/env python3
"""Build two tiny random-weight Stable Diffusion pipelines and their golden data.

Run by hand (never by tests), from the repository root:

    python3 tools/golden/make_tiny_sd.py [--bpe PATH/TO/bpe_simple_vocab_16e6.txt.gz]

Writes, for NAME in {tiny-sd1, tiny-sd2}:
  tests/fixtures/NAME/                  a real diffusers folder (save_pretrained)
  tests/fixtures/golden/NAME.safetensors reference tensors (canonical header)
  tests/fixtures/golden/NAME.json        settings, tokenizer cases, timesteps, versions
  tests/fixtures/golden/NAME-S.png       final image for each scheduler S

Everything is seeded and every file is written so that reruns give identical
bytes. Nothing is downloaded: the CLIP BPE merges come from open_clip's
`bpe_simple_vocab_16e6.txt.gz` (see README.md for how to get it).
"""
import argparse
import copy
import gzip
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

import diffusers  # noqa: E402
import safetensors  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from diffusers.utils import logging as dlogging  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402

import diffusers.schedulers.scheduling_euler_ancestral_discrete as euler_ancestral_module  # noqa: E402

dlogging.disable_progress_bar()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")

DEFAULT_BPE = [
    "/tmp/oc/open_clip/bpe_simple_vocab_16e6.txt.gz",
]

PIPELINE_SETTINGS = {
    "prompt": "a photo of an astronaut riding a horse",
    "negative_prompt": "blurry",
    "num_inference_steps": 4,
    "guidance_scale": 7.5,
    "height": 64,
    "width": 64,
    "num_images_per_prompt": 1,
}
SCHEDULERS = {
    "pndm": PNDMScheduler,
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_ancestral": EulerAncestralDiscreteScheduler,
}
UNET_TIMESTEP = 981
# UNet and VAE channels. (32, 32, 64, 64) made the fixtures 43 MB (the two text
# encoders alone are 12.6 MB: a real 49408-token vocabulary at hidden size 32),
# so both use half that; the layout (4 blocks, channel change, lpb) is unchanged.
BLOCK_OUT_CHANNELS = (16, 16, 32, 32)
EULER_ANCESTRAL_GENERATOR_SEED = 1234

TOKENIZER_CASES = [
    "a photo of an astronaut riding a horse",
    "A Photo Of An ASTRONAUT, riding a horse!!! (masterpiece:1.2) [sharp] {x}",
    "3 cats and 42 dogs in 1999; pi=3.14, 100% done",
    "don't stop, it's what we'll do; they've I'm you're he'd",
    "café naïve résumé Ünïcödé 😀🚀 東京 straße",
    "   lots   of \t whitespace\n\nand  newlines   ",
    "",
    "!",
    "blurry",
    " ".join(
        "an extremely detailed painting of a castle on a hill at sunset with dramatic clouds,"
        " volumetric light, trending on artstation, by several famous artists".split()
        * 3
    ),
]

# Real scheduler configs (runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-2).
SD1_SCHEDULER = dict(
    _class_name="PNDMScheduler",
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    set_alpha_to_one=False,
    skip_prk_steps=True,
    steps_offset=1,
    trained_betas=None,
    clip_sample=False,
    prediction_type="epsilon",
)
SD2_SCHEDULER = dict(
    _class_name="DDIMScheduler",
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    set_alpha_to_one=False,
    skip_prk_steps=True,
    steps_offset=1,
    trained_betas=None,
    clip_sample=False,
    prediction_type="v_prediction",
)


def gen(seed):
    return torch.Generator("cpu").manual_seed(seed)


# --------------------------------------------------------------------------- tokenizer


def bytes_to_unicode():
    """OpenAI CLIP's byte -> printable unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_vocab_and_merges(bpe_path):
    lines = gzip.open(bpe_path).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408 and len(set(vocab)) == 49408, len(vocab)
    return vocab, merges


def write_tokenizer(folder, vocab, merges, pad_token):
    """Write the slow-tokenizer files that real SD checkpoints ship."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
    specials = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": pad_token,
    }
    save_json(os.path.join(folder, "special_tokens_map.json"), specials)
    config = dict(specials)
    config.update(
        add_prefix_space=False,
        do_lower_case=True,
        errors="replace",
        model_max_length=77,
        tokenizer_class="CLIPTokenizer",
    )
    save_json(os.path.join(folder, "tokenizer_config.json"), config)


# --------------------------------------------------------------------------- models


def perturb(model, seed):
    """Make constant parameters (norm weights = 1, zero biases or zero-initialised
    layers) random, so a loader that skips them, or swaps weight and bias, fails."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if torch.all(p == 1):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif torch.all(p == 0):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build_text_encoder(sd2, seed):
    config = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="gelu" if sd2 else "quick_gelu",
        projection_dim=32,
        layer_norm_eps=1e-5,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=0 if sd2 else 49407,
    )
    torch.manual_seed(seed)
    model = CLIPTextModel(config).eval()
    perturb(model, seed + 1)
    return model


def build_unet(sd2, seed):
    kwargs = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=BLOCK_OUT_CHANNELS,
        cross_attention_dim=32,
        norm_num_groups=8,
    )
    if sd2:
        kwargs.update(layers_per_block=1, attention_head_dim=[2, 4, 8, 8], use_linear_projection=True, upcast_attention=True)
    else:
        kwargs.update(layers_per_block=2, attention_head_dim=8)
    torch.manual_seed(seed)
    model = UNet2DConditionModel(**kwargs).eval()
    perturb(model, seed + 1)
    return model


def build_vae(seed):
    torch.manual_seed(seed)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=BLOCK_OUT_CHANNELS,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=0.18215,
    ).eval()
    perturb(model, seed + 1)
    return model


# --------------------------------------------------------------------------- saving


def canonicalize_safetensors(folder):
    """Rewrite every .safetensors under `folder` with a sorted header (safetensors
    0.8 writes header keys in a random order per process)."""
    for dirpath, _, files in os.walk(folder):
        for fn in sorted(files):
            if not fn.endswith(".safetensors"):
                continue
            path = os.path.join(dirpath, fn)
            with safe_open(path, framework="np") as f:
                meta = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            save_canonical(path, tensors, meta)


def save_pipeline(name, pipe, vocab, merges, pad_token, sd2):
    out = os.path.join(FIXTURES, name)
    if os.path.exists(out):
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    # Text encoder sharded, like large real checkpoints.
    shutil.rmtree(os.path.join(out, "text_encoder"))
    pipe.text_encoder.save_pretrained(os.path.join(out, "text_encoder"), max_shard_size="50KB")
    # Tokenizer: the slow files real SD checkpoints ship (transformers 5 would write tokenizer.json).
    shutil.rmtree(os.path.join(out, "tokenizer"))
    write_tokenizer(os.path.join(out, "tokenizer"), vocab, merges, pad_token)
    if sd2:
        half = copy.deepcopy(pipe.unet).to(torch.float16)
        half.save_pretrained(os.path.join(out, "unet"), variant="fp16", safe_serialization=True)
    canonicalize_safetensors(out)
    return out


# --------------------------------------------------------------------------- golden


def to_py(t):
    t = t.detach().cpu()
    if t.dtype.is_floating_point:
        return [float(x) for x in t.reshape(-1).tolist()]
    return [int(x) for x in t.reshape(-1).tolist()]


def run_pipeline(pipe, latents, scheduler_name, output_type):
    """Run once; return (result, per-step latents, callback timesteps, euler-a noise)."""
    steps, ts, noises = [], [], []

    def on_step_end(_pipe, i, t, kwargs):
        steps.append(kwargs["latents"].detach().clone())
        ts.append(t.detach().clone() if torch.is_tensor(t) else torch.tensor(t))
        return kwargs

    orig = euler_ancestral_module.randn_tensor

    def recording_randn(*args, **kwargs):
        noise = orig(*args, **kwargs)
        noises.append(noise.detach().clone())
        return noise

    euler_ancestral_module.randn_tensor = recording_randn
    try:
        s = PIPELINE_SETTINGS
        result = pipe(
            prompt=s["prompt"],
            negative_prompt=s["negative_prompt"],
            num_inference_steps=s["num_inference_steps"],
            guidance_scale=s["guidance_scale"],
            height=s["height"],
            width=s["width"],
            num_images_per_prompt=s["num_images_per_prompt"],
            latents=latents.clone(),
            generator=gen(EULER_ANCESTRAL_GENERATOR_SEED),
            output_type=output_type,
            callback_on_step_end=on_step_end,
            callback_on_step_end_tensor_inputs=["latents"],
        )
    finally:
        euler_ancestral_module.randn_tensor = orig
    if scheduler_name != "euler_ancestral":
        assert not noises, "unexpected random draws"
    return result, steps, ts, noises


def golden(name, folder, sd2, seed, built):
    """Golden data from the pipeline as reloaded from disk (so it reflects the files)."""
    pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None)
    for part in ("text_encoder", "unet", "vae"):
        a, b = getattr(built, part).state_dict(), getattr(pipe, part).state_dict()
        assert sorted(a) == sorted(b), part
        assert all(torch.equal(a[k], b[k]) for k in a), part
    pipe.set_progress_bar_config(disable=True)
    tok, te, unet, vae = pipe.tokenizer, pipe.text_encoder, pipe.unet, pipe.vae
    tensors = {}
    info = {
        "name": name,
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "pipeline": dict(PIPELINE_SETTINGS),
        "unet_timestep": UNET_TIMESTEP,
        "euler_ancestral_generator_seed": EULER_ANCESTRAL_GENERATOR_SEED,
        "tokenizer_pad_token": tok.pad_token,
        "tokenizer_pad_token_id": tok.pad_token_id,
        "clip_input_ids_rows": ["prompt", "negative_prompt"],
    }

    # Tokenizer
    cases = []
    for text in TOKENIZER_CASES:
        ids = tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
        assert len(ids) == 77
        cases.append({"text": text, "ids": [int(i) for i in ids]})
    info["tokenizer"] = cases

    with torch.no_grad():
        # Text encoder
        s = PIPELINE_SETTINGS
        ids = tok(
            [s["prompt"], s["negative_prompt"]],
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(torch.int64)
        out = te(ids)
        tensors["clip.input_ids"] = ids
        tensors["clip.last_hidden_state"] = out.last_hidden_state
        tensors["clip.pooler_output"] = out.pooler_output
        # The pipeline's own prompt encoding must equal this.
        pe, ne = pipe.encode_prompt(s["prompt"], "cpu", 1, True, s["negative_prompt"])
        assert torch.equal(pe[0], out.last_hidden_state[0]) and torch.equal(ne[0], out.last_hidden_state[1])

        # UNet
        sample = torch.randn((2, 4, 8, 8), generator=gen(seed + 10))
        ehs = out.last_hidden_state
        unet_out = unet(sample, torch.tensor(UNET_TIMESTEP), encoder_hidden_states=ehs).sample
        tensors["unet.sample"] = sample
        tensors["unet.encoder_hidden_states"] = ehs
        tensors["unet.out"] = unet_out
        info["unet_out_std"] = float(unet_out.std())
        assert unet_out.std() > 0.05, f"degenerate UNet output std {unet_out.std()}"

        # VAE
        z = torch.randn((1, 4, 8, 8), generator=gen(seed + 11))
        dec = vae.decode(z).sample
        x = torch.rand((1, 3, 64, 64), generator=gen(seed + 12)) * 2 - 1
        dist = vae.encode(x).latent_dist
        tensors["vae.decode.in"] = z
        tensors["vae.decode.out"] = dec
        tensors["vae.encode.in"] = x
        tensors["vae.encode.mean"] = dist.mean
        tensors["vae.encode.logvar"] = dist.logvar
        info["vae_decode_out_std"] = float(dec.std())
        assert dec.std() > 0.05

        # Pipeline end to end
        latents = torch.randn((1, 4, 8, 8), generator=gen(seed + 13))
        tensors["pipe.latents"] = latents
        base_config = dict(pipe.scheduler.config)
        info["timesteps"], info["callback_timesteps"], info["sigmas"] = {}, {}, {}
        info["init_noise_sigma"], info["scheduler_configs"] = {}, {}
        for sname, cls in SCHEDULERS.items():
            pipe.scheduler = cls.from_config(base_config)
            info["scheduler_configs"][sname] = json.loads(pipe.scheduler.to_json_string())
            res, steps, ts, noises = run_pipeline(pipe, latents, sname, "np")
            sched = pipe.scheduler
            info["timesteps"][sname] = (
                [int(t) for t in sched.timesteps.tolist()]
                if not sched.timesteps.dtype.is_floating_point
                else [float(t) for t in sched.timesteps.tolist()]
            )
            info["callback_timesteps"][sname] = [to_py(t)[0] for t in ts]
            if hasattr(sched, "sigmas"):
                info["sigmas"][sname] = to_py(sched.sigmas)
            ins = sched.init_noise_sigma
            info["init_noise_sigma"][sname] = float(ins)
            assert len(steps) == len(sched.timesteps)
            for i, st in enumerate(steps):
                assert torch.isfinite(st).all()
                tensors[f"pipe.{sname}.step{i}"] = st
            for i, n in enumerate(noises):
                tensors[f"pipe.{sname}.noise{i}"] = n
            image = np.asarray(res.images, dtype=np.float32)
            assert image.shape == (1, 64, 64, 3) and image.min() >= 0 and image.max() <= 1
            tensors[f"pipe.{sname}.image"] = image
            info.setdefault("image_stats", {})[sname] = {
                "mean": float(image.mean()),
                "std": float(image.std()),
                "clipped_fraction": float(((image == 0) | (image == 1)).mean()),
            }

            # The PNG diffusers produces from the same latents and the same noise.
            res_pil, steps_pil, _, noises_pil = run_pipeline(pipe, latents, sname, "pil")
            assert all(torch.equal(a, b) for a, b in zip(steps, steps_pil))
            assert all(torch.equal(a, b) for a, b in zip(noises, noises_pil))
            pil = res_pil.images[0]
            assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
            pil.save(os.path.join(GOLDEN, f"{name}-{sname}.png"))

    for k, v in tensors.items():
        if hasattr(v, "dtype") and torch.is_tensor(v) and v.dtype.is_floating_point:
            tensors[k] = v.to(torch.float32)
        assert np.isfinite(np.asarray(tensors[k].detach() if torch.is_tensor(tensors[k]) else tensors[k])).all(), k
    save_canonical(os.path.join(GOLDEN, f"{name}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, f"{name}.json"), info)
    return pipe


def check_saved(folder, sd2, reference, built):
    """Reload pieces the way a user would and make sure they are what we built."""
    tok = CLIPTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
    assert tok.model_max_length == 77
    for text in TOKENIZER_CASES:
        a = tok(text, padding="max_length", max_length=77, truncation=True).input_ids
        b = reference(text, padding="max_length", max_length=77, truncation=True).input_ids
        assert a == b, (text, a, b)
    if sd2:
        path = os.path.join(folder, "unet", "diffusion_pytorch_model.fp16.safetensors")
        with safe_open(path, framework="pt") as f:
            assert all(f.get_slice(k).get_dtype() == "F16" for k in f.keys())
        half = UNet2DConditionModel.from_pretrained(
            os.path.join(folder, "unet"), variant="fp16", torch_dtype=torch.float16
        )
        assert all(p.dtype == torch.float16 for p in half.parameters())
        ref = built.unet.state_dict()
        assert all(torch.equal(v, ref[k].half()) for k, v in half.state_dict().items())
    te_dir = os.path.join(folder, "text_encoder")
    assert os.path.exists(os.path.join(te_dir, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(te_dir) if f.endswith(".safetensors")]) >= 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bpe", help="path to open_clip's bpe_simple_vocab_16e6.txt.gz")
    args = ap.parse_args()
    candidates = [args.bpe] if args.bpe else list(DEFAULT_BPE)
    try:
        import open_clip  # noqa: F401

        candidates.append(os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz"))
    except ImportError:
        pass
    bpe = next((c for c in candidates if c and os.path.exists(c)), None)
    if bpe is None:
        sys.exit(
            "bpe_simple_vocab_16e6.txt.gz not found. Get it with:\n"
            "  pip download --no-deps open-clip-torch -d /tmp/oc && "
            "(cd /tmp/oc && unzip -o open_clip_torch-*.whl open_clip/bpe_simple_vocab_16e6.txt.gz)\n"
            "or pass --bpe PATH"
        )
    vocab, merges = clip_vocab_and_merges(bpe)
    os.makedirs(GOLDEN, exist_ok=True)
    tmp_tok = os.path.join(GOLDEN, ".tmp-tokenizer")

    for name, sd2, seed in (("tiny-sd1", False, 1000), ("tiny-sd2", True, 2000)):
        pad = "!" if sd2 else "<|endoftext|>"
        if os.path.exists(tmp_tok):
            shutil.rmtree(tmp_tok)
        write_tokenizer(tmp_tok, vocab, merges, pad)
        tokenizer = CLIPTokenizer.from_pretrained(tmp_tok)
        shutil.rmtree(tmp_tok)
        assert tokenizer.pad_token == pad and tokenizer.model_max_length == 77
        assert tokenizer("a photo of an astronaut riding a horse").input_ids == [
            49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 49407,
        ]

        sched_cfg = dict(SD2_SCHEDULER if sd2 else SD1_SCHEDULER)
        scheduler_cls = DDIMScheduler if sd2 else PNDMScheduler
        pipe = StableDiffusionPipeline(
            vae=build_vae(seed + 300),
            text_encoder=build_text_encoder(sd2, seed + 100),
            tokenizer=tokenizer,
            unet=build_unet(sd2, seed + 200),
            scheduler=scheduler_cls.from_config(sched_cfg),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        folder = save_pipeline(name, pipe, vocab, merges, pad, sd2)
        check_saved(folder, sd2, tokenizer, pipe)
        golden(name, folder, sd2, seed, pipe)
        print(f"wrote {folder} and golden/{name}.*")


if __name__ == "__main__":
    main()
