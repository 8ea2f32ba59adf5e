"""Golden data for oxidiff-schedulers' CMStochasticIterativeScheduler, stepped by diffusers.

Run by hand (never by tests), from the repository root:

    python3 tools/golden/make_cm_scheduler.py

Writes tests/fixtures/golden/cm_stochastic_iterative.safetensors (tensors) and
cm_stochastic_iterative.json (configs, timesteps, sigmas). Per case: the initial sample
(randn * init_noise_sigma), per step the model output fed (seeded randn), the scaled model
input, the noise the scheduler drew (randn_tensor is wrapped to record it; the draws come
from torch.Generator().manual_seed(noise_seed)) and prev_sample; and add_noise on a batch
of two. Reruns give identical bytes (save_canonical, one torch thread).
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save_canonical, save_json  # noqa: E402

import diffusers  # noqa: E402
import diffusers.schedulers.scheduling_consistency_models as cm_module  # noqa: E402
from diffusers import CMStochasticIterativeScheduler  # noqa: E402

torch.set_num_threads(1)

OUT = os.path.join("tests", "fixtures", "golden")
SHAPE = (1, 3, 8, 8)
CLASS = {"_class_name": "CMStochasticIterativeScheduler"}
# openai/diffusers-cd_imagenet64_l2 scheduler/scheduler_config.json, verbatim.
IMAGENET64 = {
    "_class_name": "CMStochasticIterativeScheduler",
    "_diffusers_version": "0.17.0.dev0",
    "clip_denoised": True,
    "num_train_timesteps": 40,
    "rho": 7.0,
    "s_noise": 1.0,
    "sigma_data": 0.5,
    "sigma_max": 80.0,
    "sigma_min": 0.002,
}

CASES = [
    # name, config, num_inference_steps or None, custom timesteps or None
    ("cm_imagenet64_1step", IMAGENET64, 1, None),
    ("cm_imagenet64_2step", IMAGENET64, 2, None),
    ("cm_imagenet64_custom_22_0", IMAGENET64, None, [22, 0]),
    ("cm_151_4step", {**CLASS, "num_train_timesteps": 151}, 4, None),
    ("cm_snoise_noclip_7step", {**CLASS, "num_train_timesteps": 40, "s_noise": 1.007, "clip_denoised": False,
                                "rho": 5.0, "sigma_min": 0.01, "sigma_max": 40.0, "sigma_data": 0.7}, 7, None),
    ("cm_40_40step", {**CLASS, "num_train_timesteps": 40}, 40, None),
]


def as_list(x):
    return [float(v) for v in x.detach().cpu().numpy().astype(np.float64).tolist()]


def run_case(index, name, config, steps, custom, tensors):
    sched = CMStochasticIterativeScheduler.from_config(config)
    if custom is None:
        sched.set_timesteps(steps)
    else:
        sched.set_timesteps(timesteps=custom)
    seed, noise_seed = 1000 + index, 2000 + index
    gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(noise_seed)
    sample = torch.randn(SHAPE, generator=gen) * sched.init_noise_sigma
    start = sample.clone()
    recorded = []
    orig = cm_module.randn_tensor

    def wrapper(*args, **kwargs):
        out = orig(*args, **kwargs)
        recorded.append(out.clone())
        return out

    cm_module.randn_tensor = wrapper
    model_outputs, scaled, prevs = [], [], []
    try:
        for t in sched.timesteps:
            # Model outputs of the network's scale (the clean estimate is then clipped in places).
            mo = torch.randn(SHAPE, generator=gen) * 1.5
            x = sched.scale_model_input(sample, t)
            sample = sched.step(mo, t, sample, generator=noise_gen).prev_sample
            model_outputs.append(mo)
            scaled.append(x.clone())
            prevs.append(sample.clone())
    finally:
        cm_module.randn_tensor = orig
    tensors[f"{name}.sample"] = start
    tensors[f"{name}.model_output"] = torch.stack(model_outputs)
    tensors[f"{name}.scaled_input"] = torch.stack(scaled)
    tensors[f"{name}.prev_sample"] = torch.stack(prevs)
    if recorded:
        tensors[f"{name}.noise"] = torch.stack(recorded)

    # add_noise before any step (timesteps looked up by value), on a batch of two.
    fresh = CMStochasticIterativeScheduler.from_config(config)
    if custom is None:
        fresh.set_timesteps(steps)
    else:
        fresh.set_timesteps(timesteps=custom)
    g = torch.Generator().manual_seed(3000 + index)
    original = torch.randn((2,) + SHAPE[1:], generator=g)
    noise = torch.randn((2,) + SHAPE[1:], generator=g)
    picks = [0, len(fresh.timesteps) - 1]
    timesteps = fresh.timesteps[picks]
    tensors[f"{name}.add_noise.original"] = original
    tensors[f"{name}.add_noise.noise"] = noise
    tensors[f"{name}.add_noise.noisy"] = fresh.add_noise(original, noise, timesteps)
    return {
        "config": config,
        "num_inference_steps": steps,
        "custom_timesteps": custom,
        "noise_seed": noise_seed,
        "noise_draws": len(recorded),
        "timesteps": as_list(sched.timesteps.to(torch.float64)),
        "sigmas": as_list(sched.sigmas.to(torch.float64)),
        "init_noise_sigma": float(sched.init_noise_sigma),
        "add_noise_timesteps": as_list(timesteps.to(torch.float64)),
    }


def main():
    tensors = {}
    cases = {}
    for i, (name, config, steps, custom) in enumerate(CASES):
        cases[name] = run_case(i, name, config, steps, custom, tensors)
    meta = {
        "diffusers": diffusers.__version__,
        "torch": torch.__version__.split("+")[0],
        "shape": list(SHAPE),
        "cases": cases,
    }
    save_canonical(os.path.join(OUT, "cm_stochastic_iterative.safetensors"), tensors)
    save_json(os.path.join(OUT, "cm_stochastic_iterative.json"), meta)
    size = os.path.getsize(os.path.join(OUT, "cm_stochastic_iterative.safetensors"))
    print(f"{len(cases)} cases, {len(tensors)} tensors, {size} bytes")


if __name__ == "__main__":
    main()
