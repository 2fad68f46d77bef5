"""`runner env`: what a bug report needs, like `accelerate env`."""

from __future__ import annotations

import os
import platform
import shutil
import sys

from runner.config.versions import KEY_LIBRARIES, LOCK_FILE, canonical, differences, install_hint, installed, locked_versions


def _version(name: str) -> str:
    return installed(name) or "not installed"


def library_lines() -> list[str]:
    """Each key library's installed version beside the lock's (runner/constraints.txt), and
    how to install the verified set where they differ."""
    lock = locked_versions()
    differing = {name for name, _, _ in differences()}
    lines = []
    for name in KEY_LIBRARIES:
        mark = "   <- differs" if name in differing else ""
        lines.append(f"- {name}: {installed(name) or 'not installed'} (locked {lock.get(canonical(name)) or '-'}){mark}")
    if not lock:
        lines.append(f"- verified set: no lock at {LOCK_FILE}")
    elif differing:
        lines.append(f"- verified set: {len(differing)} of {len(KEY_LIBRARIES)} differ from the lock; "
                     f"to install it: {install_hint()}")
    else:
        lines.append(f"- verified set: installed ({LOCK_FILE})")
    return lines


def report() -> str:
    import torch

    lines = ["runner env", f"- runner: {_version('runner')}", f"- python: {sys.version.split()[0]} ({sys.executable})"]
    lines += library_lines()
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
