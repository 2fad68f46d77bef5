"""`dry_run=true`: the resolved spec and the run's plan, without training."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.plan import batches_per_rank, dry_run_report, estimate_memory, plan_run
from runner.spec import OffloadDevice, RunSpec, spec_to_yaml

if TYPE_CHECKING:
    from runner.data import PreparedData


def count_parameters_cheaply(spec: RunSpec) -> int:
    """Parameter count of the model the run would build, on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runner.model import build_config, count_parameters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(spec.model))
    return count_parameters(model)


def report(spec: RunSpec, data: "PreparedData", world_size: int) -> str:
    import torch

    plan = plan_run(
        spec,
        world_size,
        batches_per_rank=batches_per_rank(len(data.train), spec.train.per_device_batch_size, world_size),
        block_size=data.block_size,
        train_blocks=len(data.train),
        eval_blocks=len(data.validation),
        parameters=count_parameters_cheaply(spec),
        precision=spec.precision.kind.value,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    offload_opt = spec.strategy.offload_optimizer is OffloadDevice.cpu
    offload_par = spec.strategy.offload_params is OffloadDevice.cpu
    estimate = estimate_memory(plan.parameters, plan.strategy, plan.precision, world_size, offload_opt, offload_par)
    comparison = {s: estimate_memory(plan.parameters, s, plan.precision, world_size) for s in ("ddp", "zero2", "zero3")}
    return f"{spec_to_yaml(spec)}\n{dry_run_report(plan, estimate, comparison)}"
