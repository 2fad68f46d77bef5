"""Optimizer and learning-rate schedule builders."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

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
    name = {ScheduleKind.linear: "linear", ScheduleKind.cosine: "cosine", ScheduleKind.constant: "constant_with_warmup"}
    return get_scheduler(
        name[spec.kind],
        optimizer=optimizer,
        num_warmup_steps=warmup_steps(spec, total_steps),
        num_training_steps=total_steps,
    )
