"""Model FLOPs utilisation: achieved model FLOPs against the device's peak.

FLOPs per token follow nanoGPT / PaLM: 6 N (forward and backward over N parameters)
plus 12 L d T for attention (L layers, width d, sequence T). The peak comes from a
table for known GPUs; on a CPU (or an unknown GPU) it is measured once with a short
matmul probe and cached.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

from runner.paths import default_cache_dir

# Dense peak TFLOPS (bf16/fp16 tensor cores; fp32 = TF32 where the GPU has it).
GPU_PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
    "T4": {"bf16": 0.0, "fp16": 65.0, "fp32": 8.1},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
}


def flops_per_token(n_params: int, n_layer: int, n_embd: int, block_size: int) -> float:
    return 6.0 * n_params + 12.0 * n_layer * n_embd * block_size


def model_flops_per_token(config: Any, n_params: int, block_size: int) -> float:
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", 0)
    return flops_per_token(n_params, int(layers), int(width), block_size)


def _probe(dtype_name: str, device: str = "cpu", seconds: float = 0.5) -> float:
    """Sustained matmul FLOP/s for this dtype on this device."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    n = 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    (a @ b).sum().item()  # warm-up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        c = a @ b
        count += 1
    c.sum().item()  # wait for the device
    return 2.0 * n**3 * count / (time.perf_counter() - started)


def peak_flops(device: Any, dtype_name: str) -> float:
    """Peak FLOP/s of one device for the training dtype (fp32, bf16 or fp16)."""
    import torch

    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_TFLOPS.items():
            if key in name and table.get(dtype_name):
                return table[dtype_name] * 1e12
        label = name
    else:
        label = f"{platform.processor() or platform.machine()}|threads={torch.get_num_threads()}"
    cache = default_cache_dir() / "peak_flops.json"
    try:
        known: dict[str, float] = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, ValueError):
        known = {}  # another rank is writing it, or it is damaged: measure again
    key = f"{kind}|{label}|{dtype_name}"
    if key not in known:
        known[key] = _probe(dtype_name, "cuda" if kind == "cuda" else "cpu")
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache)  # atomic: ranks probing at once never leave half a file
    return known[key]
