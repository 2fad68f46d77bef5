"""Where one GPT-2 124M fp32 training step goes on this machine, part by part.

Not a test: builds GPT-2 small from its config (124M parameters, vocabulary 50257, 1024
positions), and trains it as runner does on a CPU (fp32, TF32 off, fused AdamW, loss
through the model's own cross-entropy) on batches of 8 x 128 random tokens. After
`--warmup` steps it measures `--steps` more and prints, per part, the median time per
step and its share:

- forward parts, timed by module hooks (a CPU runs each op synchronously, so a hook's
  clock is the op's): the embeddings (wte + wpe and their dropout), attention (each
  block's ln_1 + attn), MLP (ln_2 + mlp), the final norm, LM head (the logits) and loss
  (the cross-entropy, the forward's remainder);
- backward, as one (`loss.backward()`), and split the same way by backward hooks where
  the modules give them;
- the gradient norm and clipping to 1.0, runner's (float64 sums, runner/distributed/grad_norm.py);
- the optimizer step (fused AdamW) and zero_grad;
- host overhead: the step's wall time less all of the above.

Then, under torch.profiler, the ten operators that take the most CPU time, and the step's
MFU by runner's own formula (runner/report/flops.py: 6N + 12·L·d·s FLOPs a token, over
the matmul peak it probes).

    python bench/step_profile.py                  # ~2 minutes on 2 CPU cores
    python bench/step_profile.py --batch 8 --block 1024 --steps 3
    python bench/step_profile.py --chunked-loss   # the head and loss as runner computes them by default

With --chunked-loss (runner/components/chunked_loss.py, model.chunked_loss's default)
the LM head's forward computes the loss and the head's gradients chunk by chunk, so its
"forward" holds what the plain path does in the loss and in backward.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch


def part_of(name: str) -> str | None:
    """The part a module's forward belongs to, by its name in GPT2LMHeadModel."""
    if name in ("transformer.wte", "transformer.wpe"):
        return "embeddings"
    if name.endswith((".ln_1", ".attn")) and name.count(".") == 3:
        return "attention"
    if name.endswith((".ln_2", ".mlp")) and name.count(".") == 3:
        return "MLP"
    if name == "transformer.ln_f":
        return "final norm"
    if name == "lm_head":
        return "LM head"
    return None


class Clock:
    """Forward and backward time per part, from hooks on the parts' modules."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.started: dict[int, float] = {}
        for name, module in model.named_modules():
            part = part_of(name)
            if part is None:
                continue
            module.register_forward_pre_hook(self._start)
            module.register_forward_hook(self._stop(f"forward: {part}"))
            module.register_full_backward_pre_hook(lambda m, g: self._start(m, None))
            module.register_full_backward_hook(lambda m, gi, go, p=part: self._stop(f"backward: {p}")(m, None, None))

    def _start(self, module: torch.nn.Module, _: Any) -> None:
        self.started[id(module)] = time.perf_counter()

    def _stop(self, key: str) -> Any:
        def stop(module: torch.nn.Module, _: Any, __: Any) -> None:
            self.seconds[key] += time.perf_counter() - self.started.pop(id(module))
        return stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunked-loss", action="store_true", help="runner's chunked head and loss (its default)")
    args = parser.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    from runner.distributed.grad_norm import clip_and_norm
    from runner.report.flops import model_flops_per_token, peak_flops

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    params = [p for p in model.parameters() if p.requires_grad]
    clock = Clock(model)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.block))
    chunked = None
    if args.chunked_loss:
        from runner.components.chunked_loss import install

        chunked, why = install(model)
        assert chunked is not None, why

    def step() -> dict[str, float]:
        clock.seconds.clear()
        t0 = time.perf_counter()
        if chunked is not None:
            with chunked.labels(ids):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        clip_and_norm(params, 1.0)
        t_clip = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        parts = dict(clock.seconds)
        forward_parts = sum(v for k, v in parts.items() if k.startswith("forward"))
        backward_parts = sum(v for k, v in parts.items() if k.startswith("backward"))
        parts["forward: loss and the rest"] = (t1 - t0) - forward_parts
        parts["backward: the rest (loss, embeddings' scatter, joins)"] = (t2 - t1) - backward_parts
        parts["gradient norm and clipping (runner's, float64)"] = t_clip - t2
        parts["optimizer (fused AdamW) + zero_grad"] = t3 - t_clip
        parts["step"] = t3 - t0
        return parts

    for _ in range(args.warmup):
        step()
    measured = [step() for _ in range(args.steps)]
    wall = statistics.median(m["step"] for m in measured)
    keys = [k for k in measured[0] if k != "step"]
    rows = {k: statistics.median(m.get(k, 0.0) for m in measured) for k in keys}
    rows["host overhead (the rest of the step)"] = max(wall - sum(rows.values()), 0.0)

    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.block
    flops = model_flops_per_token(config, n_params, args.block) * tokens
    peak = peak_flops(torch.device("cpu"), "fp32")
    print(f"GPT-2 124M ({n_params / 1e6:.1f}M parameters), fp32, {'chunked' if chunked else 'plain'} loss, batch {args.batch} x {args.block}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.steps} steps")
    print()
    print("| part | ms / step | share |")
    print("|---|---|---|")
    for key, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {1000 * seconds:.1f} | {100 * seconds / wall:.1f}% |")
    print(f"| **step** | **{1000 * wall:.1f}** | 100% |")
    print()
    print(f"tokens/s {tokens / wall:,.0f}; model FLOPs a step {flops / 1e12:.2f} TFLOP; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s; MFU {flops / wall / peak:.2f}" if peak else "MFU unknown")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    print()
    print("torch.profiler, one step, the ten operators with the most CPU time (self):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40))


if __name__ == "__main__":
    main()
