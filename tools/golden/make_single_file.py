"""Single-file checkpoints in the original LDM / A1111 layout, made from the tiny pipelines.

    python3 tools/golden/make_single_file.py

For tiny-sd1, tiny-sd2 and tiny-sdxl: writes every weight of the diffusers folder under its LDM
key (the inverse of diffusers' `convert_ldm_*` / `convert_open_clip_checkpoint`, written out
here), checks the mapping by loading the float32 conversion with diffusers'
`from_single_file(config=folder)` and comparing every weight with the folder's (bit-exact), then
saves the checkpoint in float16 (as real single files usually are; half the bytes) and golden
outputs of diffusers' `from_single_file` on that float16 file (float32 compute):

  tests/fixtures/single-file/NAME.safetensors        the checkpoint (F16, canonical header)
  tests/fixtures/golden/single-file-NAME.safetensors text encoder, UNet, VAE outputs, image
  tests/fixtures/golden/single-file-NAME.json        settings, versions
  tests/fixtures/golden/single-file-NAME.png         final image of the 4-step run

Inputs (token ids, UNet sample and context, VAE latents, initial latents) are the folder's own
golden inputs (golden/NAME.safetensors), so a test can also put the two side by side.
"""
import json
import os
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import diffusers  # noqa: E402
import safetensors  # noqa: E402
import transformers  # noqa: E402
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import save_canonical, save_json  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")
OUT = os.path.join(FIXTURES, "single-file")

torch.set_num_threads(1)


# --- diffusers names -> LDM names -------------------------------------------------------------

UNET_RESNET = [
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("time_emb_proj", "emb_layers.1"),
    ("conv_shortcut", "skip_connection"),
]
UNET_FIXED = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",
    "add_embedding.linear_2.": "label_emb.0.2.",
}


def resnet_to_ldm(tail):
    first, rest = tail.split(".", 1)
    for new, old in UNET_RESNET:
        if first == new:
            return f"{old}.{rest}"
    raise KeyError(tail)


def unet_to_ldm(state, config):
    layers = config["layers_per_block"]
    has_attn = {i: t.startswith("CrossAttn") for i, t in enumerate(config["up_block_types"])}
    out = {}
    for key, value in state.items():
        ldm = None
        for new, old in UNET_FIXED.items():
            if key.startswith(new):
                ldm = old + key[len(new):]
        if ldm is None:
            parts = key.split(".")
            if parts[0] == "down_blocks":
                b = int(parts[1])
                kind, tail = parts[2], ".".join(parts[4:])
                base = 1 + b * (layers + 1)
                if kind == "resnets":
                    ldm = f"input_blocks.{base + int(parts[3])}.0.{resnet_to_ldm(tail)}"
                elif kind == "attentions":
                    ldm = f"input_blocks.{base + int(parts[3])}.1.{tail}"
                elif kind == "downsamplers":
                    ldm = f"input_blocks.{base + layers}.0.op.{'.'.join(parts[5:])}"
            elif parts[0] == "mid_block":
                i, tail = int(parts[2]), ".".join(parts[3:])
                if parts[1] == "resnets":
                    ldm = f"middle_block.{2 * i}.{resnet_to_ldm(tail)}"
                else:
                    ldm = f"middle_block.1.{tail}"
            elif parts[0] == "up_blocks":
                b = int(parts[1])
                kind, tail = parts[2], ".".join(parts[4:])
                base = b * (layers + 1)
                if kind == "resnets":
                    ldm = f"output_blocks.{base + int(parts[3])}.0.{resnet_to_ldm(tail)}"
                elif kind == "attentions":
                    ldm = f"output_blocks.{base + int(parts[3])}.1.{tail}"
                elif kind == "upsamplers":
                    j = 2 if has_attn[b] else 1
                    ldm = f"output_blocks.{base + layers}.{j}.conv.{'.'.join(parts[5:])}"
        if ldm is None:
            raise KeyError(f"unet key {key} has no LDM name")
        out["model.diffusion_model." + ldm] = value
    return out


VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}


def vae_to_ldm(state, config):
    n = len(config["up_block_types"])
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        coder = parts[0]
        ldm = None
        if coder in ("quant_conv", "post_quant_conv"):
            ldm = key
        elif parts[1] in ("conv_in", "conv_out"):
            ldm = key
        elif parts[1] == "conv_norm_out":
            ldm = f"{coder}.norm_out.{parts[2]}"
        elif parts[1] == "mid_block":
            if parts[2] == "resnets":
                tail = ".".join(parts[4:]).replace("conv_shortcut", "nin_shortcut")
                ldm = f"{coder}.mid.block_{int(parts[3]) + 1}.{tail}"
            else:
                layer = VAE_ATTN[parts[4]]
                ldm = f"{coder}.mid.attn_1.{layer}.{parts[-1]}"
                if parts[-1] == "weight" and layer != "norm":
                    value = value.reshape(*value.shape, 1, 1)  # linear -> 1x1 conv
        elif parts[1] in ("down_blocks", "up_blocks"):
            i = int(parts[2])
            idx, word, sampler = (i, "down", "downsample") if coder == "encoder" else (n - 1 - i, "up", "upsample")
            if parts[3] == "resnets":
                tail = ".".join(parts[5:]).replace("conv_shortcut", "nin_shortcut")
                ldm = f"{coder}.{word}.{idx}.block.{parts[4]}.{tail}"
            else:
                ldm = f"{coder}.{word}.{idx}.{sampler}.conv.{parts[-1]}"
        if ldm is None:
            raise KeyError(f"vae key {key} has no LDM name")
        out["first_stage_model." + ldm] = value
    return out


def with_text_model(state):
    """transformers 5 saves CLIPTextModel without the `text_model.` prefix; LDM files have it."""
    return {(k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): v for k, v in state.items()}


def clip_to_ldm(state, prefix):
    return {prefix + k: v for k, v in with_text_model(state).items() if not k.endswith("position_ids")}


OPEN_CLIP_LAYER = [
    ("layer_norm1", "ln_1"),
    ("layer_norm2", "ln_2"),
    ("mlp.fc1", "mlp.c_fc"),
    ("mlp.fc2", "mlp.c_proj"),
    ("self_attn.out_proj", "attn.out_proj"),
]


def open_clip_to_ldm(state, prefix, projection=None):
    state = with_text_model(state)
    out = {}
    fixed = {
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.final_layer_norm.weight": "ln_final.weight",
        "text_model.final_layer_norm.bias": "ln_final.bias",
    }
    fused = {}
    for key, value in state.items():
        if key in fixed:
            out[prefix + fixed[key]] = value
        elif key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T.contiguous()
        elif key.startswith("text_model.encoder.layers."):
            rest = key[len("text_model.encoder.layers."):]
            i, tail = rest.split(".", 1)
            base = f"{prefix}transformer.resblocks.{i}."
            if tail.startswith("self_attn.") and tail.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                fused.setdefault((base, tail.split(".")[-1]), {})[tail.split(".")[1]] = value
                continue
            for new, old in OPEN_CLIP_LAYER:
                if tail.startswith(new + "."):
                    out[base + old + tail[len(new):]] = value
                    break
            else:
                raise KeyError(f"text encoder key {key} has no OpenCLIP name")
        elif not key.endswith("position_ids"):
            raise KeyError(f"text encoder key {key} has no OpenCLIP name")
    for (base, param), qkv in fused.items():
        out[f"{base}attn.in_proj_{param}"] = torch.cat([qkv["q_proj"], qkv["k_proj"], qkv["v_proj"]], 0)
    if projection is not None:
        out[prefix + "text_projection"] = projection
    return out


def to_ldm(name, pipe):
    tensors = {}
    tensors.update(unet_to_ldm(pipe.unet.state_dict(), pipe.unet.config))
    tensors.update(vae_to_ldm(pipe.vae.state_dict(), pipe.vae.config))
    if name == "tiny-sd1":
        tensors.update(clip_to_ldm(pipe.text_encoder.state_dict(), "cond_stage_model.transformer."))
    elif name == "tiny-sd2":
        # SD 2 files carry OpenCLIP's text_projection, which diffusers ignores for SD 2.
        hidden = pipe.text_encoder.config.hidden_size
        proj = torch.randn((hidden, hidden), generator=torch.Generator().manual_seed(7))
        tensors.update(open_clip_to_ldm(pipe.text_encoder.state_dict(), "cond_stage_model.model.", proj))
    else:
        tensors.update(clip_to_ldm(pipe.text_encoder.state_dict(), "conditioner.embedders.0.transformer."))
        tensors.update(open_clip_to_ldm(pipe.text_encoder_2.state_dict(), "conditioner.embedders.1.model."))
    # A DDPM schedule buffer, as every LDM checkpoint has: loaders must skip it.
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    tensors["alphas_cumprod"] = torch.cumprod(1 - betas, 0).to(torch.float32)
    return {k: v.detach().contiguous() for k, v in tensors.items()}


# --- checks and golden data -------------------------------------------------------------------

def pipeline_class(name):
    return StableDiffusionXLPipeline if name == "tiny-sdxl" else StableDiffusionPipeline


def load_single(name, path, folder):
    cls = pipeline_class(name)
    kwargs = dict(config=folder, local_files_only=True, torch_dtype=torch.float32)
    if name == "tiny-sdxl":
        kwargs["add_watermarker"] = False
    else:
        kwargs["safety_checker"] = None
    pipe = cls.from_single_file(path, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text_encoder_2_reference(folder_pipe, checkpoint):
    """diffusers' own conversion for text_encoder_2, called directly.

    `from_single_file` picks the conversion by comparing position-embedding widths, and the tiny
    SDXL's two encoders are both 8 wide, so it would take `conditioner.embedders.0` for both;
    real SDXL files (768 against 1280) never meet this. The check uses the function it calls for
    real files instead.
    """
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    model = folder_pipe.text_encoder_2
    converted = convert_open_clip_checkpoint(model, checkpoint, prefix="conditioner.embedders.1.model.")
    return converted


def check_exact(name, folder_pipe, ldm, folder):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.safetensors")
        save_canonical(path, ldm)
        single = load_single(name, path, folder)
        parts = ["unet", "vae", "text_encoder"]
        for part in parts:
            a, b = getattr(folder_pipe, part).state_dict(), getattr(single, part).state_dict()
            assert sorted(a) == sorted(b), part
            bad = [k for k in a if not torch.equal(a[k], b[k])]
            assert not bad, f"{name} {part}: {bad[:5]}"
        if name == "tiny-sdxl":
            a = with_text_model(folder_pipe.text_encoder_2.state_dict())
            b = text_encoder_2_reference(folder_pipe, load_file(path))
            a = {k: v for k, v in a.items() if not k.endswith("position_ids")}
            assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
            assert all(torch.equal(a[k], b[k]) for k in a), "text_encoder_2"
    print(f"{name}: the float32 LDM file loads bit-exactly into diffusers' components")


def golden(name, folder, path):
    pipe = load_single(name, path, folder)
    if name == "tiny-sdxl":
        # See text_encoder_2_reference: give text_encoder_2 diffusers' own conversion.
        converted = text_encoder_2_reference(pipe, load_file(path))
        converted = {k: v.to(torch.float32) for k, v in converted.items()}
        # `assign`: from_single_file left `text_projection.weight` on the meta device.
        missing, unexpected = pipe.text_encoder_2.load_state_dict(converted, strict=False, assign=True)
        assert not unexpected and all(k.endswith("position_ids") for k in missing), (missing, unexpected)
    for part in ("unet", "vae", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, part, None)
        for key, value in [] if module is None else module.state_dict().items():
            assert not value.is_meta and torch.isfinite(value.float()).all(), f"{name} {part}.{key}"
    ref = load_file(os.path.join(GOLDEN, f"{name}.safetensors"))
    settings = json.load(open(os.path.join(GOLDEN, f"{name}.json")))
    s = settings["pipeline"]
    t = {}
    info = {
        "name": name,
        "checkpoint": f"tests/fixtures/single-file/{name}.safetensors",
        "config": f"tests/fixtures/{name}",
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "unet_timestep": settings["unet_timestep"],
        "pipeline": {k: s[k] for k in ("prompt", "negative_prompt", "num_inference_steps", "guidance_scale", "height", "width")},
        "scheduler": type(pipe.scheduler).__name__,
    }
    with torch.no_grad():
        if name == "tiny-sdxl":
            for key, te in (("te1", pipe.text_encoder), ("te2", pipe.text_encoder_2)):
                ids = ref[f"{key}.input_ids"]
                out = te(ids, output_hidden_states=True)
                t[f"{key}.input_ids"] = ids
                t[f"{key}.penultimate"] = out.hidden_states[-2]
                if key == "te2":
                    t["te2.text_embeds"] = out.text_embeds
            unet_out = pipe.unet(
                ref["unet.sample"],
                torch.tensor(settings["unet_timestep"]),
                encoder_hidden_states=ref["unet.encoder_hidden_states"],
                added_cond_kwargs={"text_embeds": ref["unet.text_embeds"], "time_ids": ref["unet.time_ids"]},
            ).sample
            for k in ("unet.text_embeds", "unet.time_ids"):
                t[k] = ref[k]
        else:
            ids = ref["clip.input_ids"]
            t["clip.input_ids"] = ids
            t["clip.last_hidden_state"] = pipe.text_encoder(ids).last_hidden_state
            unet_out = pipe.unet(
                ref["unet.sample"], torch.tensor(settings["unet_timestep"]), ref["unet.encoder_hidden_states"]
            ).sample
        t["unet.sample"] = ref["unet.sample"]
        t["unet.encoder_hidden_states"] = ref["unet.encoder_hidden_states"]
        t["unet.out"] = unet_out
        # tiny-sdxl's golden has no VAE input: a seeded one.
        vae_in = ref.get("vae.decode.in")
        if vae_in is None:
            vae_in = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(1234))
        t["vae.decode.in"] = vae_in
        t["vae.decode.out"] = pipe.vae.decode(vae_in).sample
        latents = ref["pipe.latents"]
        t["pipe.latents"] = latents
        common = dict(
            prompt=s["prompt"],
            negative_prompt=s["negative_prompt"],
            num_inference_steps=s["num_inference_steps"],
            guidance_scale=s["guidance_scale"],
            height=s["height"],
            width=s["width"],
        )
        image = pipe(**common, latents=latents.clone(), output_type="np").images
        image = np.asarray(image, dtype=np.float32)
        t["pipe.image"] = image
        pil = pipe(**common, latents=latents.clone(), output_type="pil").images[0]
        assert np.array_equal(np.asarray(pil), (image[0] * 255).round().astype(np.uint8))
        pil.save(os.path.join(GOLDEN, f"single-file-{name}.png"))
        info["image_stats"] = {"mean": float(image.mean()), "std": float(image.std())}
        info["unet_out_std"] = float(unet_out.std())
    t = {k: (v.to(torch.float32) if torch.is_tensor(v) and v.dtype.is_floating_point else v) for k, v in t.items()}
    save_canonical(os.path.join(GOLDEN, f"single-file-{name}.safetensors"), t)
    info["keys"] = sorted(t)
    save_json(os.path.join(GOLDEN, f"single-file-{name}.json"), info)


# --- the released models' layouts (shapes only) ----------------------------------------------

CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
              projection_dim=768, bos_token_id=0, eos_token_id=2, pad_token_id=1)
OPEN_CLIP_H = dict(CLIP_L, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                   num_attention_heads=16, hidden_act="gelu", projection_dim=512)
OPEN_CLIP_BIGG = dict(CLIP_L, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                      num_attention_heads=20, hidden_act="gelu", projection_dim=1280)
VAE = dict(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
           up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2, latent_channels=4)
# The released models' configs (stable-diffusion-v1-5, stable-diffusion-2-1, SDXL base 1.0),
# the fields oxidiff's built-in configs must reproduce from the tensors and the defaults.
RELEASED = {
    "sd15": dict(
        unet=dict(cross_attention_dim=768, attention_head_dim=8, sample_size=64),
        vae=dict(VAE, sample_size=512, scaling_factor=0.18215),
        text_encoder=CLIP_L,
    ),
    "sd21": dict(
        unet=dict(cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20], sample_size=96,
                  use_linear_projection=True, upcast_attention=True),
        vae=dict(VAE, sample_size=768, scaling_factor=0.18215),
        text_encoder=OPEN_CLIP_H,
    ),
    "sdxl_base": dict(
        unet=dict(
            sample_size=128,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            block_out_channels=[320, 640, 1280],
            transformer_layers_per_block=[1, 2, 10],
            attention_head_dim=[5, 10, 20],
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        ),
        vae=dict(VAE, sample_size=1024, scaling_factor=0.13025),
        text_encoder=CLIP_L,
        text_encoder_2=OPEN_CLIP_BIGG,
    ),
}


def released_layout(name, spec):
    """The LDM key -> shape list of a released model, from diffusers/transformers models built
    on the meta device (no weights), converted with this script's mapping; checked against
    diffusers' own conversion of the same layout back."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders import single_file_utils as sfu
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with torch.device("meta"):
        unet = UNet2DConditionModel(**spec["unet"])
        vae = AutoencoderKL(**spec["vae"])
        te = CLIPTextModel(CLIPTextConfig(**spec["text_encoder"]))
        te2 = None
        if "text_encoder_2" in spec:
            te2 = CLIPTextModelWithProjection(CLIPTextConfig(**spec["text_encoder_2"]))
    ldm = {}
    ldm.update(unet_to_ldm(unet.state_dict(), unet.config))
    ldm.update(vae_to_ldm(vae.state_dict(), vae.config))
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    if name == "sd15":
        ldm.update(clip_to_ldm(te.state_dict(), "cond_stage_model.transformer."))
        ldm["cond_stage_model.transformer.text_model.embeddings.position_ids"] = meta(1, 77)
    elif name == "sd21":
        ldm.update(open_clip_to_ldm(te.state_dict(), "cond_stage_model.model.", meta(1024, 1024)))
        # A real SD 2 file holds OpenCLIP's 24th block, which SD 2 does not use.
        for key in [k for k in ldm if ".resblocks.22." in k]:
            ldm[key.replace(".resblocks.22.", ".resblocks.23.")] = ldm[key]
        ldm["cond_stage_model.model.logit_scale"] = meta()
    else:
        ldm.update(clip_to_ldm(te.state_dict(), "conditioner.embedders.0.transformer."))
        ldm.update(open_clip_to_ldm(te2.state_dict(), "conditioner.embedders.1.model."))
    ldm["alphas_cumprod"] = meta(1000)
    ldm["model_ema.decay"] = meta()

    # diffusers' conversion of this layout gives back the models' own names and shapes.
    back = sfu.convert_ldm_unet_checkpoint(ldm, unet.config)
    assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in unet.state_dict().items()}, name
    back = sfu.convert_ldm_vae_checkpoint(ldm, vae.config)
    assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in vae.state_dict().items()}, name
    model_type = sfu.infer_diffusers_model_type(ldm)
    configs = {
        "unet": dict(unet.config),
        "vae": dict(vae.config),
        "text_encoder": spec["text_encoder"],
    }
    if te2 is not None:
        configs["text_encoder_2"] = spec["text_encoder_2"]
    configs = json.loads(json.dumps(configs, default=list))
    diffusers = {"unet": unet, "vae": vae, "text_encoder": te}
    if te2 is not None:
        diffusers["text_encoder_2"] = te2
    diffusers = {
        part: {
            k: list(v.shape)
            for k, v in sorted((with_text_model(m.state_dict()) if part.startswith("text") else m.state_dict()).items())
            if not k.endswith("position_ids")
        }
        for part, m in diffusers.items()
    }
    return {
        "diffusers_shapes": diffusers,
        "diffusers_model_type": model_type,
        "configs": configs,
        "shapes": {k: list(v.shape) for k, v in sorted(ldm.items())},
    }


def layouts():
    out = {name: released_layout(name, spec) for name, spec in RELEASED.items()}
    assert [v["diffusers_model_type"] for v in out.values()] == ["v1", "v2", "xl_base"]
    path = os.path.join(OUT, "released-layouts.json")
    with open(path, "w") as f:
        json.dump(out, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def main():
    os.makedirs(OUT, exist_ok=True)
    layouts()
    for name in ("tiny-sd1", "tiny-sd2", "tiny-sdxl"):
        folder = os.path.join(FIXTURES, name)
        cls = pipeline_class(name)
        kwargs = {"add_watermarker": False} if name == "tiny-sdxl" else {"safety_checker": None}
        folder_pipe = cls.from_pretrained(folder, local_files_only=True, **kwargs)
        ldm = to_ldm(name, folder_pipe)
        check_exact(name, folder_pipe, ldm, folder)
        half = {k: (v.to(torch.float16) if v.dtype == torch.float32 else v) for k, v in ldm.items()}
        path = os.path.join(OUT, f"{name}.safetensors")
        save_canonical(path, half)
        golden(name, folder, path)
        print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes) and golden/single-file-{name}.*")


if __name__ == "__main__":
    main()
