"""The portable state (runner/train/reshard.py) on one process: a ddp checkpoint read by
parameter name and set into a fresh model and optimizer gives back the very tensors,
AdamW moments, step and learning rates that Accelerate's own load_state gives; and
reshard.py names no strategy (each strategy in runner/distributed/ owns its format)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from runner.components.optim import build_scheduler, param_groups
from runner.config.spec import ScheduleKind, ScheduleSpec
from runner.train.reshard import needs_reshard, read_state, set_state, trainable_names


def build(arch: str):
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM

    from runner.certify.architectures import TINY

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch)
    config.update_from_string(TINY[arch])
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-2)
    scheduler = build_scheduler(ScheduleSpec(kind=ScheduleKind.cosine, warmup_steps=1), optimizer, 10)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return accelerator, model, optimizer, scheduler, config.vocab_size


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # tied head; untied head with grouped-query attention
def test_a_ddp_checkpoint_read_by_name_restores_what_load_state_restores(tmp_path, arch):
    accelerator, model, optimizer, scheduler, vocab = build(arch)
    for _ in range(3):
        ids = torch.randint(0, vocab, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path))
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = optimizer.state_dict()

    _, fresh, fresh_optimizer, fresh_scheduler, _ = build(arch)
    fresh_scheduler.load_state_dict(torch.load(tmp_path / "custom_checkpoint_0.pkl", weights_only=False))
    names = trainable_names(fresh, 0.01)
    state = read_state(tmp_path, "ddp", names, tmp_path / "scratch")
    assert state.step == 3.0
    set_state(state, fresh, fresh_optimizer, names, "ddp", fresh_scheduler.get_last_lr())
    for name, param in fresh.named_parameters():
        assert torch.equal(param, expected_params[name]), name
    restored = fresh_optimizer.state_dict()
    for index, values in expected["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(restored["state"][index][key], values[key]), (index, key)
    assert [g["lr"] for g in restored["param_groups"]] == [g["lr"] for g in expected["param_groups"]] != [1e-2, 1e-2]


def test_which_resumes_are_read_across():
    assert not needs_reshard("ddp", "ddp", 2, 1)  # every rank holds everything
    assert not needs_reshard("zero3", "zero3", 2, 2)  # its own layout: Accelerate's load_state
    assert not needs_reshard("fsdp", "fsdp", 2, 4)  # DCP reshards as Accelerate's load_state reads it
    assert needs_reshard("zero3", "zero3", 2, 1) and needs_reshard("fsdp", "ddp", 2, 2) and needs_reshard("ddp", "fsdp", 1, 2)


def test_a_read_across_writes_its_scratch_in_the_resuming_run_not_the_checkpoints_folder(tmp_path, monkeypatch):
    """The conversion's scratch (about three times the fp32 state for ZeRO and FSDP) goes
    into this run's folder: the checkpoint's own folder may be read-only or shared, and a
    second resume of the same checkpoint would remove the first one's scratch. The
    source's checkpoints folder is left as it was: same entries, same modification times."""
    import json
    import os

    import runner.train.reshard as reshard

    accelerator, model, optimizer, scheduler, vocab = build("gpt2")
    ids = torch.randint(0, vocab, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    checkpoint = tmp_path / "source" / "checkpoints" / "step_1"
    accelerator.save_state(str(checkpoint))
    (checkpoint / "COMPLETE.json").write_text(json.dumps({"step": 1, "world_size": 1}))

    def listing() -> dict[str, int]:
        root = tmp_path / "source"
        return {str(p.relative_to(root)): os.stat(p).st_mtime_ns for p in [root, *root.rglob("*")]}

    before = listing()
    scratches = []
    prepare = reshard.prepare
    monkeypatch.setattr(reshard, "prepare", lambda c, s, scratch: (scratches.append(scratch), prepare(c, s, scratch)))
    _, fresh, fresh_optimizer, fresh_scheduler, _ = build("gpt2")
    meta = reshard.load_across(accelerator, checkpoint, "ddp", "ddp", fresh, fresh_optimizer, fresh_scheduler, 0.01,
                               tmp_path / "resumed")
    assert meta["step"] == 1
    assert listing() == before
    assert scratches == [tmp_path / "resumed" / "checkpoints" / ".reshard_step_1"] and not scratches[0].exists()


def test_a_schedule_saved_by_zero_for_adapters_alone_sets_every_group_of_this_run(tmp_path):
    """Adapters alone fill only the weight-decay group: ZeRO leaves the empty no-decay group
    out of its optimizer, and the schedule it saves holds one rate. Read into ddp, whose
    optimizer keeps both groups, each gets the restored rate (the same schedule for every
    group), not a mismatch of groups."""
    import json

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, GPT2Config

    from runner.components.adapters import add_adapters
    from runner.config.spec import PeftKind, PeftSpec
    from runner.train.reshard import load_across

    def adapters():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                                           vocab_size=64))
        model = add_adapters(PeftSpec(kind=PeftKind.lora, rank=4, dropout=0.0), base)
        optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-2)
        scheduler = build_scheduler(ScheduleSpec(kind=ScheduleKind.cosine, warmup_steps=1), optimizer, 10)
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        return accelerator, model, optimizer, scheduler

    accelerator, model, optimizer, _ = adapters()
    assert [len(g["params"]) for g in optimizer.param_groups][1] == 0  # no bias or norm weight among the adapters
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    checkpoint = tmp_path / "source" / "checkpoints" / "step_3"
    accelerator.save_state(str(checkpoint))
    (checkpoint / "COMPLETE.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    # the schedule as ZeRO saves it: over the groups that hold parameters, three steps in
    zero_optimizer = torch.optim.AdamW([p for g in optimizer.param_groups for p in g["params"]], lr=1e-2)
    zero_schedule = build_scheduler(ScheduleSpec(kind=ScheduleKind.cosine, warmup_steps=1), zero_optimizer, 10)
    for _ in range(3):
        zero_optimizer.step()
        zero_schedule.step()
    torch.save(zero_schedule.state_dict(), checkpoint / "custom_checkpoint_0.pkl")

    _, fresh, fresh_optimizer, fresh_scheduler = adapters()
    load_across(accelerator, checkpoint, "ddp", "ddp", fresh, fresh_optimizer, fresh_scheduler, 0.01,
                tmp_path / "resumed")
    rate = zero_schedule.get_last_lr()[0]
    assert 0 < rate < 1e-2
    assert fresh_scheduler.get_last_lr() == [rate, rate] == [g["lr"] for g in fresh_optimizer.param_groups]
    zero_schedule.step()
    fresh_scheduler.step()
    assert fresh_scheduler.get_last_lr() == zero_schedule.get_last_lr() * 2


def test_reshard_names_no_strategy_and_imports_none():
    """The strategy that wrote a checkpoint reads it and the strategy that runs sets it
    (runner/distributed/: strategy.py, fsdp.py, zero_checkpoint.py); reshard.py only pairs
    them, through runner/distributed/strategies.py. A strategy's name, its library or a
    concrete strategy module in it is a format written back into the orchestration."""
    import runner.train.reshard as reshard
    from runner.distributed.strategies import STRATEGIES

    source = Path(reshard.__file__).read_text()
    names = sorted({kind.value for kind in STRATEGIES} | {"zero", "deepspeed", "dcp"})
    named = [f"line {number}: {name!r} in {line.strip()!r}" for number, line in enumerate(source.splitlines(), 1)
             for name in names if name in line.lower()]
    concrete = ("runner.distributed.deepspeed", "runner.distributed.fsdp", "runner.distributed.zero_checkpoint",
                "deepspeed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "safetensors")
    classes = {strategy.__name__ for strategy in STRATEGIES.values()}
    imported = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported += [(node.module or "", alias.name) for alias in node.names]
    forbidden = [(module, name) for module, name in imported
                 if f"{module}.{name}".startswith(concrete) or name in classes]
    assert forbidden == []
    assert not named, "\n".join(named)
    assert ("runner.distributed.strategies", "strategy_of_kind") in imported  # the writer's object, from its kind
