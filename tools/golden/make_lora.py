"""Tiny random LoRAs for tests/fixtures/tiny-sd1, in diffusers/PEFT and kohya format, and what
diffusers makes with them fused.

Run by hand (never by tests), from the repository root, after make_tiny_sd.py:

    pip install peft      # diffusers needs it to load LoRAs
    python3 tools/golden/make_lora.py

Writes:
  tests/fixtures/lora/tiny-sd1-peft.safetensors   LoRA A, diffusers/PEFT keys + adapter metadata
  tests/fixtures/lora/tiny-sd1-kohya.safetensors  the same weights, kohya (A1111) keys + .alpha
  tests/fixtures/lora/tiny-sd1-kohya-b.safetensors LoRA B (UNet only, kohya, no alphas)
  tests/fixtures/golden/tiny-sd1-lora.safetensors reference tensors (canonical header)
  tests/fixtures/golden/tiny-sd1-lora.json        settings and versions
  tests/fixtures/golden/tiny-sd1-lora-FORMAT.png  the pipeline's image with LoRA A fused
  tests/fixtures/lora/tiny-sdxl-peft.safetensors  an SDXL LoRA (UNet, both text encoders), PEFT keys
  tests/fixtures/lora/tiny-sdxl-kohya-sgm.safetensors  the same, kohya keys with the original
                                                  (SGM) UNet block names, lora_te1_/lora_te2_
  tests/fixtures/golden/tiny-sdxl-lora.safetensors reference tensors for both

Everything is seeded; files are byte-identical on reruns.
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save_canonical, save_json  # noqa: E402

import diffusers  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline  # noqa: E402
from diffusers.utils import logging as dlogging  # noqa: E402
from safetensors import safe_open  # noqa: E402

dlogging.disable_progress_bar()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")
LORA = os.path.join(FIXTURES, "lora")
MODEL = os.path.join(FIXTURES, "tiny-sd1")
XL_MODEL = os.path.join(FIXTURES, "tiny-sdxl")
XL_UNET_SUFFIXES = UNET_SUFFIXES_A_XL = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "conv1", "conv2", "time_emb_proj",
    "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "conv_in", "conv_out",
    "time_embedding.linear_1", "add_embedding.linear_2",
)

RANK_A, ALPHA_A = 4, 8.0  # LoRA A: scaling alpha / rank = 2
RANK_B = 2  # LoRA B: no alphas (scaling 1)
SCALE_A, SCALE_B = 0.75, 0.5
PIPE_STEPS = 2
UNET_SUFFIXES_A = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "conv1", "time_emb_proj",
)
UNET_SUFFIXES_B = ("attn2.to_k", "attn2.to_v", "conv2")
TE_SUFFIXES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def gen(seed):
    return torch.Generator("cpu").manual_seed(seed)


def targets(model, suffixes):
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name.endswith(suffixes)
    ]


def random_lora(modules, rank, seed):
    """name -> (down [r, in, k, k] or [r, in], up [out, r, 1, 1] or [out, r])."""
    g = gen(seed)
    out = {}
    for name, m in modules:
        w = m.weight
        fan_in = int(np.prod(w.shape[1:]))
        down_shape = (rank,) + tuple(w.shape[1:])
        up_shape = (w.shape[0], rank) + ((1, 1) if w.ndim == 4 else ())
        down = torch.randn(down_shape, generator=g) / fan_in**0.5
        up = torch.randn(up_shape, generator=g) * 0.2
        out[name] = (down, up)
    return out


def delta(down, up, shape):
    return (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(shape)


def kohya_name(prefix, name):
    return prefix + name.replace(".", "_")


def to_sgm(name, layers_per_block, up_has_attentions):
    """The original (SGM/LDM) UNet module name kohya's SDXL LoRAs use for a diffusers name."""
    per = layers_per_block + 1
    fixed = {
        "conv_in": "input_blocks.0.0", "conv_out": "out.2",
        "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
    }
    if name in fixed:
        return fixed[name]
    res = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
           "conv_shortcut": "skip_connection"}
    p = name.split(".")
    if p[0] == "down_blocks":
        b = int(p[1])
        if p[2] == "downsamplers":
            return f"input_blocks.{(b + 1) * per}.0.op"
        i = 1 + b * per + int(p[3])
        if p[2] == "resnets":
            return f"input_blocks.{i}.0." + res[".".join(p[4:])]
        return f"input_blocks.{i}.1." + ".".join(p[4:])
    if p[0] == "mid_block":
        if p[1] == "resnets":
            return f"middle_block.{0 if p[2] == '0' else 2}." + res[".".join(p[3:])]
        return "middle_block.1." + ".".join(p[3:])
    if p[0] == "up_blocks":
        b = int(p[1])
        if p[2] == "upsamplers":
            return f"output_blocks.{b * per + layers_per_block}.{2 if up_has_attentions[b] else 1}.conv"
        i = b * per + int(p[3])
        if p[2] == "resnets":
            return f"output_blocks.{i}.0." + res[".".join(p[4:])]
        return f"output_blocks.{i}.1." + ".".join(p[4:])
    raise ValueError(name)


def make_sdxl():
    """An SDXL LoRA in PEFT and kohya-SGM format, and diffusers' outputs with it fused."""
    base = StableDiffusionXLPipeline.from_pretrained(XL_MODEL, local_files_only=True)
    base.set_progress_bar_config(disable=True)
    unet = random_lora(targets(base.unet, XL_UNET_SUFFIXES), RANK_A, 200)
    te1 = random_lora(targets(base.text_encoder, TE_SUFFIXES), RANK_A, 201)
    te2 = random_lora(targets(base.text_encoder_2, TE_SUFFIXES), RANK_A, 202)
    lpb = base.unet.config.layers_per_block
    up_attn = [hasattr(b, "attentions") for b in base.unet.up_blocks]

    def te_name(name):
        # Files name the `text_model.` level (transformers 5 keeps it only in
        # CLIPTextModelWithProjection); text_projection sits beside it.
        name = name.removeprefix("text_model.")
        return name if name == "text_projection" else "text_model." + name

    peft_tensors, meta = {}, {}
    for comp, lora, named in (("unet", unet, lambda n: n), ("text_encoder", te1, te_name),
                              ("text_encoder_2", te2, te_name)):
        for name, (down, up) in lora.items():
            peft_tensors[f"{comp}.{named(name)}.lora_A.weight"] = down
            peft_tensors[f"{comp}.{named(name)}.lora_B.weight"] = up
        meta[f"{comp}.r"] = RANK_A
        meta[f"{comp}.lora_alpha"] = ALPHA_A
        meta[f"{comp}.target_modules"] = sorted(lora)
    peft_path = os.path.join(LORA, "tiny-sdxl-peft.safetensors")
    save_canonical(peft_path, peft_tensors,
                   {"format": "pt", "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True)})
    kohya = {}
    for prefix, lora, named in (("lora_unet_", unet, lambda n: to_sgm(n, lpb, up_attn)),
                                ("lora_te1_", te1, te_name), ("lora_te2_", te2, te_name)):
        for name, (down, up) in lora.items():
            k = kohya_name(prefix, named(name))
            kohya[k + ".lora_down.weight"] = down
            kohya[k + ".lora_up.weight"] = up
            kohya[k + ".alpha"] = torch.tensor(ALPHA_A)
    kohya_path = os.path.join(LORA, "tiny-sdxl-kohya-sgm.safetensors")
    save_canonical(kohya_path, kohya)

    g = {}
    with safe_open(os.path.join(GOLDEN, "tiny-sdxl.safetensors"), framework="pt") as f:
        for k in ("unet.sample", "unet.encoder_hidden_states", "unet.text_embeds", "unet.time_ids"):
            g[k] = f.get_tensor(k)
    xl_info = json.load(open(os.path.join(GOLDEN, "tiny-sdxl.json")))
    tensors = dict(g)
    factor = SCALE_A * ALPHA_A / RANK_A
    for tag, path in (("peft", peft_path), ("kohya", kohya_path)):
        pipe = StableDiffusionXLPipeline.from_pretrained(XL_MODEL, local_files_only=True)
        pipe.load_lora_weights(path)
        pipe.fuse_lora(lora_scale=SCALE_A)
        for model, ref, lora in ((pipe.unet, base.unet, unet), (pipe.text_encoder, base.text_encoder, te1),
                                 (pipe.text_encoder_2, base.text_encoder_2, te2)):
            ref_mods = dict(ref.named_modules())
            for name, m in model.named_modules():
                # peft wraps each LoRA'd layer: its fused weight is the wrapper's `base_layer`
                name = name.removesuffix(".base_layer")
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name in ref_mods:
                    want = ref_mods[name].weight.detach().clone()
                    if name in lora:
                        want += factor * delta(*lora[name], want.shape)
                    assert torch.allclose(m.weight.detach(), want, rtol=0, atol=1e-6), (tag, name)
        with torch.no_grad():
            s = xl_info["pipeline"]
            pe, ne, pp, npool = pipe.encode_prompt(s["prompt"], device="cpu", negative_prompt=s["negative_prompt"])
            tensors[f"{tag}.encode.prompt_embeds"] = pe
            tensors[f"{tag}.encode.pooled_prompt_embeds"] = pp
            out = pipe.unet(
                g["unet.sample"], torch.tensor(xl_info["unet_timestep"]),
                encoder_hidden_states=g["unet.encoder_hidden_states"],
                added_cond_kwargs={"text_embeds": g["unet.text_embeds"], "time_ids": g["unet.time_ids"]},
            ).sample
            tensors[f"{tag}.unet.out"] = out
    for k, v in tensors.items():
        tensors[k] = v.to(torch.float32).contiguous()
    save_canonical(os.path.join(GOLDEN, "tiny-sdxl-lora.safetensors"), tensors)
    info = {
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__},
        "rank": RANK_A, "alpha": ALPHA_A, "scale": SCALE_A,
        "unet_timestep": xl_info["unet_timestep"], "pipeline": xl_info["pipeline"],
        "unet_modules": len(unet), "text_encoder_modules": len(te1), "text_encoder_2_modules": len(te2),
        "keys": sorted(tensors),
    }
    save_json(os.path.join(GOLDEN, "tiny-sdxl-lora.json"), info)


def main():
    os.makedirs(LORA, exist_ok=True)
    base = StableDiffusionPipeline.from_pretrained(MODEL, local_files_only=True, safety_checker=None)
    unet_a = random_lora(targets(base.unet, UNET_SUFFIXES_A), RANK_A, 100)
    te_a = random_lora(targets(base.text_encoder, TE_SUFFIXES), RANK_A, 101)
    unet_b = random_lora(targets(base.unet, UNET_SUFFIXES_B), RANK_B, 102)
    # transformers 5's CLIPTextModel has no `text_model.` level; real LoRA files (written with
    # transformers 4 and kohya's scripts) name it, so both files do.
    te_prefix = "" if hasattr(base.text_encoder, "text_model") else "text_model."

    peft_tensors, meta = {}, {}
    for comp, lora, pre in (("unet", unet_a, ""), ("text_encoder", te_a, te_prefix)):
        for name, (down, up) in lora.items():
            peft_tensors[f"{comp}.{pre}{name}.lora_A.weight"] = down
            peft_tensors[f"{comp}.{pre}{name}.lora_B.weight"] = up
        meta[f"{comp}.r"] = RANK_A
        meta[f"{comp}.lora_alpha"] = ALPHA_A
        meta[f"{comp}.target_modules"] = sorted(lora)
    peft_path = os.path.join(LORA, "tiny-sd1-peft.safetensors")
    save_canonical(
        peft_path,
        peft_tensors,
        {"format": "pt", "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True)},
    )

    kohya_tensors = {}
    for prefix, lora in (("lora_unet_", unet_a), ("lora_te_" + te_prefix.replace(".", "_"), te_a)):
        for name, (down, up) in lora.items():
            k = kohya_name(prefix, name)
            kohya_tensors[k + ".lora_down.weight"] = down
            kohya_tensors[k + ".lora_up.weight"] = up
            kohya_tensors[k + ".alpha"] = torch.tensor(ALPHA_A)
    kohya_path = os.path.join(LORA, "tiny-sd1-kohya.safetensors")
    save_canonical(kohya_path, kohya_tensors, {"ss_network_dim": str(RANK_A), "ss_network_alpha": str(ALPHA_A)})

    kohya_b = {}
    for name, (down, up) in unet_b.items():
        k = kohya_name("lora_unet_", name)
        kohya_b[k + ".lora_down.weight"] = down
        kohya_b[k + ".lora_up.weight"] = up
    kohya_b_path = os.path.join(LORA, "tiny-sd1-kohya-b.safetensors")
    save_canonical(kohya_b_path, kohya_b)

    golden_in = {}
    with safe_open(os.path.join(GOLDEN, "tiny-sd1.safetensors"), framework="pt") as f:
        for k in ("clip.input_ids", "unet.sample", "unet.encoder_hidden_states", "pipe.latents"):
            golden_in[k] = f.get_tensor(k)
    base_info = json.load(open(os.path.join(GOLDEN, "tiny-sd1.json")))
    settings = dict(base_info["pipeline"], num_inference_steps=PIPE_STEPS)
    timestep = base_info["unet_timestep"]

    def fresh():
        pipe = StableDiffusionPipeline.from_pretrained(MODEL, local_files_only=True, safety_checker=None)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def expect_fused(pipe, parts):
        """Checks diffusers fused exactly W + sum(scale * alpha / r * up @ down)."""
        for model, ref, loras in parts:
            ref_sd = dict(ref.named_modules())
            for name, m in model.named_modules():
                # peft wraps each LoRA'd layer: its fused weight is the wrapper's `base_layer`
                name = name.removesuffix(".base_layer")
                if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) or name not in ref_sd:
                    continue
                want = ref_sd[name].weight.detach().clone()
                for lora, factor in loras:
                    if name in lora:
                        down, up = lora[name]
                        want += factor * delta(down, up, want.shape)
                got = m.weight.detach()
                assert torch.allclose(got, want, rtol=0, atol=1e-6), name

    tensors = dict(golden_in)
    info = {
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "rank_a": RANK_A,
        "alpha_a": ALPHA_A,
        "rank_b": RANK_B,
        "scale_a": SCALE_A,
        "scale_b": SCALE_B,
        "unet_timestep": timestep,
        "pipeline": settings,
        "unet_modules_a": len(unet_a),
        "text_encoder_modules_a": len(te_a),
        "unet_modules_b": len(unet_b),
    }

    def outputs(pipe, tag, with_pipeline):
        with torch.no_grad():
            te = pipe.text_encoder(golden_in["clip.input_ids"]).last_hidden_state
            tensors[f"{tag}.clip.last_hidden_state"] = te
            out = pipe.unet(
                golden_in["unet.sample"], torch.tensor(timestep),
                encoder_hidden_states=golden_in["unet.encoder_hidden_states"],
            ).sample
            tensors[f"{tag}.unet.out"] = out
        if with_pipeline:
            s = settings
            res = pipe(
                prompt=s["prompt"], negative_prompt=s["negative_prompt"],
                num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
                height=s["height"], width=s["width"], latents=golden_in["pipe.latents"].clone(),
                output_type="latent",
            )
            tensors[f"{tag}.pipe.latents_out"] = res.images
            img = pipe(
                prompt=s["prompt"], negative_prompt=s["negative_prompt"],
                num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
                height=s["height"], width=s["width"], latents=golden_in["pipe.latents"].clone(),
                output_type="pil",
            ).images[0]
            img.save(os.path.join(GOLDEN, f"tiny-sd1-lora-{tag}.png"))

    ref = fresh()
    outputs(ref, "base", True)
    factor_a = SCALE_A * ALPHA_A / RANK_A
    for tag, path in (("peft", peft_path), ("kohya", kohya_path)):
        pipe = fresh()
        pipe.load_lora_weights(path)
        pipe.fuse_lora(lora_scale=SCALE_A)
        expect_fused(pipe, [(pipe.unet, ref.unet, [(unet_a, factor_a)]),
                            (pipe.text_encoder, ref.text_encoder, [(te_a, factor_a)])])
        outputs(pipe, tag, True)
        change = (tensors[f"{tag}.unet.out"] - tensors["base.unet.out"]).abs().max()
        assert change > 0.05 * tensors["base.unet.out"].abs().max(), f"{tag}: LoRA barely changes the UNet"
        te_change = (tensors[f"{tag}.clip.last_hidden_state"] - tensors["base.clip.last_hidden_state"]).abs().max()
        assert te_change > 0.05, f"{tag}: LoRA barely changes the text encoder"
    for k in ("unet.out", "clip.last_hidden_state"):
        a, b = tensors[f"peft.{k}"], tensors[f"kohya.{k}"]
        info[f"peft_vs_kohya_max_abs.{k}"] = float((a - b).abs().max())

    pipe = fresh()
    pipe.load_lora_weights(peft_path, adapter_name="a")
    pipe.load_lora_weights(kohya_b_path, adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[SCALE_A, SCALE_B])
    pipe.fuse_lora(adapter_names=["a", "b"], lora_scale=1.0)
    expect_fused(pipe, [(pipe.unet, ref.unet, [(unet_a, factor_a), (unet_b, SCALE_B)]),
                        (pipe.text_encoder, ref.text_encoder, [(te_a, factor_a)])])
    outputs(pipe, "two", False)

    for k, v in tensors.items():
        if v.dtype.is_floating_point:
            tensors[k] = v.to(torch.float32).contiguous()
    save_canonical(os.path.join(GOLDEN, "tiny-sd1-lora.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, "tiny-sd1-lora.json"), info)
    print("ok", {k: v for k, v in info.items() if k.startswith("peft_vs")})
    make_sdxl()
    print("ok sdxl")


if __name__ == "__main__":
    main()
