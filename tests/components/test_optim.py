"""Optimizer groups, the lr schedule, and lr scaling with the global batch."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.components.optim import build_optimizer, build_scheduler, effective_lr, param_groups
from runner.config.spec import LrScaling, OptimSpec, ScheduleKind, ScheduleSpec


def test_no_weight_decay_on_biases_and_layernorm():
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=50))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or ".ln_" in names[id(p)] for p in no_decay["params"])
    assert all(not names[id(p)].endswith("bias") and ".ln_" not in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize(
    "rule, per_device, world, accum, expected",
    [
        ("none", 8, 4, 2, 1e-3),
        ("linear", 8, 1, 1, 1e-3),      # B = B_ref
        ("linear", 8, 4, 1, 4e-3),      # 32 / 8
        ("linear", 4, 2, 4, 4e-3),      # 4 x 2 x 4 = 32
        ("linear", 2, 2, 1, 0.5e-3),    # 4 / 8
        ("sqrt", 8, 4, 1, 2e-3),        # sqrt(32 / 8)
        ("sqrt", 8, 8, 2, 4e-3),        # sqrt(128 / 8)
        ("sqrt", 4, 1, 1, 1e-3 * math.sqrt(0.5)),
    ],
)
def test_lr_scaling_arithmetic(rule, per_device, world, accum, expected):
    spec = OptimSpec(lr=1e-3, scale_lr=LrScaling(rule), reference_global_batch=8)
    assert effective_lr(spec, per_device * world * accum) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_schedule_warmup_then_shape(kind):
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(OptimSpec(lr=1.0), model, 1.0)
    scheduler = build_scheduler(ScheduleSpec(kind=kind, warmup_steps=4), optimizer, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    if kind is ScheduleKind.constant:
        assert lrs[-1] == 1.0
    else:
        assert lrs[-1] < 0.2 and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_warmup_ratio():
    from runner.components.optim import warmup_steps

    assert warmup_steps(ScheduleSpec(warmup_ratio=0.1), 200) == 20
    assert warmup_steps(ScheduleSpec(warmup_steps=5, warmup_ratio=0.1), 200) == 5
