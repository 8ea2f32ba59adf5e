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
    DEISMultistepScheduler,
    DPMSolverMultistepScheduler,
    DPMSolverSinglestepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    TCDScheduler,
    UniPCMultistepScheduler,
)
from scipy import integrate  # noqa: E402

torch.set_num_threads(1)

OUT = os.path.join("tests", "fixtures", "golden")
SHAPE = (1, 4, 4, 4)

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
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
    "FlowMatchHeunDiscreteScheduler": FlowMatchHeunDiscreteScheduler,
    "KDPM2DiscreteScheduler": KDPM2DiscreteScheduler,
    "KDPM2AncestralDiscreteScheduler": KDPM2AncestralDiscreteScheduler,
    "DPMSolverSinglestepScheduler": DPMSolverSinglestepScheduler,
    "DEISMultistepScheduler": DEISMultistepScheduler,
    "LCMScheduler": LCMScheduler,
    "TCDScheduler": TCDScheduler,
}
UNIPC = {"_class_name": "UniPCMultistepScheduler"}
DPM = {"_class_name": "DPMSolverMultistepScheduler"}
DPMS = {"_class_name": "DPMSolverSinglestepScheduler"}
DEIS = {"_class_name": "DEISMultistepScheduler"}
FM = {"_class_name": "FlowMatchEulerDiscreteScheduler"}
KDPM2 = {"_class_name": "KDPM2DiscreteScheduler"}
KDPM2A = {"_class_name": "KDPM2AncestralDiscreteScheduler"}
# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json, verbatim.
FLUX = {**FM, "_diffusers_version": "0.30.0.dev0", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": True}
# stabilityai/stable-diffusion-3-medium-diffusers scheduler/scheduler_config.json, verbatim.
SD3 = {**FM, "_diffusers_version": "0.29.0.dev0", "num_train_timesteps": 1000, "shift": 3.0}


def calculate_shift(image_seq_len, config):
    """diffusers' Flux pipeline: mu from the image token count and the scheduler config."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as shift
    return shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                 config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def case(name, config, steps, switch_to=None, eta=None, flux_sigmas=False, image_seq_len=None, mu=None,
         custom_timesteps=False):
    """`flux_sigmas`: pass `sigmas=np.linspace(1, 1/n, n)` as the Flux pipeline does;
    `image_seq_len`: pass `mu=calculate_shift(image_seq_len)`; `mu`: pass it as given;
    `custom_timesteps`: pass `timesteps=np.linspace(1000, 1000/n, n)`."""
    return dict(name=name, config=config, steps=steps, switch_to=switch_to, eta=eta,
                flux_sigmas=flux_sigmas, image_seq_len=image_seq_len, mu=mu, custom_timesteps=custom_timesteps)


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
    # bh1 needs final_sigmas_type sigma_min: see refused_configs().
    case("unipc_bh1_order3_karras", {**UNIPC, **SD_BETAS, "solver_type": "bh1", "solver_order": 3,
                                     "use_karras_sigmas": True, "final_sigmas_type": "sigma_min"}, 8),
    case("unipc_bh1_order2_noise_pred_sigma_min", {**UNIPC, **SD_BETAS, "solver_type": "bh1", "predict_x0": False,
                                                   "final_sigmas_type": "sigma_min"}, 6),
    case("unipc_v_trailing_order3_sigma_min", {**UNIPC, **SD_BETAS, "prediction_type": "v_prediction",
                                               "timestep_spacing": "trailing", "solver_order": 3,
                                               "lower_order_final": False, "final_sigmas_type": "sigma_min",
                                               "disable_corrector": [2]}, 7),
    case("unipc_noise_pred_leading", {**UNIPC, **SD_BETAS, "predict_x0": False, "timestep_spacing": "leading",
                                      "steps_offset": 1, "final_sigmas_type": "sigma_min"}, 6),
    # Flow matching (timesteps = sigmas * 1000, no input scaling)
    case("fm_euler_sd3", SD3, 10),
    case("fm_euler_flux_dev", FLUX, 10, flux_sigmas=True, image_seq_len=1024),
    case("fm_euler_dynamic_linear_no_sigmas", {**FLUX, "time_shift_type": "linear"}, 10, mu=0.8),
    case("fm_euler_custom_sigmas_static_shift", SD3, 10, flux_sigmas=True),
    case("fm_euler_karras_shift_terminal", {**SD3, "use_karras_sigmas": True, "shift_terminal": 0.1}, 10),
    case("fm_euler_exponential_inverted", {**FM, "shift": 2.0, "use_exponential_sigmas": True,
                                           "invert_sigmas": True}, 10),
    case("fm_euler_beta_stochastic", {**SD3, "use_beta_sigmas": True, "stochastic_sampling": True}, 10),
    case("fm_euler_flux_beta_dynamic", {**FLUX, "use_beta_sigmas": True}, 10, flux_sigmas=True,
         image_seq_len=4096),
    case("fm_euler_custom_timesteps", SD3, 10, custom_timesteps=True),
    case("fm_euler_custom_timesteps_and_sigmas_dynamic", FLUX, 10, flux_sigmas=True, image_seq_len=4096,
         custom_timesteps=True),
    case("fm_heun_sd3", {**SD3, "_class_name": "FlowMatchHeunDiscreteScheduler"}, 10),
    case("fm_heun_default", {"_class_name": "FlowMatchHeunDiscreteScheduler"}, 10),
    # KDPM2 (2 n - 1 evaluations, midpoint timesteps interleaved)
    case("kdpm2_sd15", SD15, 10, switch_to="KDPM2DiscreteScheduler"),
    case("kdpm2_karras_v", {**KDPM2, **SD_BETAS, "use_karras_sigmas": True, "prediction_type": "v_prediction"}, 8),
    # KDPM2's own defaults: beta_start 0.00085, beta_end 0.012, linear.
    case("kdpm2_exponential_leading", {**KDPM2, "use_exponential_sigmas": True, "timestep_spacing": "leading",
                                       "steps_offset": 1}, 6),
    case("kdpm2_beta_trailing", {**KDPM2, **SD_BETAS, "use_beta_sigmas": True, "timestep_spacing": "trailing"}, 6),
    case("kdpm2_a_sd15", SD15, 10, switch_to="KDPM2AncestralDiscreteScheduler"),
    case("kdpm2_a_karras_v", {**KDPM2A, **SD_BETAS, "use_karras_sigmas": True,
                              "prediction_type": "v_prediction"}, 8),
    case("kdpm2_a_beta_leading", {**KDPM2A, "use_beta_sigmas": True, "timestep_spacing": "leading",
                                  "steps_offset": 1}, 6),
    case("kdpm2_a_trailing", {**KDPM2A, **SD_BETAS, "timestep_spacing": "trailing"}, 7),
    # Beta sigmas (Beta(0.6, 0.6) quantiles) in the classes that have them
    case("euler_beta_v", {"_class_name": "EulerDiscreteScheduler", **SD_BETAS, "use_beta_sigmas": True,
                          "prediction_type": "v_prediction"}, 7),
    case("heun_beta", {"_class_name": "HeunDiscreteScheduler", **SD_BETAS, "use_beta_sigmas": True}, 5),
    case("lms_beta", {"_class_name": "LMSDiscreteScheduler", **SD_BETAS, "use_beta_sigmas": True}, 6),
    case("dpm_beta_sde", {**DPM, **SD_BETAS, "use_beta_sigmas": True, "algorithm_type": "sde-dpmsolver++"}, 8),
    case("unipc_beta", {**UNIPC, **SD_BETAS, "use_beta_sigmas": True}, 7),
    # DPM-Solver++ singlestep (groups of 1, 2(, 3) steps from one start sample)
    case("dpm_single_sd15", SD15, 10, switch_to="DPMSolverSinglestepScheduler"),
    case("dpm_single_order3_karras_v", {**DPMS, **SD_BETAS, "solver_order": 3, "use_karras_sigmas": True,
                                        "prediction_type": "v_prediction"}, 8),
    case("dpm_single_sde_heun_sigma_min", {**DPMS, **SD_BETAS, "algorithm_type": "sde-dpmsolver++",
                                           "solver_type": "heun", "final_sigmas_type": "sigma_min"}, 6),
    case("dpm_single_order3_heun_exponential_sample_thresholding",
         {**DPMS, "solver_order": 3, "solver_type": "heun", "use_exponential_sigmas": True,
          "prediction_type": "sample", "thresholding": True, "dynamic_thresholding_ratio": 0.9,
          "sample_max_value": 1.5, "final_sigmas_type": "sigma_min"}, 9),
    case("dpm_single_clipped_beta_order1", {**DPMS, **SD_BETAS, "solver_order": 1, "use_beta_sigmas": True}, 5),
    case("dpm_single_clipped_lambda", {**DPMS, **SD_BETAS, "lambda_min_clipped": -3.0}, 6),
    case("dpm_single_sde_order3", {**DPMS, **SD_BETAS, "algorithm_type": "sde-dpmsolver++", "solver_order": 3}, 7),
    # DEIS (log-rho, noise-prediction history; ends on the smallest training sigma)
    case("deis_sd15", SD15, 10, switch_to="DEISMultistepScheduler"),
    case("deis_order3_v_karras", {**DEIS, **SD_BETAS, "solver_order": 3, "prediction_type": "v_prediction",
                                  "use_karras_sigmas": True}, 8),
    case("deis_order3_leading_no_lower_final", {**DEIS, **SD_BETAS, "solver_order": 3, "timestep_spacing": "leading",
                                                "steps_offset": 1, "lower_order_final": False}, 7),
    case("deis_trailing_sample_thresholding_exponential", {**DEIS, "prediction_type": "sample", "thresholding": True,
                                                           "dynamic_thresholding_ratio": 0.9, "sample_max_value": 1.5,
                                                           "timestep_spacing": "trailing",
                                                           "use_exponential_sigmas": True}, 6),
    case("deis_order1_beta", {**DEIS, **SD_BETAS, "solver_order": 1, "use_beta_sigmas": True}, 5),
    # LCM and TCD (timesteps from the 50-step distillation schedule)
    case("lcm_sd15", SD15, 4, switch_to="LCMScheduler"),
    case("lcm_v_orig25_scaling5", {"_class_name": "LCMScheduler", **SD_BETAS, "prediction_type": "v_prediction",
                                   "original_inference_steps": 25, "timestep_scaling": 5.0}, 6),
    # LCM's own defaults: scaled_linear betas from 0.00085 to 0.012.
    case("lcm_defaults_sample_clip", {"_class_name": "LCMScheduler", "prediction_type": "sample",
                                      "clip_sample": True, "set_alpha_to_one": False}, 5),
    case("lcm_v_zero_snr_thresholding", {"_class_name": "LCMScheduler", "prediction_type": "v_prediction",
                                         "rescale_betas_zero_snr": True, "thresholding": True,
                                         "dynamic_thresholding_ratio": 0.9, "sample_max_value": 1.5}, 6),
    case("tcd_sd15_gamma03", SD15, 4, switch_to="TCDScheduler", eta=0.3),
    case("tcd_v_gamma0", {"_class_name": "TCDScheduler", **SD_BETAS, "prediction_type": "v_prediction"}, 6, eta=0.0),
    case("tcd_defaults_sample_gamma1_orig20", {"_class_name": "TCDScheduler", "prediction_type": "sample",
                                               "original_inference_steps": 20}, 5, eta=1.0),
]

# Every case again at 4 and 10 steps (the minimum).
SMALL = (1, 4, 4, 4)


def with_step_variants(cases):
    """Seeds follow `seed_index`: a case's position in the list above, 500 on for the variants,
    so adding cases leaves the data of the others unchanged."""
    out = [{**c, "seed_index": i} for i, c in enumerate(cases)]
    for c in cases:
        for n in (4, 10):
            if n != c["steps"]:
                out.append({**c, "name": f"{c['name']}_s{n}", "steps": n, "shape": SMALL,
                            "seed_index": 500 + len(out) - len(cases)})
    return out


CASES = with_step_variants(CASES)

# Where each scheduler module looks up randn_tensor.
MODULES = [
    "diffusers.schedulers.scheduling_ddim",
    "diffusers.schedulers.scheduling_euler_discrete",
    "diffusers.schedulers.scheduling_euler_ancestral_discrete",
    "diffusers.schedulers.scheduling_dpmsolver_multistep",
    "diffusers.schedulers.scheduling_ddpm",
    "diffusers.schedulers.scheduling_flow_match_euler_discrete",
    "diffusers.schedulers.scheduling_k_dpm_2_ancestral_discrete",
    "diffusers.schedulers.scheduling_lcm",
    "diffusers.schedulers.scheduling_dpmsolver_singlestep",
    "diffusers.schedulers.scheduling_tcd",
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


def timestep_kwargs(c):
    """The keyword arguments of set_timesteps beyond the step count, as the pipelines pass them."""
    kwargs = {}
    n = c["steps"]
    if c["flux_sigmas"]:
        kwargs["sigmas"] = np.linspace(1.0, 1 / n, n)
    if c["image_seq_len"] is not None:
        kwargs["mu"] = calculate_shift(c["image_seq_len"], c["config"])
    if c["mu"] is not None:
        kwargs["mu"] = c["mu"]
    if c["custom_timesteps"]:
        kwargs["timesteps"] = np.linspace(1000.0, 1000 / n, n)
    return kwargs


def run_case(index, c, tensors):
    sched = build(c)
    ts_kwargs = timestep_kwargs(c)
    sched.set_timesteps(c["steps"], **ts_kwargs)
    shape = c.get("shape", SHAPE)
    extra = {"lms_coefficients": lms_coefficients(sched)} if isinstance(sched, LMSDiscreteScheduler) else {}
    seed = 1000 + c["seed_index"]
    noise_seed = 2000 + c["seed_index"]
    gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(noise_seed)
    init = getattr(sched, "init_noise_sigma", 1.0)  # flow matching has none (unit noise)
    init_sigma = float(init)
    sample = torch.randn(shape, generator=gen) * init
    start = sample.clone()

    recorded = []
    originals = record_randn(recorded)
    model_outputs, scaled, prevs = [], [], []
    try:
        for t in sched.timesteps:
            mo = torch.randn(shape, generator=gen)
            x = sched.scale_model_input(sample, t) if hasattr(sched, "scale_model_input") else sample
            kwargs = {}
            if isinstance(sched, (DDIMScheduler, TCDScheduler)):
                kwargs["eta"] = c["eta"]
            if isinstance(sched, (DDIMScheduler, EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                                  DPMSolverMultistepScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler,
                                  KDPM2AncestralDiscreteScheduler, LCMScheduler, TCDScheduler,
                                  DPMSolverSinglestepScheduler)):
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
    if hasattr(sched, "alphas_cumprod"):
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
        "set_timesteps": {k: (as_list(torch.tensor(v)) if k in ("sigmas", "timesteps") else float(v)) for k, v in ts_kwargs.items()},
        "image_seq_len": c["image_seq_len"],
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
                             "dpm_sd15", "dpm_karras", "ddpm_sd15", "lms_sd15", "heun_sd15", "unipc_sd15",
                             "fm_euler_sd3", "fm_euler_flux_dev", "kdpm2_sd15", "kdpm2_a_sd15",
                             "lcm_sd15", "tcd_sd15_gamma03", "dpm_single_sd15", "deis_sd15"):
            continue
        sched = build(c)
        sched.set_timesteps(c["steps"], **timestep_kwargs(c))
        original = torch.randn((2,) + SHAPE[1:], generator=g)
        noise = torch.randn((2,) + SHAPE[1:], generator=g)
        timesteps = sched.timesteps[[1, 3]]
        n = c["name"]
        tensors[f"add_noise.{n}.original"] = original
        tensors[f"add_noise.{n}.noise"] = noise
        if hasattr(sched, "add_noise"):
            tensors[f"add_noise.{n}.noisy"] = sched.add_noise(original, noise, timesteps)
        else:  # flow matching: scale_noise(sample, timestep, noise)
            tensors[f"add_noise.{n}.noisy"] = sched.scale_noise(original, timesteps, noise)
        out[n] = as_list(timesteps.to(torch.float64))
    return out


def refused_configs():
    """Configs that oxidiff refuses because diffusers has no finite last step for them: UniPC
    with a zero final sigma and bh1 or noise prediction. Checked here to give NaN/inf (or a
    singular solve) in diffusers, so the refusal stays tied to diffusers' behaviour."""
    out = []
    for extra in ({"solver_type": "bh1"}, {"solver_type": "bh1", "solver_order": 3},
                  {"solver_type": "bh1", "solver_order": 1}, {"predict_x0": False}):
        config = {**UNIPC, **SD_BETAS, **extra}
        sched = UniPCMultistepScheduler.from_config(config)
        sched.set_timesteps(6)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SMALL, generator=g)
        try:
            for t in sched.timesteps:
                x = sched.step(torch.randn(SMALL, generator=g), t, x).prev_sample
            outcome = "finite" if bool(torch.isfinite(x).all()) else "non-finite"
        except RuntimeError as e:  # torch.linalg.solve: singular matrix
            outcome = type(e).__name__
        assert outcome != "finite", config
        out.append({"config": config, "diffusers_last_step": outcome})
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
        "refused": refused_configs(),
    }
    save_canonical(os.path.join(OUT, "schedulers.safetensors"), tensors)
    save_json(os.path.join(OUT, "schedulers.json"), meta)
    size = os.path.getsize(os.path.join(OUT, "schedulers.safetensors"))
    print(f"{len(cases)} cases, {len(tensors)} tensors, {size} bytes")


if __name__ == "__main__":
    main()
