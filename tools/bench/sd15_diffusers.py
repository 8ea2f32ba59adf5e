"""The diffusers side of the SD 1.5 benchmark (run by tools/bench/sd15.sh, never by tests).

Builds, once, a Stable Diffusion 1.5-architecture pipeline with random weights (UNet 860M,
VAE, CLIP ViT-L text encoder; the real CLIP tokenizer from the tiny fixture) in diffusers format,
then times text encoding, one UNet step (batch 2: classifier-free guidance), the VAE decode and
a whole 4-step DDIM generation at the given size, and reports the process's peak RSS.
"""
import argparse
import json
import os
import resource
import shutil
import sys
import time

import torch


def make(dir_, fixture):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    vae = AutoencoderKL(
        block_out_channels=[128, 256, 512, 512],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        layers_per_block=2,
        latent_channels=4,
        sample_size=512,
    )
    text = CLIPTextModel(CLIPTextConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        projection_dim=768, hidden_act="quick_gelu", max_position_embeddings=77,
        vocab_size=49408, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    ))
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(fixture, "tokenizer"))
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text, tokenizer=tokenizer, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(dir_)
    # Real SD checkpoints ship the slow-tokenizer files; keep the fixture's.
    shutil.copytree(os.path.join(fixture, "tokenizer"), os.path.join(dir_, "tokenizer"), dirs_exist_ok=True)


def timed_all(fn, repeat):
    """Times of `repeat` runs after a warm-up run, sorted; and the warm-up's time."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(max(repeat, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times), first


def timed(fn, repeat):
    return timed_all(fn, repeat)[0][0]


def stats(times, first):
    return {"first_s": first, "min_s": times[0], "median_s": times[len(times) // 2],
            "max_s": times[-1], "repeats": len(times)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--fixture", default="tests/fixtures/tiny-sd1")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--unet-only", action="store_true")
    ap.add_argument("--make-only", action="store_true")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.dir, "model_index.json")):
        make(args.dir, args.fixture)
    if args.make_only:
        return
    torch.set_num_threads(args.threads)
    from diffusers import StableDiffusionPipeline

    start = time.perf_counter()
    pipe = StableDiffusionPipeline.from_pretrained(args.dir)
    load = time.perf_counter() - start
    prompt = "a photo of an astronaut riding a horse"
    lat = args.size // 8
    with torch.no_grad():
        ids = pipe.tokenizer([prompt, ""], padding="max_length", max_length=77, return_tensors="pt").input_ids
        ctx = pipe.text_encoder(ids)[0]
        sample = torch.randn(2, 4, lat, lat, generator=torch.Generator().manual_seed(0))
        t = torch.tensor([501])
        unet_times, unet_first = timed_all(lambda: pipe.unet(sample, t, encoder_hidden_states=ctx), args.repeat)
        result = {"unet_step_s": unet_times[0], "unet_step": stats(unet_times, unet_first)}
        if not args.unet_only:
            result["text_encode_s"] = timed(lambda: pipe.text_encoder(ids), args.repeat)
            latents = torch.randn(1, 4, lat, lat, generator=torch.Generator().manual_seed(1))
            result["vae_decode_s"] = timed(lambda: pipe.vae.decode(latents / 0.18215), args.repeat)
            start = time.perf_counter()
            pipe(prompt, num_inference_steps=args.steps, guidance_scale=7.5, height=args.size,
                 width=args.size, generator=torch.Generator().manual_seed(0), output_type="np")
            result["end_to_end_s"] = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    json.dump({
        "impl": "diffusers", "torch": torch.__version__, "threads": args.threads,
        "size": args.size, "steps": args.steps, "load_s": load, **result, "peak_rss_bytes": peak,
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
