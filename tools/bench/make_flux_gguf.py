"""Converts a diffusers Flux transformer folder (make_flux_bf16.py's) into one GGUF file the way
city96's converter stores tensors (1-D and small tensors F32, rows that are no whole number of
blocks F16, the rest in `--type`), under diffusers' key names; for the GGUF memory benchmark
(examples/src/bin/flux_load.rs --gguf; never run by tests).

    python tools/bench/make_flux_gguf.py .cache/flux-bf16 .cache/flux-Q8_0.gguf [--type Q8_0]
"""
import argparse
import glob
import os

import gguf
import numpy as np
from safetensors import safe_open


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("out")
    ap.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
    args = ap.parse_args()
    if os.path.isfile(args.out):
        return
    qtype = gguf.GGMLQuantizationType[args.type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(args.out + ".part", arch="flux")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for path in sorted(glob.glob(os.path.join(args.dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                values = f.get_tensor(name).float().numpy()
                if values.ndim == 1 or values.size <= 1024:
                    writer.add_tensor(name, values.astype(np.float32))
                elif values.shape[-1] % block != 0:
                    writer.add_tensor(name, values.astype(np.float16))
                else:
                    data = gguf.quants.quantize(values, qtype)
                    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(args.out + ".part", args.out)
    print(f"wrote {args.out}: {os.path.getsize(args.out) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
