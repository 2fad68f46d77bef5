"""Optimizer and learning-rate schedule builders."""

from __future__ import annotations

import math

import torch

from runner.config.spec import LrScaling, OptimSpec, ScheduleKind, ScheduleSpec


def param_groups(model: "torch.nn.Module", weight_decay: float) -> list[dict]:
    """run_clm_no_trainer's grouping: no decay on biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_norm = "ln_" in name or "layernorm" in name.lower() or "layer_norm" in name.lower() or "norm." in name
        (no_decay if name.endswith("bias") or is_norm else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def effective_lr(spec: OptimSpec, global_batch: int) -> float:
    """The accelerate playbook's rule, applied declaratively: lr tuned at B_ref,
    scaled linearly or by the square root to the run's global batch B."""
    if spec.scale_lr is LrScaling.none or not spec.reference_global_batch:
        return spec.lr
    ratio = global_batch / spec.reference_global_batch
    return spec.lr * (ratio if spec.scale_lr is LrScaling.linear else math.sqrt(ratio))


def build_optimizer(spec: OptimSpec, model: "torch.nn.Module", lr: float) -> "torch.optim.Optimizer":
    return torch.optim.AdamW(
        param_groups(model, spec.weight_decay),
        lr=lr,
        betas=(spec.beta1, spec.beta2),
        eps=spec.eps,
        fused=True if spec.fused else None,
    )


def warmup_steps(spec: ScheduleSpec, total_steps: int) -> int:
    return spec.warmup_steps if spec.warmup_steps > 0 else int(spec.warmup_ratio * total_steps)


def build_scheduler(
    spec: ScheduleSpec, optimizer: "torch.optim.Optimizer", total_steps: int
) -> "torch.optim.lr_scheduler.LambdaLR":
    """Stepped once per optimizer step by the trainer (never prepared by Accelerate,
    which would step it once per process), so the lr at step k is the same at any
    world size."""
    # Here, not at the top: transformers.optimization imports its Trainer's utilities and
    # through them peft and the modelling code (3.5 s), which a launcher checking a
    # resume (planned_rate) has no use for until it builds a schedule.
    from transformers import get_scheduler

    name = {ScheduleKind.linear: "linear", ScheduleKind.cosine: "cosine", ScheduleKind.constant: "constant_with_warmup"}
    return get_scheduler(
        name[spec.kind],
        optimizer=optimizer,
        num_warmup_steps=warmup_steps(spec, total_steps),
        num_training_steps=total_steps,
    )


def horizon_matters(spec: ScheduleSpec, old_total: int, new_total: int) -> bool:
    """Whether planning this schedule over `new_total` steps instead of `old_total` moves
    any rate: linear and cosine decay over the total, and warmup_ratio's warmup is a
    share of it."""
    return spec.kind is not ScheduleKind.constant or warmup_steps(spec, old_total) != warmup_steps(spec, new_total)


def planned_rate(spec: ScheduleSpec, lr: float, total_steps: int, step: int) -> float:
    """The rate the optimizer step after `step` completed steps trains at, by this
    schedule over `total_steps` (the very lambda build_scheduler plans with)."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    return lr * build_scheduler(spec, probe, total_steps).lr_lambdas[0](step)


def follow_plan(scheduler: "torch.optim.lr_scheduler.LambdaLR") -> list[float]:
    """After a checkpoint's scheduler and optimizer states are loaded: set the rates of the
    next step to what this run's plan gives at the restored step, and return them.

    The loaded state holds the rate the checkpoint's own plan gave there (the scheduler's
    last rates and each optimizer group's lr), while the plan itself is this run's: the
    lambdas are not saved (functools.partial keeps nothing in __dict__, so LambdaLR's
    load_state_dict leaves them alone). With another horizon (train.max_steps raised) the
    first resumed step would train at the old plan's rate (0 at a cosine's end) and the
    next jump to the new plan's. LambdaLR's own formula, so an unchanged plan gives the
    stored rates back bit for bit."""
    rates = [base * rate(scheduler.last_epoch) for rate, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = rates  # what get_last_lr() reads; step() sets it the same way
    return rates
