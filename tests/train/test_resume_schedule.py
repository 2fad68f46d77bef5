"""A resume that plans the schedule over another total (train.max_steps raised) trains
each resumed step at the new plan's rate, from the first one: through Accelerate's
load_state and through the read-across path alike (runner/train/restore.py
load_resume_point). The rate used is read from the optimizer's group as each step runs."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from runner.components.optim import build_optimizer, build_scheduler
from runner.config.spec import spec_to_yaml
from runner.distributed.accelerator import reset_accelerate_state
from runner.train import restore
from runner.train.checkpoint import save_checkpoint

LR = 1e-3


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def built(spec, total_steps: int, run_dir: Path) -> SimpleNamespace:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=64))
    optimizer = build_optimizer(spec.optim, model, LR)
    scheduler = build_scheduler(spec.schedule, optimizer, total_steps)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return SimpleNamespace(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler, run_dir=run_dir)


def train(run: SimpleNamespace, steps: int) -> list[float]:
    """Optimizer steps; the rate each trained at, as the optimizer's groups held it."""
    used = []
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        run.model(input_ids=ids, labels=ids).loss.backward()
        rates = {group["lr"] for group in run.optimizer.param_groups}
        assert len(rates) == 1
        used.append(rates.pop())
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
    return used


def cosine(step: int, total: int) -> float:
    """transformers' cosine without warmup: the step after `step` trains at this rate."""
    return LR * (1 + math.cos(math.pi * step / total)) / 2


@pytest.mark.parametrize("path", ["load_state", "read_across"])
def test_each_resumed_step_trains_at_the_rate_the_new_plan_declares(compose_spec, tmp_path, monkeypatch, path):
    four = compose_spec("schedule=cosine", "schedule.warmup_steps=0", f"optim.lr={LR}", "train.max_steps=4")
    first = built(four, 4, tmp_path)
    assert train(first, 4) == pytest.approx([cosine(k, 4) for k in range(4)], rel=1e-12, abs=0)
    checkpoint = save_checkpoint(first.accelerator, tmp_path, 4, keep=1, extra={"epoch": 0, "world_size": 1},
                                 spec_yaml=spec_to_yaml(four))
    stored = first.scheduler.get_last_lr()
    assert stored == [0.0, 0.0]  # the end of the 4-step cosine: what the checkpoint holds
    if path == "read_across":  # a ddp checkpoint read by parameter name, as another strategy's would be
        monkeypatch.setattr(restore, "needs_reshard", lambda *args: True)

    eight = compose_spec("schedule=cosine", "schedule.warmup_steps=0", f"optim.lr={LR}", "train.max_steps=8")
    resumed = built(eight, 8, tmp_path / "resumed")  # a read-across writes its scratch there
    restore.load_resume_point(eight, resumed.accelerator, resumed, checkpoint)
    assert resumed.scheduler.last_epoch == 4
    assert resumed.scheduler.get_last_lr() == [g["lr"] for g in resumed.optimizer.param_groups]
    assert train(resumed, 4) == pytest.approx([cosine(k, 8) for k in range(4, 8)], rel=1e-12, abs=0)

    same = built(four, 4, tmp_path / "same")  # an unchanged plan: the stored rates back, bit for bit
    restore.load_resume_point(four, same.accelerator, same, checkpoint)
    assert same.scheduler.get_last_lr() == stored == [g["lr"] for g in same.optimizer.param_groups]
