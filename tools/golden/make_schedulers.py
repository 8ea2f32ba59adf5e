"""Golden data for oxidiff-schedulers: diffusers' schedulers stepped on recorded inputs.

Run by hand (never by tests), from the repository root:

    python3 tools/golden/make_schedulers.py

Writes tests/fixtures/golden/schedulers.safetensors (tensors) and schedulers.json (configs,
timesteps, sigmas, init_noise_sigma). For each case it records the initial sample, per step
the model output it fed (seeded randn, independent of the sample), the scaled model input,
the noise the scheduler drew (randn_tensor is wrapped to record it) and prev_sample.
It also records torch.randn draws for the host re-implementation of torch's CPU generator.
Reruns give identical bytes (save_canonical, one torch thread).
"""
import importlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save_canonical, save_json  # noqa: E402

import diffusers  # noqa: E402
from diffusers import (  # noqa: E402
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)
from scipy import integrate  # noqa: E402

torch.set_num_threads(1)

OUT = os.path.join("tests", "fixtures", "golden")
SHAPE = (1, 4, 8, 8)

# runwayml/stable-diffusion-v1-5 scheduler/scheduler_config.json, verbatim.
SD15 = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}
SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}

CLASSES = {
    "PNDMScheduler": PNDMScheduler,
    "DDIMScheduler": DDIMScheduler,
    "EulerDiscreteScheduler": EulerDiscreteScheduler,
    "EulerAncestralDiscreteScheduler": EulerAncestralDiscreteScheduler,
    "DPMSolverMultistepScheduler": DPMSolverMultistepScheduler,
    "DDPMScheduler": DDPMScheduler,
    "LMSDiscreteScheduler": LMSDiscreteScheduler,
    "HeunDiscreteScheduler": HeunDiscreteScheduler,
    "UniPCMultistepScheduler": UniPCMultistepScheduler,
}
UNIPC = {"_class_name": "UniPCMultistepScheduler"}
DPM = {"_class_name": "DPMSolverMultistepScheduler"}


def case(name, config, steps, switch_to=None, eta=None):
    return dict(name=name, config=config, steps=steps, switch_to=switch_to, eta=eta)


CASES = [
    # PNDM
    case("pndm_sd15", SD15, 10),
    case("pndm_sd2_v", {"_class_name": "PNDMScheduler", **SD_BETAS, "prediction_type": "v_prediction",
                        "skip_prk_steps": True, "steps_offset": 1}, 8),
    case("pndm_prk_linear", {"_class_name": "PNDMScheduler", "skip_prk_steps": False}, 6),
    case("pndm_trailing", {"_class_name": "PNDMScheduler", **SD_BETAS, "skip_prk_steps": True,
                           "timestep_spacing": "trailing", "set_alpha_to_one": True}, 7),
    case("pndm_linspace_prk", {"_class_name": "PNDMScheduler", **SD_BETAS, "skip_prk_steps": False,
                               "timestep_spacing": "linspace"}, 5),
    # DDIM
    case("ddim_sd15_eta0", SD15, 10, switch_to="DDIMScheduler", eta=0.0),
    case("ddim_sd15_eta1", SD15, 8, switch_to="DDIMScheduler", eta=1.0),
    case("ddim_v_zero_snr_trailing", {"_class_name": "DDIMScheduler", **SD_BETAS, "prediction_type": "v_prediction",
                                      "rescale_betas_zero_snr": True, "timestep_spacing": "trailing",
                                      "clip_sample": False, "set_alpha_to_one": False}, 6, eta=0.0),
    case("ddim_default_clip_linspace", {"_class_name": "DDIMScheduler", "timestep_spacing": "linspace"}, 7, eta=0.5),
    case("ddim_thresholding", {"_class_name": "DDIMScheduler", **SD_BETAS, "thresholding": True,
                               "dynamic_thresholding_ratio": 0.9, "sample_max_value": 1.5,
                               "steps_offset": 1}, 5, eta=0.0),
    case("ddim_sample_cosine", {"_class_name": "DDIMScheduler", "beta_schedule": "squaredcos_cap_v2",
                                "prediction_type": "sample", "clip_sample": False}, 5, eta=0.0),
    # Euler
    case("euler_sd15", SD15, 10, switch_to="EulerDiscreteScheduler"),
    case("euler_v_linspace", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS,
                              "prediction_type": "v_prediction"}, 7),
    case("euler_karras", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS, "use_karras_sigmas": True}, 8),
    case("euler_v_zero_snr_trailing", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS,
                                       "prediction_type": "v_prediction", "rescale_betas_zero_snr": True,
                                       "timestep_spacing": "trailing"}, 6),
    case("euler_exponential_sigma_min", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS,
                                         "use_exponential_sigmas": True, "final_sigmas_type": "sigma_min",
                                         "timestep_spacing": "leading", "steps_offset": 1}, 6),
    case("euler_log_linear", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS,
                              "interpolation_type": "log_linear"}, 5),
    case("euler_continuous_v", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS,
                                "prediction_type": "v_prediction", "timestep_type": "continuous"}, 5),
    case("euler_sample_linear", {"_class_name": "EulerDiscreteScheduler", "prediction_type": "sample"}, 5),
    # Euler ancestral
    case("euler_a_sd15", SD15, 10, switch_to="EulerAncestralDiscreteScheduler"),
    case("euler_a_v_trailing", {"_class_name": "EulerAncestralDiscreteScheduler", **SD_BETAS,
                                "prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 6),
    case("euler_a_linear_linspace", {"_class_name": "EulerAncestralDiscreteScheduler"}, 7),
    # DPM-Solver++ (multistep)
    case("dpm_sd15", SD15, 10, switch_to="DPMSolverMultistepScheduler"),
    case("dpm_karras", {**DPM, **SD_BETAS, "use_karras_sigmas": True}, 12),
    case("dpm_order3_v_trailing_sigma_min_clipped", {**DPM, **SD_BETAS, "solver_order": 3,
                                                     "prediction_type": "v_prediction",
                                                     "timestep_spacing": "trailing",
                                                     "final_sigmas_type": "sigma_min",
                                                     "lambda_min_clipped": -2.5}, 16),
    case("dpm_order3_lower_order_final", {**DPM, "solver_order": 3}, 8),
    case("dpm_sde_karras_heun", {**DPM, **SD_BETAS, "algorithm_type": "sde-dpmsolver++",
                                 "use_karras_sigmas": True, "solver_type": "heun"}, 8),
    case("dpm_heun_leading_euler_at_final", {**DPM, **SD_BETAS, "solver_type": "heun",
                                             "timestep_spacing": "leading", "steps_offset": 1,
                                             "euler_at_final": True, "lower_order_final": False,
                                             "final_sigmas_type": "sigma_min"}, 6),
    case("dpm_order1_sample_exponential_thresholding", {**DPM, "solver_order": 1, "prediction_type": "sample",
                                                        "use_exponential_sigmas": True, "thresholding": True,
                                                        "dynamic_thresholding_ratio": 0.9,
                                                        "sample_max_value": 1.5}, 5),
    case("dpm_sde_order3_v", {**DPM, **SD_BETAS, "algorithm_type": "sde-dpmsolver++", "solver_order": 3,
                              "prediction_type": "v_prediction", "lower_order_final": False,
                              "final_sigmas_type": "sigma_min"}, 7),
    # DDPM
    case("ddpm_sd15", SD15, 8, switch_to="DDPMScheduler"),
    case("ddpm_v_small_log_trailing", {"_class_name": "DDPMScheduler", **SD_BETAS, "prediction_type": "v_prediction",
                                       "variance_type": "fixed_small_log", "timestep_spacing": "trailing",
                                       "clip_sample": False}, 6),
    case("ddpm_default_clip_large_linspace", {"_class_name": "DDPMScheduler", "variance_type": "fixed_large",
                                              "timestep_spacing": "linspace"}, 5),
    # LMS
    case("lms_sd15", SD15, 10, switch_to="LMSDiscreteScheduler"),
    case("lms_karras_v", {"_class_name": "LMSDiscreteScheduler", **SD_BETAS, "prediction_type": "v_prediction",
                          "use_karras_sigmas": True}, 8),
    case("lms_exponential_leading_sample", {"_class_name": "LMSDiscreteScheduler", "prediction_type": "sample",
                                            "use_exponential_sigmas": True, "timestep_spacing": "leading",
                                            "steps_offset": 1}, 6),
    # Heun (2 n - 1 evaluations)
    case("heun_sd15", SD15, 6, switch_to="HeunDiscreteScheduler"),
    case("heun_karras_v", {"_class_name": "HeunDiscreteScheduler", **SD_BETAS, "prediction_type": "v_prediction",
                           "use_karras_sigmas": True}, 5),
    # Heun's own defaults: beta_start 0.00085, beta_end 0.012, linear.
    case("heun_defaults_clip_sample_trailing", {"_class_name": "HeunDiscreteScheduler", "clip_sample": True,
                                                "prediction_type": "sample", "timestep_spacing": "trailing"}, 4),
    # UniPC
    case("unipc_sd15", SD15, 10, switch_to="UniPCMultistepScheduler"),
    case("unipc_bh1_order3_karras", {**UNIPC, **SD_BETAS, "solver_type": "bh1", "solver_order": 3,
                                     "use_karras_sigmas": True}, 8),
    case("unipc_v_trailing_order3_sigma_min", {**UNIPC, **SD_BETAS, "prediction_type": "v_prediction",
                                               "timestep_spacing": "trailing", "solver_order": 3,
                                               "lower_order_final": False, "final_sigmas_type": "sigma_min",
                                               "disable_corrector": [2]}, 7),
    case("unipc_noise_pred_leading", {**UNIPC, **SD_BETAS, "predict_x0": False, "timestep_spacing": "leading",
                                      "steps_offset": 1, "final_sigmas_type": "sigma_min"}, 6),
]

# Where each scheduler module looks up randn_tensor.
MODULES = [
    "diffusers.schedulers.scheduling_ddim",
    "diffusers.schedulers.scheduling_euler_discrete",
    "diffusers.schedulers.scheduling_euler_ancestral_discrete",
    "diffusers.schedulers.scheduling_dpmsolver_multistep",
    "diffusers.schedulers.scheduling_ddpm",
]


def record_randn(recorded):
    originals = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        orig = mod.randn_tensor
        originals[name] = orig

        def wrapper(*args, _orig=orig, **kwargs):
            out = _orig(*args, **kwargs)
            recorded.append(out.clone())
            return out

        mod.randn_tensor = wrapper
    return originals


def build(c):
    cls = CLASSES[c["config"]["_class_name"]]
    sched = cls.from_config(c["config"])
    if c["switch_to"]:
        # What `--scheduler` does: the new class from the loaded scheduler's config.
        sched = CLASSES[c["switch_to"]].from_config(sched.config)
    return sched


def as_list(x):
    return [float(v) for v in x.detach().cpu().numpy().astype(np.float64).tolist()]


def lms_coefficients(sched):
    """Per step, diffusers' get_lms_coefficient (quad of an f32 integrand) and the same
    quadrature on f64 sigmas, for the order step() uses (min(i + 1, 4))."""
    sig = [float(s) for s in sched.sigmas]

    def f64_coefficient(order, t, current):
        def basis(tau):
            prod = 1.0
            for k in range(order):
                if k != current:
                    prod *= (tau - sig[t - k]) / (sig[t - current] - sig[t - k])
            return prod

        return integrate.quad(basis, sig[t], sig[t + 1], epsrel=1e-13, epsabs=0)[0]

    out = []
    for i in range(len(sched.timesteps)):
        order = min(i + 1, 4)
        out.append({
            "diffusers": [float(sched.get_lms_coefficient(order, i, j)) for j in range(order)],
            "f64": [f64_coefficient(order, i, j) for j in range(order)],
        })
    return out


def run_case(index, c, tensors):
    sched = build(c)
    sched.set_timesteps(c["steps"])
    extra = {"lms_coefficients": lms_coefficients(sched)} if isinstance(sched, LMSDiscreteScheduler) else {}
    seed = 1000 + index
    noise_seed = 2000 + index
    gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(noise_seed)
    init_sigma = float(sched.init_noise_sigma)
    sample = torch.randn(SHAPE, generator=gen) * sched.init_noise_sigma
    start = sample.clone()

    recorded = []
    originals = record_randn(recorded)
    model_outputs, scaled, prevs = [], [], []
    try:
        for t in sched.timesteps:
            mo = torch.randn(SHAPE, generator=gen)
            x = sched.scale_model_input(sample, t)
            kwargs = {}
            if isinstance(sched, DDIMScheduler):
                kwargs["eta"] = c["eta"]
            if isinstance(sched, (DDIMScheduler, EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                                  DPMSolverMultistepScheduler, DDPMScheduler)):
                kwargs["generator"] = noise_gen
            sample = sched.step(mo, t, sample, **kwargs).prev_sample
            model_outputs.append(mo)
            scaled.append(x.clone())
            prevs.append(sample.clone())
    finally:
        for name, orig in originals.items():
            importlib.import_module(name).randn_tensor = orig

    n = c["name"]
    tensors[f"{n}.sample"] = start
    tensors[f"{n}.model_output"] = torch.stack(model_outputs)
    tensors[f"{n}.scaled_input"] = torch.stack(scaled)
    tensors[f"{n}.prev_sample"] = torch.stack(prevs)
    tensors[f"{n}.alphas_cumprod"] = sched.alphas_cumprod.to(torch.float32)
    if recorded:
        tensors[f"{n}.noise"] = torch.stack(recorded)
    sigmas = getattr(sched, "sigmas", None)
    return {
        "config": c["config"],
        "switch_to": c["switch_to"],
        "class": type(sched).__name__,
        "num_inference_steps": c["steps"],
        "eta": c["eta"],
        "noise_seed": noise_seed if recorded else None,
        "noise_draws": len(recorded),
        "timesteps": as_list(sched.timesteps.to(torch.float64)),
        "sigmas": as_list(sigmas.to(torch.float64)) if sigmas is not None else None,
        "init_noise_sigma": init_sigma,
        **extra,
    }


def rng_reference(tensors):
    """torch.randn draws: a block of 16s, a ragged count, small counts (cached Box-Muller half)."""
    g = torch.Generator().manual_seed(42)
    draws = [(1, 4, 8, 8), (1, 3, 5, 7), (1, 1, 1, 5), (1, 1, 1, 5), (1, 1, 4, 4)]
    for i, shape in enumerate(draws):
        tensors[f"rng.seed42.{i}"] = torch.randn(shape, generator=g)
    g = torch.Generator().manual_seed(0)
    tensors["rng.seed0.latents"] = torch.randn((1, 4, 64, 64), generator=g)
    g = torch.Generator().manual_seed(2**40 + 7)
    tensors["rng.seed_2p40p7"] = torch.randn((1, 4, 4, 4), generator=g)
    return {
        "seed42": [list(s) for s in draws],
        "seed0_latents": [1, 4, 64, 64],
        "seed_2p40p7": [1, 4, 4, 4],
    }


def add_noise_reference(tensors):
    """add_noise on a batch of two at two different timesteps, per scheduler class."""
    out = {}
    g = torch.Generator().manual_seed(3000)
    for c in CASES:
        if c["name"] not in ("pndm_sd15", "ddim_sd15_eta0", "euler_sd15", "euler_a_sd15", "euler_karras",
                             "dpm_sd15", "dpm_karras", "ddpm_sd15", "lms_sd15", "heun_sd15", "unipc_sd15"):
            continue
        sched = build(c)
        sched.set_timesteps(c["steps"])
        original = torch.randn((2,) + SHAPE[1:], generator=g)
        noise = torch.randn((2,) + SHAPE[1:], generator=g)
        timesteps = sched.timesteps[[1, 3]]
        n = c["name"]
        tensors[f"add_noise.{n}.original"] = original
        tensors[f"add_noise.{n}.noise"] = noise
        tensors[f"add_noise.{n}.noisy"] = sched.add_noise(original, noise, timesteps)
        out[n] = as_list(timesteps.to(torch.float64))
    return out


def main():
    tensors = {}
    cases = {}
    for i, c in enumerate(CASES):
        cases[c["name"]] = run_case(i, c, tensors)
    meta = {
        "diffusers": diffusers.__version__,
        "torch": torch.__version__.split("+")[0],
        "shape": list(SHAPE),
        "cases": cases,
        "rng": rng_reference(tensors),
        "add_noise": add_noise_reference(tensors),
    }
    save_canonical(os.path.join(OUT, "schedulers.safetensors"), tensors)
    save_json(os.path.join(OUT, "schedulers.json"), meta)
    size = os.path.getsize(os.path.join(OUT, "schedulers.safetensors"))
    print(f"{len(cases)} cases, {len(tensors)} tensors, {size} bytes")


if __name__ == "__main__":
    main()
