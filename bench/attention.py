"""GPT-2 124M's attention on a CPU under bf16 autocast with dropout, as runner and the
Trainer both run it (transformers' sdpa), against what it would cost in bf16 throughout.

Not a test: prints the figures, asserts nothing, exits 0.

With dropout on, torch's sdpa on a CPU takes its math backend, and since torch 2.5 that
backend upcasts bf16 queries, keys and values to fp32 for accuracy
(`torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`, off: despite its name the
flag is global). Three variants of one layer's attention, forward and backward,
interleaved `--repeats` times; medians after the first two, each against sdpa as
shipped, and the difference over GPT-2's 12 layers:

- sdpa as shipped (the fp32 upcast);
- sdpa with the bf16 reduction allowed (the scores rounded to bf16 before the softmax);
- transformers' eager attention for GPT-2 (its own function: the scores in bf16).

Also the attention probabilities' dropout mask alone (`bernoulli_`): torch draws it with
MKL's parallel generator only on Intel CPUs, and element by element on one thread
elsewhere (AMD), for runner and the Trainer alike. And each variant's largest difference
from the float64 attention without dropout.

    python bench/attention.py                        # 8 x 128, ~30 seconds on 2 CPU cores
    python bench/attention.py --batch 4 --block 1024  # run_clm's block (4 x 2 here), ~2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.train.host_memory import retain_freed_memory

HEADS, HEAD_DIM, LAYERS, DROPOUT = 12, 64, 12, 0.1  # GPT-2 124M; its attn_pdrop


@contextlib.contextmanager
def bf16_reduction(allowed: bool) -> Iterator[None]:
    """sdpa's math backend in bf16 (`allowed`) or upcast to fp32 (torch's default)."""
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    try:
        yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """transformers' own GPT-2 eager attention (`model.attn_implementation=eager`), with
    the additive causal mask transformers gives it."""
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    mask = torch.zeros(causal.shape, dtype=q.dtype, device=q.device).masked_fill(~causal, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(SimpleNamespace(training=dropout > 0), q, k, v, mask, dropout=dropout)
    return out.transpose(1, 2)  # its output is batch x tokens x heads; back to sdpa's layout


VARIANTS: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {
    "sdpa as shipped (fp32 upcast)": (sdpa, False),
    "sdpa, bf16 reduction": (sdpa, True),
    "eager": (eager, False),
}


def seconds(attend: Callable[..., torch.Tensor], allowed: bool, qkv: list[torch.Tensor]) -> float:
    for t in qkv:
        t.grad = None
    start = time.perf_counter()
    with bf16_reduction(allowed), torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(*qkv, DROPOUT)
    out.float().sum().backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    retain_freed_memory()  # runner's default host-memory policy
    shape = (args.batch, HEADS, args.block, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(shape, generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in range(3)]
    print(f"GPT-2 124M's attention, {args.batch} x {args.block} tokens, {HEADS} heads, dropout {DROPOUT}, bf16 autocast, "
          f"forward and backward, {torch.get_num_threads()} threads, medians of {args.repeats - 2}")
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, (attend, allowed) in VARIANTS.items():
            times[name].append(seconds(attend, allowed, qkv))
    base = statistics.median(times[next(iter(VARIANTS))][2:])
    print("| variant | ms a layer | x | over 12 layers, ms a step saved |\n|---|---|---|---|")
    for name, ts in times.items():
        ms = statistics.median(ts[2:])
        print(f"| {name} | {ms * 1e3:.1f} | {ms / base:.2f} | {(base - ms) * LAYERS * 1e3:.0f} |")
    probs = torch.empty(args.batch, HEADS, args.block, args.block, dtype=torch.bfloat16)
    draws = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        probs.bernoulli_(1 - DROPOUT)
        draws.append(time.perf_counter() - start)
    ms = statistics.median(draws[2:]) * 1e3
    print(f"dropout mask alone (bernoulli_, {probs.numel():,} elements): {ms:.1f} ms a layer, {ms * LAYERS:.0f} ms over 12 "
          f"({ms * 1e6 / probs.numel():.1f} ns an element)")
    exact = sdpa(*(t.detach().double() for t in qkv), 0.0)
    for name, (attend, allowed) in VARIANTS.items():
        with torch.no_grad(), bf16_reduction(allowed), torch.autocast("cpu", dtype=torch.bfloat16):
            out = attend(*(t.detach() for t in qkv), 0.0)
        print(f"{name}: at most {float((out.double() - exact).abs().max()):.1e} from float64 (no dropout)")


if __name__ == "__main__":
    main()
