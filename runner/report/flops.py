"""Model FLOPs utilisation: achieved model FLOPs against the device's peak.

FLOPs per token follow nanoGPT / PaLM: 6 N (forward and backward over N parameters)
plus 12 L d T for attention (L layers, width d, sequence T). The peak comes from a
table for known GPUs (an unknown GPU has no peak: MFU is reported as unknown); on a
CPU it is measured once with a short matmul probe and cached.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from typing import Any, Optional

import torch

from runner.config.paths import default_cache_dir

# Dense peak TFLOPS per GPU from NVIDIA's datasheets (sparsity figures halved), by the
# dtype the matmuls run in: bf16/fp16 on tensor cores with fp32 accumulation, tf32 for
# fp32 matmuls when TF32 is allowed, fp32 for plain fp32 (torch's default: TF32 off).
# A dtype a GPU lacks is absent. Patterns are tried in order against
# torch.cuda.get_device_name(): specific before general, so "L40" never reads as
# "L4" and an H100 PCIe or NVL never gets the SXM figure. No match: MFU is unknown.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bB200\b", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"\bH200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"\bH100 (SXM|80GB HBM3)", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"RTX 6000 Ada", {"bf16": 364.2, "fp16": 364.2, "tf32": 182.1, "fp32": 91.1}),
    (r"\bA10G\b", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0}),
    (r"V100-SXM", {"fp16": 125.0, "fp32": 15.7}),
    (r"V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
)


def gpu_peak_tflops(name: str, dtype_name: str, tf32: bool) -> Optional[float]:
    """The table's dense peak for this GPU and training dtype, or None when unknown.
    dtype_name is fp32, bf16 or fp16; fp32 counts at the TF32 rate only when TF32 is on."""
    column = "tf32" if dtype_name == "fp32" and tf32 else dtype_name
    for pattern, peaks in GPU_PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks.get(column)
    return None


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on a GPU run on TF32 tensor cores (torch's default: no).
    runner leaves this setting alone, so fp32 runs are full fp32 and counted as such."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def flops_per_token(n_params: float, n_layer: int, n_embd: int, block_size: int) -> float:
    return 6.0 * n_params + 12.0 * n_layer * n_embd * block_size


def attention_width(config: Any) -> int:
    """The width attention's scores and values are computed at: heads x head_dim where
    the model sets head_dim (Qwen3, Gemma: not the hidden size), else the hidden size."""
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int) and head_dim > 0:
        return heads * head_dim
    return int(getattr(config, "n_embd", None) or getattr(config, "hidden_size", 0))


def experts_per_token(config: Any) -> Optional[tuple[int, int]]:
    """(experts a token is routed to, experts per layer) of a mixture-of-experts config, else None."""
    used = getattr(config, "num_experts_per_tok", None)
    total = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if isinstance(used, int) and isinstance(total, int) and 0 < used < total:
        return used, total
    return None


def expert_parameters(model: torch.nn.Module) -> int:
    """Parameters inside the model's expert modules (`...experts...` in their names), at
    full size also when ZeRO-3 has partitioned them (ds_numel)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in f".{name}." and id(p) not in seen:
            seen.add(id(p))
            total += int(getattr(p, "ds_numel", p.numel()))
    return total


def active_parameters(config: Any, n_params: int, n_expert_params: int) -> float:
    """Parameters a token's forward uses: under a mixture of experts only top-k of the E
    experts' weights, so k/E of the expert parameters; every parameter of a dense model."""
    routing = experts_per_token(config)
    if routing is None or not n_expert_params:
        return float(n_params)
    used, total = routing
    return n_params - n_expert_params * (1 - used / total)


def model_flops_per_token(config: Any, n_params: int, block_size: int, n_expert_params: int = 0,
                          n_trainable: Optional[int] = None) -> float:
    """Training FLOPs per token (PaLM's 6N + 12·L·d·s): N the parameters a token uses
    (grouped-query attention and gated MLPs are in N as they are; a mixture of experts
    counts its top-k experts), d attention's width (heads x head_dim). A frozen weight
    (adapters on a frozen base: `n_trainable` of the `n_params`) costs its forward and the
    backward to its input, 4 FLOPs a token, not the 2 more of its own gradient; its share
    of the active parameters is taken as its share of all."""
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)
    active = active_parameters(config, n_params, n_expert_params)
    full = flops_per_token(active, int(layers), attention_width(config), block_size)
    if n_trainable is None or n_trainable >= n_params or n_params <= 0:
        return full
    return full - 2.0 * active * (n_params - n_trainable) / n_params


def _probe(dtype_name: str, seconds: float = 0.25, size: int = 512) -> float:
    """Matmul FLOP/s for this dtype on a CPU: the fastest of the matmuls that fit in
    `seconds` (at least three, the first a warm-up), so a moment of other work on the
    cores costs one matmul, not the figure. 512 x 512 keeps one matmul short where a
    dtype has no fast kernel (bf16 without AVX512-BF16: ~0.3 s, against ~4 ms in fp32)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    local = torch.Generator().manual_seed(0)  # the global RNG streams are not touched
    a = torch.randn(size, size, generator=local).to(dtype)
    b = torch.randn(size, size, generator=local).to(dtype)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)  # synchronous on a CPU
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / min(times[1:])


# The keys probed by this process: its later runs (certify's and a sweep's runs in turn,
# a resume) read the cache instead of probing again, a quarter second a rank each.
_PROBED: set[str] = set()


def peak_flops(device: Any, dtype_name: str) -> Optional[float]:
    """Peak FLOP/s of one device for the training dtype (fp32, bf16 or fp16). On a GPU,
    the table's figure or None (unknown: MFU is then reported as unknown, not guessed
    from a probe that measures something else). On a CPU, the highest of a matmul probe
    run by this process's first run and every earlier one on this machine at this thread
    count (cached): a probe that shared the cores with other work reads low, and a low
    peak inflates MFU. Caching the first probe alone kept such a figure for good (measured
    here: fp32 15.8 GFLOP/s cached under load, 65.6 on the quiet machine, so every later
    MFU read 4x high)."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        peak = gpu_peak_tflops(torch.cuda.get_device_name(device), dtype_name, tf32_enabled())
        return None if peak is None else peak * 1e12
    label = f"{platform.processor() or platform.machine()}|threads={torch.get_num_threads()}"
    cache = default_cache_dir() / "peak_flops.json"
    try:
        known: dict[str, float] = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, ValueError):
        known = {}  # another rank is writing it, or it is damaged: measure again
    key = f"{kind}|{label}|{dtype_name}"
    if key in _PROBED and key in known:
        return known[key]
    _PROBED.add(key)
    measured = _probe(dtype_name)
    if measured > known.get(key, 0.0):
        known[key] = measured
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache)  # atomic: ranks probing at once never leave half a file
    return known[key]
