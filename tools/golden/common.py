"""Shared helpers for the golden-data scripts (run by hand, never by tests).

Files must be byte-identical across reruns: safetensors 0.8 writes header keys
in a different order each process, so `save_canonical` writes the header itself
with sorted keys and no metadata beyond what is given.
"""
import json
import struct

import numpy as np

_DTYPES = {
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("float64"): "F64",
    np.dtype("int64"): "I64",
    np.dtype("int32"): "I32",
    np.dtype("uint8"): "U8",
}


def save_canonical(path, tensors, metadata=None):
    """Write `tensors` (name -> numpy array or torch tensor) as safetensors, keys sorted."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        arr = tensors[name]
        dtype = None
        if hasattr(arr, "detach"):
            arr = arr.detach().cpu()
            if str(arr.dtype) == "torch.bfloat16":
                # numpy has no bfloat16: keep the raw 16-bit patterns.
                import torch

                arr, dtype = arr.contiguous().view(torch.int16), "BF16"
            arr = arr.numpy()
        arr = np.ascontiguousarray(arr)
        data = arr.tobytes()
        header[name] = {
            "dtype": dtype or _DTYPES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in sorted(metadata.items())}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def save_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
