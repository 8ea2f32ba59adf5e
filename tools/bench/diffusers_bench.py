"""The diffusers side of the benchmark suite (run by tools/bench/run.py, never by tests).

With --make-only, builds, once, a Stable Diffusion 1.5-architecture pipeline with random weights
(UNet 860M, VAE, CLIP ViT-L text encoder; the real CLIP tokenizer from the tiny fixture) in
diffusers format. Otherwise it measures, in one process, what examples/src/bin/bench.rs measures
on the oxidiff side, in the same order, and prints one JSON line:
load, the first generation (time to first image counts from the start of this script, before
torch is imported), one denoising step's UNet call (latents [1, 4, h/8, w/8] doubled for
classifier-free guidance at 7.5, then the guidance combination), text encoding (tokenizer and
encoder, prompt and empty negative prompt as one batch of 2), the VAE decode, a whole DDIM
generation, and the peak RSS (VmHWM).
"""
import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402


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


def make_variant(dir_, variant, fixture):
    """Adds the `variant` (fp16) weight files to the folder, as the Hub's SD 1.5 ships them."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(dir_, torch_dtype=torch.float16, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.save_pretrained(dir_, variant=variant)
    # save_pretrained adds a fast-tokenizer file; keep the folder's tokenizer as make() left it.
    shutil.rmtree(os.path.join(dir_, "tokenizer"))
    shutil.copytree(os.path.join(fixture, "tokenizer"), os.path.join(dir_, "tokenizer"))


def peak_rss_bytes():
    """VmHWM of this process, as the Rust side reads it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


# The text encode takes a fraction of a second: at least this many timed calls, or the
# machine's noise decides its ratio (both sides use the same count).
TEXT_REPEAT_MIN = 10


def timed(fn, repeat, first=None):
    """`repeat` timed runs of `fn` after a warm-up run (or after one that took `first` s)."""
    if first is None:
        start = time.perf_counter()
        fn()
        first = time.perf_counter() - start
    times, cpu_times = [], []
    for _ in range(max(repeat, 1)):
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    times.sort()
    cpu_times.sort()
    return {"first_s": first, "min_s": times[0], "median_s": times[len(times) // 2],
            "max_s": times[-1], "repeats": len(times), "times_s": times,
            "cpu_times_s": cpu_times}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--fixture", default="tests/fixtures/tiny-sd1")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--e2e-repeat", type=int, default=1)
    ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32",
                    help="torch_dtype of the pipeline (the weights and the models' compute)")
    ap.add_argument("--variant", default=None,
                    help="weight files to read (diffusers' variant, e.g. fp16; made on first use)")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument("--unet-only", action="store_true")
    ap.add_argument("--make-only", action="store_true")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.dir, "model_index.json")):
        make(args.dir, args.fixture)
    variant_file = os.path.join(args.dir, "unet", f"diffusion_pytorch_model.{args.variant}.safetensors")
    if args.variant and not os.path.isfile(variant_file):
        make_variant(args.dir, args.variant, args.fixture)
    if args.make_only:
        return
    torch.set_num_threads(args.threads)
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    start = time.perf_counter()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    pipe = StableDiffusionPipeline.from_pretrained(args.dir, safety_checker=None, requires_safety_checker=False,
                                                   torch_dtype=dtype, variant=args.variant)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    device = torch.device(args.device)
    pipe.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pipe.set_progress_bar_config(disable=True)
    result = {"load_s": time.perf_counter() - start}
    prompt = "a photo of an astronaut riding a horse"
    lat = args.size // 8

    def generate():
        return pipe(prompt, num_inference_steps=args.steps, guidance_scale=7.5, height=args.size,
             width=args.size, generator=torch.Generator().manual_seed(0))

    def encode():
        ids = pipe.tokenizer(["", prompt], padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt").input_ids
        return pipe.text_encoder(ids.to(device))[0]

    with torch.no_grad():
        if not args.unet_only:
            start = time.perf_counter()
            generate()
            sync()
            result["first_generation_s"] = time.perf_counter() - start
            result["time_to_first_image_s"] = time.perf_counter() - _STARTED
        ctx = encode()
        sample = torch.randn(1, 4, lat, lat, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        t = torch.tensor([501], device=device)

        def step():
            noise = pipe.unet(torch.cat([sample] * 2), t, encoder_hidden_states=ctx).sample
            uncond, text = noise.chunk(2)
            return uncond + 7.5 * (text - uncond)

        result["unet_step"] = timed(lambda: (step(), sync()), args.repeat)
        if not args.unet_only:
            result["text_encode"] = timed(lambda: (encode(), sync()), max(args.repeat, TEXT_REPEAT_MIN))
            latents = torch.randn(1, 4, lat, lat, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            result["vae_decode"] = timed(lambda: (pipe.vae.decode(latents / 0.18215), sync()), args.repeat)
            result["end_to_end"] = timed(lambda: (generate(), sync()), args.e2e_repeat,
                                         result["first_generation_s"])
    json.dump({
        "impl": "diffusers", "mode": "torch", "dtype": args.dtype, "torch": torch.__version__,
        "kernels": f"torch {torch.backends.cpu.get_cpu_capability()}, oneDNN "
                   f"{'on' if torch.backends.mkldnn.is_available() else 'off'}",
        "threads": torch.get_num_threads(), "size": args.size, "steps": args.steps, **result,
        "peak_rss_bytes": peak_rss_bytes(), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
