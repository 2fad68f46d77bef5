"""After prepare(): is what Accelerate (and DeepSpeed, FSDP2) engaged what the spec asked
for, and after training, do all ranks hold the same model?

Accelerate falls back silently on CPU (for example to unsynchronised copies, or DDP
instead of FSDP); runner never does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from accelerate import Accelerator

from runner.config.spec import RunSpec
from runner.distributed.strategies import build_strategy
from runner.distributed.strategy import MIXED_PRECISION, Strategy, adamw_name, innermost_optimizer


class EngagementError(RuntimeError):
    """What Accelerate engaged differs from the spec."""


def engaged_optimizer(optimizer: Any) -> str:
    inner = innermost_optimizer(optimizer)
    name = type(inner).__name__
    return adamw_name(bool(inner.param_groups[0].get("fused"))) if name == "AdamW" else name


def check_engaged(accelerator: "Accelerator", model: Any, optimizer: Any, spec: RunSpec, planned_world_size: int,
                  strategy: Optional[Strategy] = None) -> str:
    """Fail loudly when what Accelerate / DeepSpeed / FSDP2 built is not what the launcher
    planned: world size, the strategy's own wrapping (strategy.engagement_problems),
    gradient accumulation (which an outer `accelerate launch` can override through
    ACCELERATE_* variables), mixed precision, compilation and the optimizer class in
    use. Returns that optimizer, for the banner."""
    strategy = strategy or build_strategy(spec.strategy, spec.precision)
    accum = spec.train.grad_accum_steps
    problems: list[str] = []
    if accelerator.num_processes != planned_world_size:
        problems.append(f"world size is {accelerator.num_processes}, the launcher planned {planned_world_size}")
    wanted_precision = MIXED_PRECISION[spec.precision.kind]
    if accelerator.mixed_precision != wanted_precision:
        problems.append(f"mixed precision is {accelerator.mixed_precision}, expected {wanted_precision}")
    if accelerator.gradient_accumulation_steps != accum:
        problems.append(f"gradient accumulation is {accelerator.gradient_accumulation_steps} steps, expected {accum}")
    problems += strategy.engagement_problems(accelerator, model, planned_world_size)
    if spec.model.compile and not compiled_layers(model):
        problems.append(f"model.compile=true but no layer of the model is compiled ({type(model).__name__})")
    in_use, wanted_optimizer = engaged_optimizer(optimizer), strategy.expected_optimizer(spec.optim.fused)
    if in_use != wanted_optimizer:
        problems.append(f"the optimizer in use is {in_use}, expected {wanted_optimizer}")
    if problems:
        raise EngagementError("strategy not engaged as specified: " + "; ".join(problems))
    return in_use


def compiled_layers(model: Any) -> int:
    """How many modules of `model` (bare or wrapped) are compiled in place (model.compile:
    runner/components/compile.py)."""
    return sum(1 for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None)


def rank_fingerprints(accelerator: "Accelerator", model: Any, strategy: Strategy) -> list[float]:
    """The sum of every parameter, one value per rank, without gathering any parameter.

    What the check is for: a rank that silently trains another model than its peers
    (Accelerate's fallback to unsynchronised copies on CPU). Under ddp each rank holds
    the whole model, so each sums its own replica and a drifted one differs.

    Under ZeRO-3 and fsdp a parameter is split into shards, one per rank, and a whole
    parameter only ever exists as an all-gather of those shards, identical on every rank
    by construction: summing gathered parameters can never disagree across ranks, and
    gathering them all at once before the final save is the out-of-memory a sharded run
    must never meet. What can drift is what a rank holds whole beside the shards (ZeRO-3's
    persistent small parameters, or any parameter left gathered), so: a parameter a rank
    holds whole adds its local sum, and a sharded one adds the sum of all ranks' shards
    (one all-reduce of a vector of per-parameter partial sums). Every rank then reports
    the model's sum, the same number as ddp's, unless some whole copy has drifted.
    (`strategy.parameter_pieces` says which piece each rank holds.)"""
    device = accelerator.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    shard_sums, whole_sums = [], []
    for shard, whole in strategy.parameter_pieces(model):
        shard_sums.append(_sum(shard, device) if shard is not None else zero)
        whole_sums.append(_sum(whole, device) if whole is not None else None)
    totals = torch.stack(shard_sums) if shard_sums else zero.new_zeros(0)
    if torch.distributed.is_initialized():  # every rank, whatever it holds whole: a collective
        torch.distributed.all_reduce(totals)  # each sharded parameter's sum over every rank's shard
    total = sum((w if w is not None else totals[i] for i, w in enumerate(whole_sums)), zero)
    values = accelerator.gather(total.reshape(1))
    return [float(v) for v in values.cpu()]


def _sum(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """Accumulated in float64 without a float64 copy of the tensor (an offloaded piece
    sits on the CPU: its sum joins the others on the device)."""
    return torch.sum(tensor.detach(), dtype=torch.float64).to(device)


def check_in_sync(fingerprints: list[float]) -> None:
    first = fingerprints[0]
    if any(abs(f - first) > 1e-6 * max(1.0, abs(first)) for f in fingerprints):
        raise EngagementError(f"ranks hold different parameters after training: {fingerprints}")
