"""Tiny random LoRAs for the transformer fixtures (tiny-flux-dev, tiny-sd3, tiny-pixart-alpha),
and what diffusers makes with them.

Run by hand (never by tests), from the repository root, after make_tiny_flux.py,
make_tiny_sd3.py, make_tiny_pixart.py and make_lora.py:

    pip install peft
    python3 tools/golden/make_lora_dit.py

Writes (tests/fixtures/lora/ and tests/fixtures/golden/):
  tiny-flux-peft.safetensors    Flux LoRA, PEFT keys (`transformer.…`, `text_encoder.…`) + metadata
  tiny-flux-kohya.safetensors   Flux LoRA in kohya/sd-scripts layout (`lora_unet_double_blocks_0_
                                img_attn_qkv` ...), written with the inverse of diffusers'
                                `_convert_kohya_flux_lora_to_diffusers`; one qkv LoRA is
                                block-sparse (rank 3r), the layout diffusers splits per projection
  tiny-flux-kohya-transformer.safetensors  kohya-style keys over diffusers' module names
                                (`lora_transformer_transformer_blocks_0_attn_to_q`, the layout
                                diffusers reads in `_convert_mixture_state_dict_to_diffusers`)
  tiny-sd3-peft.safetensors     SD3 LoRA: transformer, text_encoder, text_encoder_2
  tiny-pixart-peft.safetensors  PixArt-alpha LoRA: transformer
  tiny-dit-lora.safetensors     reference tensors (transformer outputs, SD3 prompt embeddings)
  tiny-dit-lora.json            settings, versions, layer counts
  tiny-dit-lora-{flux,sd3,pixart}.png  the pipelines' images with the PEFT LoRA fused
  tiny-sd1-lora-img2img.png     diffusers' StableDiffusionImg2ImgPipeline (make_img2img.py's
                                run) with make_lora.py's tiny-sd1-kohya LoRA fused at 0.75

The reference is what diffusers makes of each file: `pipe.load_lora_weights(path)` +
`pipe.fuse_lora(lora_scale=s)` for Flux (with `components=["transformer", "text_encoder"]`:
its default fuses only the transformer) and SD3, for which the script also checks that the
unfused LoRA at `joint_attention_kwargs={"scale": s}` gives the same transformer output, and
that the fused weights are exactly W + s * alpha / r * up @ down. PixArtAlphaPipeline has no
LoRA loader in diffusers; its LoRA goes in through peft (`inject_adapter_in_model` +
`set_peft_model_state_dict`, scaled with `scale_lora_layers`), as diffusers' loaders do.
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
from make_lora import delta, gen, random_lora  # noqa: E402

import diffusers  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402
from diffusers import FluxPipeline, PixArtAlphaPipeline, StableDiffusion3Pipeline  # noqa: E402
from diffusers.utils.peft_utils import scale_lora_layers  # noqa: E402
from safetensors import safe_open  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")
LORA = os.path.join(FIXTURES, "lora")
NAME = "tiny-dit-lora"

RANK, ALPHA = 4, 8.0  # scaling alpha / rank = 2
SCALE = 0.75
TE_SUFFIXES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def linears(model, skip=()):
    """Every Linear and Conv2d of `model` (a LoRA can reach all of them)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and not name.endswith(skip)
    ]


def te_targets(model):
    return [(n, m) for n, m in linears(model) if n.endswith(TE_SUFFIXES)]


def te_name(name):
    # transformers 5 saves CLIPTextModel without `text_model.`; files name it.
    name = name.removeprefix("text_model.")
    return name if name == "text_projection" else "text_model." + name


def peft_file(path, parts):
    """parts: (component, lora, rename). PEFT keys plus diffusers' adapter metadata."""
    tensors, meta = {}, {}
    for comp, lora, rename in parts:
        for name, (down, up) in lora.items():
            tensors[f"{comp}.{rename(name)}.lora_A.weight"] = down
            tensors[f"{comp}.{rename(name)}.lora_B.weight"] = up
        meta[f"{comp}.r"] = RANK
        meta[f"{comp}.lora_alpha"] = ALPHA
        # peft matches target_modules against the loaded model's own module names
        meta[f"{comp}.target_modules"] = sorted(lora)
    save_canonical(path, tensors,
                   {"format": "pt", "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True)})


def expect_fused(model, ref, lora, factor):
    """The fused weights are exactly W + factor * up @ down for the LoRA's layers, W elsewhere."""
    ref_mods = dict(ref.named_modules())
    n = 0
    for name, m in model.named_modules():
        # peft wraps each LoRA'd layer; the fused weight is its `base_layer`'s
        name = name.removesuffix(".base_layer")
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name in ref_mods:
            want = ref_mods[name].weight.detach().clone()
            if name in lora:
                want += factor * delta(*lora[name], want.shape)
                n += 1
            assert torch.allclose(m.weight.detach(), want, rtol=0, atol=1e-6), name
    assert n == len(lora), (n, len(lora))


def changed(a, b, what):
    assert (a - b).abs().max() > 0.05 * b.abs().max(), f"{what}: the LoRA barely changes it"


# --- Flux ---------------------------------------------------------------------------------

def flux_kohya(lora, num_layers, num_single):
    """The kohya/sd-scripts Flux file whose diffusers conversion is `lora` (per-projection
    pairs, alpha ALPHA): qkv pairs share one down (dense) or are block-diagonal (sparse)."""
    out = {}

    def single(kohya, name):
        down, up = lora[name]
        out[f"{kohya}.lora_down.weight"] = down
        out[f"{kohya}.lora_up.weight"] = up
        out[f"{kohya}.alpha"] = torch.tensor(ALPHA)

    for i in range(num_layers):
        b = f"transformer_blocks.{i}"
        k = f"lora_unet_double_blocks_{i}"
        for stream, (q, kk, v, o, ff, ctx_norm) in {
            "img": ("to_q", "to_k", "to_v", "to_out.0", "ff", "norm1"),
            "txt": ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context", "norm1_context"),
        }.items():
            names = [f"{b}.attn.{p}" for p in (q, kk, v)]
            if stream == "txt" and i == 0:
                # sparse: down is the three downs stacked, up block-diagonal
                downs = [lora[n][0] for n in names]
                ups = [lora[n][1] for n in names]
                down = torch.cat(downs, 0)
                up = torch.block_diag(*ups)
                out[f"{k}_{stream}_attn_qkv.alpha"] = torch.tensor(ALPHA * 3)
            else:
                # dense: one down shared by q, k, v (written so: the file's LoRA is that)
                down = lora[names[0]][0]
                up = torch.cat([lora[n][1] for n in names], 0)
                out[f"{k}_{stream}_attn_qkv.alpha"] = torch.tensor(ALPHA)
            out[f"{k}_{stream}_attn_qkv.lora_down.weight"] = down
            out[f"{k}_{stream}_attn_qkv.lora_up.weight"] = up
            single(f"{k}_{stream}_attn_proj", f"{b}.attn.{o}")
            single(f"{k}_{stream}_mlp_0", f"{b}.{ff}.net.0.proj")
            single(f"{k}_{stream}_mlp_2", f"{b}.{ff}.net.2")
            single(f"{k}_{stream}_mod_lin", f"{b}.{ctx_norm}.linear")
    for i in range(num_single):
        # `linear1` (q, k, v and proj_mlp in one) is left out: diffusers splits it with the
        # full-size Flux widths (3072, 3072, 3072, 12288) and cannot load it for a tiny model.
        single(f"lora_unet_single_blocks_{i}_linear2", f"single_transformer_blocks.{i}.proj_out")
        single(f"lora_unet_single_blocks_{i}_modulation_lin", f"single_transformer_blocks.{i}.norm.linear")
    return out


def flux_kohya_lora(base_lora, cfg):
    """The per-projection LoRA a kohya file stands for: dense qkv share one down."""
    lora = dict(base_lora)
    for i in range(cfg.num_layers):
        b = f"transformer_blocks.{i}.attn"
        for names in ((f"{b}.to_q", f"{b}.to_k", f"{b}.to_v"),
                      (f"{b}.add_q_proj", f"{b}.add_k_proj", f"{b}.add_v_proj")):
            if i == 0 and names[0].endswith("add_q_proj"):
                continue
            shared = lora[names[0]][0]
            for n in names:
                lora[n] = (shared, lora[n][1])
    keep = set()
    for i in range(cfg.num_layers):
        b = f"transformer_blocks.{i}"
        keep |= {f"{b}.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                            "add_v_proj", "to_add_out")}
        keep |= {f"{b}.{ff}.net.{j}" for ff in ("ff", "ff_context") for j in ("0.proj", "2")}
        keep |= {f"{b}.norm1.linear", f"{b}.norm1_context.linear"}
    for i in range(cfg.num_single_layers):
        keep |= {f"single_transformer_blocks.{i}.proj_out", f"single_transformer_blocks.{i}.norm.linear"}
    return {k: v for k, v in lora.items() if k in keep}


def make_flux(tensors, info):
    model = os.path.join(FIXTURES, "tiny-flux-dev")
    flux_golden = json.load(open(os.path.join(GOLDEN, "tiny-flux.json")))

    def load():
        pipe = FluxPipeline.from_pretrained(model, local_files_only=True, torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    base = load()
    lora = random_lora(linears(base.transformer), RANK, 300)
    te = random_lora(te_targets(base.text_encoder), RANK, 301)
    peft_path = os.path.join(LORA, "tiny-flux-peft.safetensors")
    peft_file(peft_path, [("transformer", lora, lambda n: n), ("text_encoder", te, te_name)])
    cfg = base.transformer.config
    kohya_lora = flux_kohya_lora(random_lora(linears(base.transformer), RANK, 302), cfg)
    kohya_path = os.path.join(LORA, "tiny-flux-kohya.safetensors")
    save_canonical(kohya_path, flux_kohya(kohya_lora, cfg.num_layers, cfg.num_single_layers))

    with safe_open(os.path.join(GOLDEN, "tiny-flux.safetensors"), framework="pt") as f:
        inputs = {k: f.get_tensor(f"transformer.{k}") for k in
                  ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                   "guidance", "img_ids")}
    inputs["txt_ids"] = torch.zeros(inputs["encoder_hidden_states"].shape[1], 3)

    def call(pipe, **kw):
        with torch.no_grad():
            return pipe.transformer(**inputs, **kw).sample

    base_out = call(base)
    factor = SCALE * ALPHA / RANK
    # diffusers' "mixture" reader takes attention layers inside blocks and the top-level layers
    mixture = {n: v for n, v in random_lora(linears(base.transformer), RANK, 303).items()
               if ".attn." in n or not n.startswith(("transformer_blocks", "single_transformer_blocks"))}
    mixture_path = os.path.join(LORA, "tiny-flux-kohya-transformer.safetensors")
    tensors_m = {}
    for name, (down, up) in mixture.items():
        k = "lora_transformer_" + name.replace(".", "_")
        tensors_m[k + ".lora_down.weight"] = down
        tensors_m[k + ".lora_up.weight"] = up
        tensors_m[k + ".alpha"] = torch.tensor(ALPHA)
    save_canonical(mixture_path, tensors_m)
    for tag, path, want in (("flux-peft", peft_path, lora), ("flux-kohya", kohya_path, kohya_lora),
                            ("flux-kohya-transformer", mixture_path, mixture)):
        pipe = load()
        pipe.load_lora_weights(path)
        unfused = call(pipe, joint_attention_kwargs={"scale": SCALE})
        # Flux's fuse_lora fuses only the transformer unless told (the text encoder's LoRA
        # would stay on the fly at scale 1); oxidiff fuses both at the scale given.
        pipe.fuse_lora(lora_scale=SCALE, components=["transformer", "text_encoder"])
        expect_fused(pipe.transformer, base.transformer, want, factor)
        if tag == "flux-peft":
            expect_fused(pipe.text_encoder, base.text_encoder, te, factor)
        out = call(pipe)
        assert torch.allclose(out, unfused, rtol=0, atol=1e-5), (tag, (out - unfused).abs().max())
        changed(out, base_out, tag)
        tensors[f"{tag}.transformer.out"] = out
        info[f"{tag}.transformer_modules"] = len(want)
        if tag == "flux-peft":
            info["flux-peft.text_encoder_modules"] = len(te)
            s = {k: v for k, v in flux_golden["dev"].items() if k != "seed"}
            g = torch.Generator("cpu").manual_seed(flux_golden["dev"]["seed"])
            img = pipe(**s, generator=g, output_type="pil").images[0]
            img.save(os.path.join(GOLDEN, f"{NAME}-flux.png"))
    info["flux.run"] = flux_golden["dev"]


# --- SD3 ----------------------------------------------------------------------------------

def make_sd3(tensors, info):
    model = os.path.join(FIXTURES, "tiny-sd3")
    sd3_golden = json.load(open(os.path.join(GOLDEN, "tiny-sd3.json")))

    def load():
        pipe = StableDiffusion3Pipeline.from_pretrained(model, local_files_only=True, torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    base = load()
    lora = random_lora(linears(base.transformer), RANK, 400)
    te1 = random_lora(te_targets(base.text_encoder), RANK, 401)
    te2 = random_lora(te_targets(base.text_encoder_2), RANK, 402)
    path = os.path.join(LORA, "tiny-sd3-peft.safetensors")
    peft_file(path, [("transformer", lora, lambda n: n), ("text_encoder", te1, te_name),
                     ("text_encoder_2", te2, te_name)])
    with safe_open(os.path.join(GOLDEN, "tiny-sd3.safetensors"), framework="pt") as f:
        g = {k: f.get_tensor(k) for k in ("transformer.sample", "transformer.encoder_hidden_states",
                                          "transformer.pooled_projections", "pipe.latents")}
    t = sd3_golden["transformer_timestep"]

    def call(pipe, **kw):
        with torch.no_grad():
            return pipe.transformer(
                hidden_states=g["transformer.sample"], timestep=torch.tensor([t, t]),
                encoder_hidden_states=g["transformer.encoder_hidden_states"],
                pooled_projections=g["transformer.pooled_projections"], **kw).sample

    base_out = call(base)
    pipe = load()
    pipe.load_lora_weights(path)
    unfused = call(pipe, joint_attention_kwargs={"scale": SCALE})
    pipe.fuse_lora(lora_scale=SCALE)
    factor = SCALE * ALPHA / RANK
    expect_fused(pipe.transformer, base.transformer, lora, factor)
    expect_fused(pipe.text_encoder, base.text_encoder, te1, factor)
    expect_fused(pipe.text_encoder_2, base.text_encoder_2, te2, factor)
    out = call(pipe)
    assert torch.allclose(out, unfused, rtol=0, atol=1e-5), (out - unfused).abs().max()
    changed(out, base_out, "sd3")
    tensors["sd3.transformer.out"] = out
    s = sd3_golden["pipeline"]
    with torch.no_grad():
        pe, _, pooled, _ = pipe.encode_prompt(s["prompt"], s["prompt"], s["prompt"], device="cpu",
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=s["max_sequence_length"])
    tensors["sd3.encode.prompt_embeds"] = pe
    tensors["sd3.encode.pooled_prompt_embeds"] = pooled
    img = pipe(**s, latents=g["pipe.latents"].clone(), output_type="pil").images[0]
    img.save(os.path.join(GOLDEN, f"{NAME}-sd3.png"))
    info["sd3.transformer_modules"] = len(lora)
    info["sd3.text_encoder_modules"] = len(te1)
    info["sd3.text_encoder_2_modules"] = len(te2)
    info["sd3.transformer_timestep"] = t
    info["sd3.run"] = s


# --- PixArt -------------------------------------------------------------------------------

def make_pixart(tensors, info):
    model = os.path.join(FIXTURES, "tiny-pixart-alpha")
    px_golden = json.load(open(os.path.join(GOLDEN, "tiny-pixart-alpha.json")))

    def load():
        pipe = PixArtAlphaPipeline.from_pretrained(model, local_files_only=True, torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    base = load()
    lora = random_lora(linears(base.transformer), RANK, 500)
    path = os.path.join(LORA, "tiny-pixart-peft.safetensors")
    peft_file(path, [("transformer", lora, lambda n: n)])
    with safe_open(os.path.join(GOLDEN, "tiny-pixart-alpha.safetensors"), framework="pt") as f:
        g = {k: f.get_tensor(k) for k in ("transformer.sample", "transformer.encoder_hidden_states",
                                          "transformer.encoder_attention_mask", "pipe.latents")}
    t = px_golden["transformer_timestep"]

    def call(pipe):
        with torch.no_grad():
            return pipe.transformer(
                g["transformer.sample"], encoder_hidden_states=g["transformer.encoder_hidden_states"],
                encoder_attention_mask=g["transformer.encoder_attention_mask"], timestep=torch.tensor([t, t]),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample

    base_out = call(base)
    pipe = load()
    # diffusers has no LoRA loader for PixArt; peft, as diffusers' loaders use it.
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(lora))
    peft.inject_adapter_in_model(config, pipe.transformer, adapter_name="default")
    with safe_open(path, framework="pt") as f:
        sd = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    result = peft.set_peft_model_state_dict(pipe.transformer, sd, adapter_name="default")
    assert not result.unexpected_keys, result.unexpected_keys
    scale_lora_layers(pipe.transformer, SCALE)
    out = call(pipe)
    changed(out, base_out, "pixart")
    # the unfused peft output equals W + s * alpha / r * up @ down fused by hand
    ref = load()
    factor = SCALE * ALPHA / RANK
    mods = dict(ref.transformer.named_modules())
    with torch.no_grad():
        for name, (down, up) in lora.items():
            w = mods[name].weight
            w += factor * delta(down, up, w.shape)
    assert torch.allclose(call(ref), out, rtol=0, atol=1e-5)
    tensors["pixart.transformer.out"] = out
    s = px_golden["pipeline"]
    img = pipe(**s, latents=g["pipe.latents"].clone(), output_type="pil").images[0]
    img.save(os.path.join(GOLDEN, f"{NAME}-pixart.png"))
    info["pixart.transformer_modules"] = len(lora)
    info["pixart.transformer_timestep"] = t
    info["pixart.run"] = s


def make_img2img():
    """The img2img binary's --lora: make_img2img.py's run with tiny-sd1-kohya fused."""
    import PIL.Image
    from diffusers import StableDiffusionImg2ImgPipeline
    from make_img2img import SETTINGS

    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(
        os.path.join(FIXTURES, "tiny-sd1"), local_files_only=True, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(os.path.join(LORA, "tiny-sd1-kohya.safetensors"))
    pipe.fuse_lora(lora_scale=SCALE)
    image = PIL.Image.open(os.path.join(GOLDEN, "img2img-input.png")).convert("RGB")
    s = SETTINGS
    out = pipe(prompt=s["prompt"], negative_prompt=s["negative_prompt"], image=image,
               strength=s["strength"], num_inference_steps=s["num_inference_steps"],
               guidance_scale=s["guidance_scale"], generator=gen(s["seed"]), output_type="pil")
    out.images[0].save(os.path.join(GOLDEN, "tiny-sd1-lora-img2img.png"))


def main():
    os.makedirs(LORA, exist_ok=True)
    tensors, info = {}, {
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__},
        "rank": RANK, "alpha": ALPHA, "scale": SCALE,
    }
    make_flux(tensors, info)
    print("ok flux")
    make_sd3(tensors, info)
    print("ok sd3")
    make_pixart(tensors, info)
    print("ok pixart")
    make_img2img()
    print("ok img2img")
    for k, v in tensors.items():
        tensors[k] = v.to(torch.float32).contiguous()
    save_canonical(os.path.join(GOLDEN, f"{NAME}.safetensors"), tensors)
    info["keys"] = sorted(tensors)
    save_json(os.path.join(GOLDEN, f"{NAME}.json"), info)


if __name__ == "__main__":
    main()
