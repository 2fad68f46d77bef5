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
from runner.distributed.grad_norm import full_value
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
    if spec.model.compile and strategy.compiles_model() and not hasattr(model, "_orig_mod"):
        problems.append(f"model.compile=true but the model is not compiled ({type(model).__name__})")
    in_use, wanted_optimizer = engaged_optimizer(optimizer), strategy.expected_optimizer(spec.optim.fused)
    if in_use != wanted_optimizer:
        problems.append(f"the optimizer in use is {in_use}, expected {wanted_optimizer}")
    if problems:
        raise EngagementError("strategy not engaged as specified: " + "; ".join(problems))
    return in_use


def rank_fingerprints(accelerator: "Accelerator", model: Any, strategy: Strategy) -> list[float]:
    """Sum of every parameter, one per rank: after a step all ranks must hold the same model.
    Under ZeRO-3 and fsdp each rank holds a shard, so the full parameters are gathered first."""
    params = list(model.parameters())
    with strategy.gathered(params):
        # fsdp: a DTensor's sum is partial per rank; full_value all-reduces it.
        total = torch.stack([full_value(p.detach().double().sum()) for p in params]).sum()
    values = accelerator.gather(total.reshape(1).to(accelerator.device))
    return [float(v) for v in values.cpu()]


def check_in_sync(fingerprints: list[float]) -> None:
    first = fingerprints[0]
    if any(abs(f - first) > 1e-6 * max(1.0, abs(first)) for f in fingerprints):
        raise EngagementError(f"ranks hold different parameters after training: {fingerprints}")
