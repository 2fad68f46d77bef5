"""runner's exact gradient norm (runner/distributed/grad_norm.py) against its previous
version and torch's, in one process on GPT-2 124M's gradient shapes.

Not a test: prints times and errors, asserts nothing, exits 0.

  now      float64 sums, each chunk cast into one reused buffer (runner's grad_norm)
  before   float64 sums, a new float64 tensor per 4M-element chunk (runner until issue 37)
  torch    torch.nn.utils.get_total_norm (float32: what Accelerate's clip calls)
Error: relative to the norm of the whole gradient cast to float64 at once. Under runner's
default host-memory policy (launch.retain_freed_memory=true, runner/train/host_memory.py),
or with --return-freed under launch.retain_freed_memory=false's. Best of --rounds, each
variant in turn within a round.

    python bench/grad_norm.py
    python bench/grad_norm.py --return-freed
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.distributed.grad_norm import grad_norm
from runner.train.host_memory import retain_freed_memory, return_freed_memory


def before(grads: list[torch.Tensor], chunk: int = 1 << 22) -> torch.Tensor:
    """runner's norm until issue 37 (its float64 casts allocated chunk by chunk)."""
    return torch.stack([
        torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64).square() for c in g.reshape(-1).split(chunk)]).sum()
        for g in grads]).sum().sqrt()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--return-freed", action="store_true", help="launch.retain_freed_memory=false's policy")
    args = parser.parse_args()
    (return_freed_memory if args.return_freed else retain_freed_memory)()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    grads = [p.grad for p in model.parameters()]
    exact = torch.cat([g.reshape(-1).double() for g in grads]).norm().item()
    variants: dict[str, Callable[[list[torch.Tensor]], Any]] = {
        "now": grad_norm, "before": before, "torch": torch.nn.utils.get_total_norm}
    best = {name: float("inf") for name in variants}
    error = {}
    for _ in range(args.rounds):
        for name, norm in variants.items():
            start = time.perf_counter()
            value = float(norm(grads))
            best[name] = min(best[name], time.perf_counter() - start)
            error[name] = abs(value - exact) / exact
    policy = "launch.retain_freed_memory=false" if args.return_freed else "launch.retain_freed_memory=true (the default)"
    print(f"GPT-2 124M gradients ({sum(g.numel() for g in grads):,} elements, {len(grads)} tensors), "
          f"{torch.get_num_threads()} threads, host memory: {policy}, best of {args.rounds}")
    print(f"| norm | ms | x now | relative error |\n|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {best[name] * 1e3:.1f} | {best[name] / best['now']:.2f} | {error[name]:.1e} |")


if __name__ == "__main__":
    main()
