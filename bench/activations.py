"""transformers' Python tanh-GELU (gelu_new) against the fused kernel runner swaps in
(model.fused_activations: gelu_pytorch_tanh, torch's F.gelu(approximate="tanh")).

Not a test: prints the figures, asserts nothing, exits 0.

One GPT-2 124M MLP activation over batch x block tokens (its 3,072 features), forward
and backward, fp32 and bf16 (the MLP's output dtype under bf16 autocast), the two
interleaved `--repeats` times; medians after the first two, the fused one against the
Python one in the same run, and the difference over GPT-2 124M's 12 layers. Also the
largest difference of each from the float64 formula.

    python bench/activations.py                 # 8 x 128, ~20 seconds on 2 CPU cores
    python bench/activations.py --block 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.activations import ACT2FN  # noqa: E402

from runner.components.activations import FUSED_TANH_GELU  # noqa: E402
from runner.train.host_memory import retain_freed_memory  # noqa: E402

WIDTH, LAYERS = 3072, 12  # GPT-2 124M's MLP: 4 x 768 features, 12 layers


def seconds(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    x.grad = None
    start = time.perf_counter()
    y = act(x)
    y.backward(torch.ones_like(y))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    retain_freed_memory()  # runner's default host-memory policy
    python, fused = ACT2FN["gelu_new"], ACT2FN[FUSED_TANH_GELU]
    print(f"GPT-2 124M's MLP activation, {args.batch} x {args.block} tokens x {WIDTH}, forward and backward, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats - 2}")
    print("| dtype | gelu_new ms | fused ms | x | over 12 layers, ms a step saved |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(args.batch, args.block, WIDTH, dtype=dtype, generator=torch.Generator().manual_seed(0))
        x.requires_grad_(True)
        times: dict[str, list[float]] = {"python": [], "fused": []}
        for _ in range(args.repeats):
            times["python"].append(seconds(python, x))
            times["fused"].append(seconds(fused, x))
        a, b = (statistics.median(t[2:]) * 1e3 for t in (times["python"], times["fused"]))
        print(f"| {str(dtype).removeprefix('torch.')} | {a:.2f} | {b:.2f} | {b / a:.2f} | {(a - b) * LAYERS:.0f} |")
    x = torch.randn(1 << 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    exact = python(x)  # the formula in float64
    for name, act in (("gelu_new", python), ("fused", fused)):
        print(f"{name}: fp32 at most {float((act(x.float()).double() - exact).abs().max()):.1e} from the float64 formula")


if __name__ == "__main__":
    main()
