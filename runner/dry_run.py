"""`dry_run=true`: the resolved spec and the run's plan, without training."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.plan import RunPlan, batches_per_rank, dry_run_report, estimate_memory, steps_per_epoch, total_steps
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

    from runner.optim import effective_lr

    t = spec.train
    per_epoch = steps_per_epoch(batches_per_rank(len(data.train), t.per_device_batch_size, world_size), t.grad_accum_steps)
    n_params = count_parameters_cheaply(spec)
    global_batch = t.per_device_batch_size * world_size * t.grad_accum_steps
    plan = RunPlan(
        world_size=world_size,
        per_device_batch_size=t.per_device_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        block_size=data.block_size,
        steps_per_epoch=per_epoch,
        total_steps=total_steps(t.max_steps, t.num_epochs, per_epoch),
        train_blocks=len(data.train),
        eval_blocks=len(data.validation),
        parameters=n_params,
        strategy=spec.strategy.kind.value,
        precision=spec.precision.kind.value,
        device="cuda" if torch.cuda.is_available() else "cpu",
        lr=spec.optim.lr,
        effective_lr=effective_lr(spec.optim, global_batch),
        lr_rule=spec.optim.scale_lr.value,
    )
    offload_opt = spec.strategy.offload_optimizer is OffloadDevice.cpu
    offload_par = spec.strategy.offload_params is OffloadDevice.cpu
    estimate = estimate_memory(n_params, plan.strategy, plan.precision, world_size, offload_opt, offload_par)
    comparison = {s: estimate_memory(n_params, s, plan.precision, world_size) for s in ("ddp", "zero2", "zero3")}
    return f"{spec_to_yaml(spec)}\n{dry_run_report(plan, estimate, comparison)}"
