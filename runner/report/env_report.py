"""`runner env`: what a bug report needs, like `accelerate env`."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "hydra-core", "omegaconf", "tensorboard")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    import torch

    lines = ["runner env", f"- runner: {_version('runner')}", f"- python: {sys.version.split()[0]} ({sys.executable})"]
    lines += [f"- {name}: {_version(name)}" for name in PACKAGES]
    lines.append(f"- platform: {platform.platform()}")
    lines.append(f"- CPU cores: {os.cpu_count()}")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        lines.append(f"- GPUs: {count}, CUDA {torch.version.cuda}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"  - {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("- GPUs: none (CPU only)")
    compiler = shutil.which("c++") or shutil.which("g++")
    ninja = shutil.which("ninja") or _version("ninja") != "not installed"
    buildable = bool(compiler and ninja)
    lines.append(f"- DeepSpeed ops can build: {'yes' if buildable else 'no'} (compiler: {compiler or 'none'}, ninja: {'yes' if ninja else 'no'})")
    lines.append(f"- runner would use: {default_choices()}")
    return "\n".join(lines)


def default_choices() -> str:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        precision = "bf16 available (default precision=fp32)" if torch.cuda.is_bf16_supported() else "fp16 available (default precision=fp32)"
        return f"strategy=ddp on {count} process(es) (NCCL), {precision}"
    return "strategy=ddp on 1 process (CPU; launch.nproc_per_node=N for gloo), precision=fp32 (bf16 also works on CPU; fp16 is refused)"


def main() -> None:
    print(report())
