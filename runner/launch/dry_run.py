"""`dry_run=true`: the resolved spec and the run's plan, without training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from runner.train.plan import COMPARED_STRATEGIES, MemoryEstimate, batches_per_rank, dry_run_report, estimate_memory, plan_run
from runner.config.spec import OffloadDevice, RunSpec, spec_to_yaml

if TYPE_CHECKING:
    from runner.components.data import PreparedData


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of the model."""

    parameters: int
    hidden_size: Optional[int]  # sizes ZeRO's buckets (runner/accel.zero_sizes)
    layers: Optional[int] = None  # transformer layers: FSDP2 gathers one or two at a time


def model_shape(spec: RunSpec) -> ModelShape:
    """The model the run would build, on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runner.components.model import build_config, count_parameters

    config = build_config(spec.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return ModelShape(count_parameters(model), getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None))


def estimates(shape: ModelShape, precision: str, world_size: int) -> dict[str, MemoryEstimate]:
    """Per-rank memory under each compared strategy (no offload), as the dry run prints
    it and bench/strategy_memory.py sets it beside what it measures."""
    return {s: estimate_memory(shape.parameters, s, precision, world_size, hidden_size=shape.hidden_size, layers=shape.layers)
            for s in COMPARED_STRATEGIES}


def report(spec: RunSpec, data: "PreparedData", world_size: int) -> str:
    import torch

    shape = model_shape(spec)
    plan = plan_run(
        spec,
        world_size,
        batches_per_rank=batches_per_rank(len(data.train), spec.train.per_device_batch_size, world_size),
        block_size=data.block_size,
        train_blocks=len(data.train),
        eval_blocks=len(data.validation),
        parameters=shape.parameters,
        precision=spec.precision.kind.value,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    offload_opt = spec.strategy.offload_optimizer is OffloadDevice.cpu
    offload_par = spec.strategy.offload_params is OffloadDevice.cpu
    estimate = estimate_memory(plan.parameters, plan.strategy, plan.precision, world_size, offload_opt, offload_par,
                               hidden_size=shape.hidden_size, layers=shape.layers)
    comparison = estimates(shape, plan.precision, world_size)
    return f"{spec_to_yaml(spec)}\n{dry_run_report(plan, estimate, comparison)}"
