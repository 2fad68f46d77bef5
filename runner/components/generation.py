"""Sampling completions with transformers, one prompt's group at a time, each completion
drawn from its own seeded generator.

Why not `model.generate`: its sampler draws every row's token from one global stream
(`torch.multinomial` on the whole batch), so a completion depends on which other rows
share its batch, on the rank that drew it and on everything drawn before. Here a
prompt's G completions are one batch (the same prompt G times: no padding, so a row's
arithmetic never depends on another prompt's length), and completion i's tokens are
drawn by a generator seeded from (seed, generation, prompt id, i) alone. The same
weights therefore give the same completions on any rank, at any world size,
accumulation or strategy, and a resumed run draws what the uninterrupted one drew.

The loop is transformers' own decoding (the model's forward with its KV cache, logits
over T, a categorical draw), and it records each drawn token's log-probability under the
sampling distribution: the training pass recomputes it (runner/components/objectives/grpo.py)
and the difference is logged as sampling/logp_difference. Sampling is plain temperature
sampling over the whole vocabulary, the support the training pass scores (top-k/top-p
would sample from a support the loss never sees, so they are not offered).

Under a strategy that shards the parameters (ZeRO-3, FSDP2) each forward gathers them
from every rank, so every rank must run the same forwards: `lockstep` makes each group
decode all `max_new_tokens` steps (finished rows keep drawing, unread), and the caller
gives every rank the same number of groups.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch


def sample_seed(seed: int, generation: int, prompt_id: int, sample: int) -> int:
    """The seed of one completion's generator: a hash of what identifies it, nothing of the layout."""
    digest = hashlib.blake2b(f"{seed}/{generation}/{prompt_id}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _cache_argument(model: Any) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.25 (which warns on
    `past_key_values`), `past_key_values` before it."""
    forward = getattr(model, "forward", model)
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token a row from its categorical distribution: one uniform from the row's own
    generator, inverted through the cumulative distribution (fp64, so no token's share is
    lost to rounding). One draw a row, not torch.multinomial's call a row: bench/grpo.py
    measured 128 such calls at 45% of a step."""
    uniform = torch.stack([torch.rand((), generator=gen, dtype=torch.float64, device=probs.device)
                           for gen in generators])
    cdf = probs.double().cumsum(-1)
    drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    return drawn.clamp_(max=cdf.shape[1] - 1)


@dataclass
class Group:
    """One prompt's sampled completions, padded to max_new_tokens."""

    completion_ids: torch.Tensor  # [G, max_new_tokens] int64, pad_id after a completion's end
    lengths: torch.Tensor  # [G] int64: tokens generated, the end-of-sequence included
    logps: torch.Tensor  # [G, max_new_tokens] float32: each drawn token's sampling log-prob (0 past the end)
    ended: torch.Tensor  # [G] bool: closed by end-of-sequence (else truncated at max_new_tokens)


@torch.no_grad()
def sample_group(model: Any, prompt_ids: Sequence[int], seeds: Sequence[int], max_new_tokens: int,
                 temperature: float, eos_ids: Sequence[int], pad_id: int, lockstep: bool = False) -> Group:
    """G = len(seeds) completions of one prompt (see the module's docstring)."""
    device = next(model.parameters()).device
    g = len(seeds)
    generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    input_ids = torch.tensor([list(prompt_ids)] * g, dtype=torch.long, device=device)
    attention = torch.ones_like(input_ids)
    tokens = torch.full((g, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((g, max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(g, dtype=torch.bool, device=device)
    lengths = torch.zeros(g, dtype=torch.long, device=device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    past, step_ids = None, input_ids
    cache_name = _cache_argument(model)
    extra = {cache_name: past}
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        # a mixture of experts' router loss is training's; over one cached token against the
        # whole attention mask it cannot be computed (transformers' generate turns it off too)
        extra["output_router_logits"] = False
    for t in range(max_new_tokens):
        extra[cache_name] = past
        out = model(input_ids=step_ids, attention_mask=attention, use_cache=True, **extra)
        past = getattr(out, cache_name)
        scores = torch.log_softmax(out.logits[:, -1, :].float() / temperature, dim=-1)
        drawn = _draw(scores.exp(), generators)
        live = ~done
        tokens[:, t] = torch.where(live, drawn, torch.full_like(drawn, pad_id))
        logps[:, t] = torch.where(live, scores.gather(1, drawn[:, None]).squeeze(1), torch.zeros_like(logps[:, t]))
        lengths += live.long()
        done = done | (live & torch.isin(drawn, eos))
        if bool(done.all()) and not lockstep:
            break
        step_ids = drawn[:, None]
        attention = torch.cat([attention, torch.ones((g, 1), dtype=attention.dtype, device=device)], dim=1)
    return Group(tokens.cpu(), lengths.cpu(), logps.cpu(), done.cpu())
