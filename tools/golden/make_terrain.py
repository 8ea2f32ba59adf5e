"""Golden data for examples/terrain: the pretrained terrain consistency model run by onnxruntime.

Run by hand (never by tests), from the repository root, after tools/fetch-terrain.sh
(needs `pip install onnx onnxruntime`, diffusers and torch):

    python3 tools/golden/make_terrain.py [path/to/terrain_consistency_unet_difficulty100.onnx]

The ONNX file (adaptive-terrain-diffusion 0.4.2) is the consistency function
D(noisy, sigma, difficulty). Like examples/terrain/build.rs, this script also cuts it down to
the network F(c_in x, 250 ln sigma, difficulty) (onnx.utils.extract_model between the
tensors `mul_22`, `mul_27`, `difficulty` and `conv2d_195`), and records, for one 128x128
sample with seed SEED and difficulty DIFFICULTY:

- `noise`: torch.randn((1, 1, 128, 128), generator=torch.Generator().manual_seed(SEED));
- `call.*`: one denoising call at sigma_max: the network's input and output, and D of the
  full graph on the same noisy sample;
- `steps1.*`, `steps2.*`: whole samples of diffusers' CMStochasticIterativeScheduler
  (num_train_timesteps 40, the package's sigma_min 0.002, sigma_max 80, sigma_data 0.5)
  with the cut network under onnxruntime, as diffusers' ConsistencyModelPipeline runs them
  (one generator for the initial noise and the step noise): per step the model output and
  prev_sample, and the noise drawn.

It checks that the scheduler plus the cut network reproduces the full graph's D (the
package's own one-step sampler, TerrainGenerator._sample_native, on the same noise) and
prints the difference. onnxruntime runs on one thread with its graph optimisations, as the
package configures it. Reruns give identical bytes (save_canonical).
"""
import os
import sys
import tempfile

import numpy as np
import onnx
import onnx.utils
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save_canonical, save_json  # noqa: E402

import diffusers  # noqa: E402
import diffusers.schedulers.scheduling_consistency_models as cm_module  # noqa: E402
from diffusers import CMStochasticIterativeScheduler  # noqa: E402

torch.set_num_threads(1)

OUT = os.path.join("tests", "fixtures", "golden")
DEFAULT_ONNX = os.path.join(".terrain", "terrain_consistency_unet_difficulty100.onnx")
SEED = 7
DIFFICULTY = 60  # the package's 1..100 scale; the model gets (d - 1) / 99
SIZE = 128
CONFIG = {
    "_class_name": "CMStochasticIterativeScheduler",
    "num_train_timesteps": 40,
    "sigma_min": 0.002,
    "sigma_max": 80.0,
    "sigma_data": 0.5,
    "s_noise": 1.0,
    "rho": 7.0,
    "clip_denoised": True,
}


def session(path):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_ONNX
    full = session(path)
    with tempfile.TemporaryDirectory() as tmp:
        cut_path = os.path.join(tmp, "unet.onnx")
        onnx.utils.extract_model(path, cut_path, ["mul_22", "mul_27", "difficulty"], ["conv2d_195"])
        net = session(cut_path)

    label = np.array([(DIFFICULTY - 1) / 99], dtype=np.float32)

    def network(x, t):
        feeds = {"mul_22": x.numpy().astype(np.float32),
                 "mul_27": np.asarray([float(t)], dtype=np.float32),
                 "difficulty": label}
        return torch.from_numpy(net.run(["conv2d_195"], feeds)[0])

    def consistency(noisy, sigma):
        feeds = {"noisy": noisy.numpy().astype(np.float32),
                 "sigma": np.asarray([sigma], dtype=np.float32),
                 "difficulty": label}
        return torch.from_numpy(full.run(["denoised"], feeds)[0])

    tensors = {}
    meta = {
        "diffusers": diffusers.__version__,
        "onnxruntime": ort.__version__,
        "onnx_sha256": "95be54b4a39d58320e187a7ec533351c957f16a00be58773c86074828ee67887",
        "seed": SEED,
        "difficulty": DIFFICULTY,
        "difficulty_label": float(label[0]),
        "config": CONFIG,
    }
    noise = torch.randn((1, 1, SIZE, SIZE), generator=torch.Generator().manual_seed(SEED))
    tensors["noise"] = noise

    # One denoising call at sigma_max.
    sched = CMStochasticIterativeScheduler.from_config(CONFIG)
    sched.set_timesteps(1)
    t = sched.timesteps[0]
    sample = noise * sched.init_noise_sigma
    x = sched.scale_model_input(sample, t)
    tensors["call.model_input"] = x
    tensors["call.model_output"] = network(x, t)
    tensors["call.denoised"] = consistency(sample, float(sched.sigmas[0]))
    meta["call"] = {"timestep": float(t), "sigma": float(sched.sigmas[0])}

    for steps in (1, 2):
        sched = CMStochasticIterativeScheduler.from_config(CONFIG)
        sched.set_timesteps(steps)
        gen = torch.Generator().manual_seed(SEED)
        sample = torch.randn((1, 1, SIZE, SIZE), generator=gen) * sched.init_noise_sigma
        recorded = []
        orig = cm_module.randn_tensor

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            recorded.append(out.clone())
            return out

        cm_module.randn_tensor = wrapper
        outputs, prevs = [], []
        try:
            for t in sched.timesteps:
                x = sched.scale_model_input(sample, t)
                mo = network(x, t)
                sample = sched.step(mo, t, sample, generator=gen).prev_sample
                outputs.append(mo)
                prevs.append(sample.clone())
        finally:
            cm_module.randn_tensor = orig
        tensors[f"steps{steps}.model_output"] = torch.stack(outputs)
        tensors[f"steps{steps}.prev_sample"] = torch.stack(prevs)
        if recorded:
            tensors[f"steps{steps}.noise"] = torch.stack(recorded)
        meta[f"steps{steps}"] = {
            "timesteps": [float(v) for v in sched.timesteps],
            "sigmas": [float(v) for v in sched.sigmas],
            "noise_draws": len(recorded),
        }

        # The same sample with the full graph: the package's sampler (one step) and its
        # obvious two-step extension, on the same draws.
        x = noise * CONFIG["sigma_max"]
        for i in range(steps):
            d = consistency(x, float(sched.sigmas[i]))
            if i + 1 < steps:
                s_next = float(sched.sigmas[i + 1])
                x = d + recorded[i] * (s_next**2 - CONFIG["sigma_min"] ** 2) ** 0.5
        diff = (d - sample).abs().max().item()
        print(f"{steps} step(s): scheduler + network vs full graph: max |diff| {diff:.3e}")
        assert diff < 1e-4, diff
        meta[f"steps{steps}"]["full_graph_max_abs_diff"] = diff

    save_canonical(os.path.join(OUT, "terrain.safetensors"), tensors)
    save_json(os.path.join(OUT, "terrain.json"), meta)
    size = os.path.getsize(os.path.join(OUT, "terrain.safetensors"))
    print(f"{len(tensors)} tensors, {size} bytes")


if __name__ == "__main__":
    main()
