"""The output head and loss alone, whole logits against runner's chunks of several sizes.

Not a test: prints the figures, asserts nothing, exits 0.

GPT-2 124M's head (50,257 x 768, tied to the token embedding as in GPT-2): the
embedding's forward, the head and cross-entropy, and both backwards, over `--tokens`
tokens (8 rows), with the whole logits (transformers' loss: fp32 cross-entropy over the
shifted logits) and with runner's chunked head (runner/components/chunked_loss.py) at
each `--chunks` size. The variants run interleaved, `--repeats` times; medians after the
first two, and each against the whole logits' in the same run. What it is for: choosing
MIN_CHUNK_TOKENS, the tokens below which a chunk's fixed traffic over the vocabulary
(the weight read twice, the fp32 weight-gradient buffer read and written) costs more
than the chunk saves.

    python bench/head_chunks.py                                  # 1,024 tokens, fp32, ~1 minute
    python bench/head_chunks.py --tokens 4096 --chunks 333,1024,2048 --bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.components.chunked_loss import chunk_tokens, chunked_token_losses

VOCAB, WIDTH, ROWS = 50257, 768, 8


def step(weight: torch.nn.Parameter, ids: torch.Tensor, labels: torch.Tensor, chunk: int | None, bf16: bool) -> float:
    """One forward and backward of embedding -> head -> loss; its seconds."""
    weight.grad = None
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        embedded = F.embedding(ids, weight)
        hidden = embedded.detach().requires_grad_()
        tokens = ids.numel()
        if chunk is None:  # transformers' ForCausalLMLoss over the whole logits
            logits = F.linear(hidden, weight)
            loss = F.cross_entropy(logits.float()[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                   reduction="sum") / tokens
        else:
            total, _ = chunked_token_losses(hidden, weight, None, labels, chunk)
            loss = total / tokens
    loss.backward()
    embedded.backward(hidden.grad)  # the tied weight's embedding gradient joins the head's
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens a micro-batch (8 rows; default 1024)")
    parser.add_argument("--chunks", type=lambda text: [int(c) for c in text.split(",")], default=[128, 333, 512, 1024],
                        help="chunk sizes in tokens (default 128,333,512,1024)")
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    parser.add_argument("--repeats", type=int, default=8, help="interleaved rounds (default 8; the first two not counted)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02)
    ids = torch.randint(0, VOCAB, (ROWS, args.tokens // ROWS))
    labels = torch.randint(0, VOCAB, (ROWS, args.tokens // ROWS))
    variants: list[int | None] = [None, *args.chunks]
    seconds: dict[int | None, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            seconds[v].append(step(weight, ids, labels, v, args.bf16))
    medians = {v: statistics.median(s[2:] or s) for v, s in seconds.items()}
    print(f"GPT-2 124M's head and loss, {args.tokens} tokens, {'bf16' if args.bf16 else 'fp32'}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; runner's chunk for this vocabulary: "
          f"{chunk_tokens(VOCAB)} tokens")
    print(f"{'variant':<22} | {'chunks':>6} | {'ms (median)':>11} | {'x whole':>7}")
    print(f"{'-' * 22}-|-{'-' * 6}-|-{'-' * 11}-|-{'-' * 7}")
    for v in variants:
        name = "whole logits" if v is None else f"chunks of {v} tokens"
        count = 1 if v is None else -(-args.tokens // v)
        print(f"{name:<22} | {count:>6} | {1000 * medians[v]:>11.1f} | {medians[v] / medians[None]:>7.2f}")


if __name__ == "__main__":
    main()
