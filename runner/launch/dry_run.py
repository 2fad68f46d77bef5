"""`dry_run=true`: the resolved spec and the run's plan, without training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoModelForCausalLM

from runner.components.data import PreparedData
from runner.components.model import build_config, count_parameters, layer_parameters
from runner.config.spec import RunSpec, spec_to_yaml
from runner.launch.fit import Budget, Planner, verdict_lines
from runner.report.memory_estimate import COMPARED_STRATEGIES, MemoryEstimate, estimate_memory
from runner.train.plan import RunPlan, batches_per_rank, plan_run


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of the model."""

    parameters: int
    hidden_size: Optional[int]  # sizes ZeRO's buckets (runner/distributed/deepspeed.py zero_sizes)
    layers: Optional[int] = None  # transformer layers: FSDP2 gathers one or two at a time
    layer_parameters: Optional[int] = None  # one layer's, counted on the model's module tree


def model_shape(spec: RunSpec) -> ModelShape:
    """The model the run would build, on the meta device (no memory, no weights)."""
    config = build_config(spec.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return ModelShape(count_parameters(model), getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None),
                      layer_parameters(model))


def estimate_for(shape: ModelShape, strategy: str, precision: str, world_size: int, offload_optimizer: bool = False,
                 offload_params: bool = False) -> MemoryEstimate:
    """Per-rank memory of this model under one strategy."""
    return estimate_memory(shape.parameters, strategy, precision, world_size, offload_optimizer, offload_params,
                           hidden_size=shape.hidden_size, layers=shape.layers, cuda=torch.cuda.is_available(),
                           layer_parameters=shape.layer_parameters)


def report(spec: RunSpec, data: PreparedData, world_size: int, planner: Planner, room: Budget) -> str:
    shape = planner.shape
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
    mine = planner.estimate(plan.strategy)
    lines = verdict_lines(planner, COMPARED_STRATEGIES, room)
    return f"{spec_to_yaml(spec)}\n{dry_run_report(plan, mine)}\n" + "\n".join(lines)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


def dry_run_report(plan: RunPlan, estimate: MemoryEstimate) -> str:
    p = plan
    lines = [
        "runner: dry run (nothing trained, no run folder written)",
        f"  world size      {p.world_size} ({p.strategy}, precision {p.precision}, device {p.device})",
        f"  global batch    {p.global_batch_size} = {p.per_device_batch_size} per device x {p.world_size} process(es)"
        f" x {p.grad_accum_steps} accumulation",
        f"  tokens/step     {p.tokens_per_step:,} = {p.global_batch_size} x {p.block_size}",
        f"  steps           {p.total_steps:,} ({p.epochs:.2f} epochs of {p.steps_per_epoch:,} steps over "
        f"{p.train_blocks:,} blocks)",
        f"  tokens          {p.total_steps * p.tokens_per_step:,}",
        f"  parameters      {p.parameters:,}",
        f"  learning rate   {p.lr:g} configured, {p.effective_lr:g} in effect",
        f"  memory per rank at its peak ({p.strategy}, micro-batch {p.per_device_batch_size} x {p.block_size} tokens):",
        f"    parameters    {_gib(estimate.params)}",
        f"    gradients     {_gib(estimate.grads)}",
        f"    optimizer     {_gib(estimate.optimizer)}",
        f"    buffers       {_gib(estimate.buffers)}  (DDP's gradient buckets; ZeRO's reduce bucket and gathered parameters; FSDP's gathered root and layers)",
        f"    activations   {_gib(estimate.activations)}  (one micro-batch traced on fake tensors, with the gradients "
        "backward holds beside them)",
        f"    peak          {_gib(estimate.device_total)}"
        + (f"  (+ {_gib(estimate.offloaded)} offloaded to host memory)" if estimate.offloaded else ""),
    ]
    return "\n".join(lines)
