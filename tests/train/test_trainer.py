"""Trainer.train_step: the non-finite guard runs before the update, under every path.

The model is a micro GPT-2 run in this process; an inf gradient with a finite loss is
injected by a tensor hook on one weight (the loss stays finite, only the gradient is
bad), so each test shows the check, not a blown-up model.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import GPT2Config, GPT2LMHeadModel

from runner.distributed.accelerator import build_accelerator, reset_accelerate_state
from runner.distributed.engagement import EngagementError, check_engaged
from runner.distributed.strategies import build_strategy
from runner.config.spec import OffloadDevice, OptimSpec, PrecisionKind, PrecisionSpec, RunSpec, StrategyKind, StrategySpec
from runner.components.objectives.base import ObjectiveSetup
from runner.components.objectives.causal_lm import CausalLM
from runner.train.parts import Engine, LoopSettings, TrainData
from runner.train.trainer import NonFiniteLoss, Trainer
from runner.train.verdict import Verdicts

VOCAB = 64


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def micro_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=VOCAB,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


class InfGrad:
    """A hook on one weight that turns its gradient into inf while `on` is set."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.on = False
        param.register_hook(lambda grad: torch.full_like(grad, float("inf")) if self.on else grad)


def make_trainer(accelerator, model, optimizer, tmp_path: Path, strategy: Any = None, max_grad_norm: float = 0.0,
                 max_consecutive_skipped_steps: int = PrecisionSpec.max_consecutive_skipped_steps) -> Trainer:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))  # moves every step
    strategy = strategy or build_strategy(StrategySpec(), PrecisionSpec())
    objective = CausalLM(ObjectiveSetup(accelerator.unwrap_model(model), processes=1, grad_accum_steps=1))
    return Trainer(Engine(accelerator, model, optimizer, scheduler, strategy), TrainData([], []), None, objective,  # type: ignore[arg-type]
                   LoopSettings(tmp_path, max_grad_norm=max_grad_norm,
                                max_consecutive_skipped_steps=max_consecutive_skipped_steps))


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_unchanged(model: torch.nn.Module, before: list[torch.Tensor]) -> None:
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))


def adam_steps(optimizer: torch.optim.Optimizer) -> list[float]:
    inner = optimizer.optimizer  # under Accelerate's wrapper
    return [float(inner.state[p]["step"]) for group in inner.param_groups for p in group["params"] if p in inner.state]


def adam_state(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """A copy of every parameter's AdamW state (exp_avg, exp_avg_sq, step), in order."""
    inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
    return [{k: v.detach().clone() for k, v in inner.state[p].items()} for group in inner.param_groups for p in group["params"]]


def assert_adam_unchanged(optimizer: torch.optim.Optimizer, before: list[dict[str, torch.Tensor]]) -> None:
    now = adam_state(optimizer)
    assert [sorted(s) for s in now] == [sorted(s) for s in before] and all(sorted(s) == ["exp_avg", "exp_avg_sq", "step"] for s in now)
    assert all(torch.equal(s[k], b[k]) for s, b in zip(now, before) for k in s)


def ddp_path_with_inf_hook(tmp_path: Path, max_grad_norm: float, fused: bool):
    """A one-process (ddp-path) trainer whose model can be given an inf gradient."""
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=max_grad_norm)
    model = micro_model()
    inject = InfGrad(model.transformer.h[0].mlp.c_fc.weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, inject, make_trainer(accelerator, model, optimizer, tmp_path, max_grad_norm=max_grad_norm)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0], ids=["clipping_off", "clipping_on"])
def test_inf_gradient_with_finite_loss_stops_before_the_update_host_checked(tmp_path, max_grad_norm):
    """foreach AdamW cannot take a device-side verdict: it is read before the step."""
    model, optimizer, inject, trainer = ddp_path_with_inf_hook(tmp_path, max_grad_norm, fused=False)
    first, second = batches(2)
    assert trainer.train_step(first)
    assert trainer.grad_norm is not None and 0 < float(trainer.grad_norm) < float("inf")  # computed even unclipped
    lr, before, state = trainer.scheduler.get_last_lr(), snapshot(model), adam_state(optimizer)
    inject.on = True
    with pytest.raises(NonFiniteLoss, match="non-finite loss or gradient norm at step 2.*grad norm inf.*stopped before the optimizer step"):
        trainer.train_step(second)
    assert_unchanged(model, before)
    assert_adam_unchanged(optimizer, state)
    assert trainer.scheduler.get_last_lr() == lr and trainer.state.step == 1


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0], ids=["clipping_off", "clipping_on"])
def test_inf_gradient_with_fused_adamw_is_skipped_on_the_device_and_stops_the_run(tmp_path, max_grad_norm):
    """The default fused AdamW gets the verdict as GradScaler's `found_inf`, on the device:
    no host sync in the step; the update (weights and Adam moments) is skipped by the
    kernel, and the host reads the verdict at the next step and stops there."""
    model, optimizer, inject, trainer = ddp_path_with_inf_hook(tmp_path, max_grad_norm, fused=True)
    first, second, third = batches(3)
    assert trainer.train_step(first)
    assert len(trainer.verdicts.pending) == 1  # left on the device, not read by the step
    assert optimizer.optimizer.found_inf is None  # handed to step 1 only
    assert 0 < float(trainer.grad_norm) < float("inf")
    before, state = snapshot(model), adam_state(optimizer)
    assert adam_steps(optimizer) == [1.0] * len(state)
    inject.on = True
    assert trainer.train_step(second)  # nothing read on the host yet...
    assert_unchanged(model, before)  # ...but the kernel skipped the update: weights and Adam state
    assert_adam_unchanged(optimizer, state)
    inject.on = False
    with pytest.raises(NonFiniteLoss, match="non-finite loss or gradient norm at step 2.*grad norm inf.*its update was skipped"):
        trainer.train_step(third)
    assert_unchanged(model, before)
    assert_adam_unchanged(optimizer, state)


def test_a_clean_verdict_left_on_the_device_changes_no_number(tmp_path):
    """Handing fused AdamW found_inf=0 must step exactly as without the flag."""
    runs = []
    for flag in (True, False):
        reset_accelerate_state()
        accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
        model = micro_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        trainer = make_trainer(accelerator, model, optimizer, tmp_path, max_grad_norm=1.0)
        if not flag:
            trainer._found_inf_optimizer = lambda device: None  # the host-checked path
        for batch in batches(3):
            assert trainer.train_step(batch)
        runs.append(snapshot(model))
    assert all(torch.equal(p, q) for p, q in zip(*runs))


class FakeCuda:
    """torch.cuda.Event and pinned host memory, faked on a CPU: events complete when the
    test says so (`ready`), and every wait on one is logged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ready = False
        self.events: list[Any] = []
        self.synchronized: list[int] = []  # indices into events, in the order waited on
        self.queries = 0
        self.host_buffers: list[torch.Tensor] = []  # what torch.empty(..., pin_memory=True) returned
        cuda = self

        class Event:
            def __init__(self) -> None:
                self.recorded = False
                cuda.events.append(self)

            def record(self) -> None:
                self.recorded = True

            def query(self) -> bool:
                cuda.queries += 1
                return cuda.ready

            def synchronize(self) -> None:
                cuda.synchronized.append(cuda.events.index(self))

        real_empty = torch.empty

        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            out = real_empty(*args, **kwargs)
            if pin_memory:  # a CPU-only torch has no pinned allocator
                self.host_buffers.append(out)
            return out

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch, "empty", empty)


class HostReads(TorchFunctionMode):
    """Every call that reads a device tensor on the host (a stream synchronize on a GPU);
    the pinned host copies are exempt. Also logs each copy into a pinned buffer."""

    READS = frozenset({"__bool__", "item", "cpu", "tolist", "__float__", "__int__", "__index__", "numpy"})

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda, self.reads, self.copies_non_blocking = cuda, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        on_host = bool(args) and any(args[0] is b for b in self.cuda.host_buffers)
        if name in self.READS and not on_host:
            self.reads.append(name)
        if name == "copy_" and on_host:
            self.copies_non_blocking.append(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        return func(*args, **kwargs)


def flags_seen_by_each_step(optimizer) -> list[torch.Tensor | None]:
    """Wrap the fused AdamW's step to copy the found_inf it is called with."""
    inner, seen = optimizer.optimizer, []
    step = inner.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        flag = getattr(inner, "found_inf", None)
        seen.append(None if flag is None else flag.detach().clone())
        return step(*args, **kwargs)

    inner.step = recording_step
    return seen


def test_on_a_gpu_each_step_reads_only_verdicts_whose_event_completed(tmp_path, monkeypatch):
    """The GPU path, by contract: each verdict is copied non_blocking into pinned memory
    behind an event; a step reads nothing on the host (no bool/item/cpu, no event wait)
    until query() says the copy landed. Meanwhile the device-side flag, sticky once a step
    is bad, skips every later update, and each flag is cleared after its step. When the
    events complete, the FIRST bad step is reported."""
    model, optimizer, inject, trainer = ddp_path_with_inf_hook(tmp_path, 1.0, fused=True)
    cuda = FakeCuda(monkeypatch)
    trainer.verdicts = Verdicts(asynchronous=True)
    seen = flags_seen_by_each_step(optimizer)
    data = batches(5)
    with HostReads(cuda) as host:
        assert trainer.train_step(data[0])  # step 1: clean, updated
        before, state = snapshot(model), adam_state(optimizer)
        inject.on = True
        assert trainer.train_step(data[1])  # step 2: bad
        inject.on = False
        assert trainer.train_step(data[2])  # step 3: clean, but after a bad one
        inject.on = True
        assert trainer.train_step(data[3])  # step 4: bad
        assert host.reads == [] and cuda.synchronized == [] and cuda.queries == 3  # polled at steps 2, 3, 4
        assert [p.step for p in trainer.verdicts.pending] == [1, 2, 3, 4]
        assert len(cuda.host_buffers) == 4 and host.copies_non_blocking == [True] * 4
        assert all(event.recorded for event in cuda.events) and len(cuda.events) == 4
        assert optimizer.optimizer.found_inf is None  # each flag cleared after its step
        assert_unchanged(model, before)
        assert_adam_unchanged(optimizer, state)
        inject.on = False
        cuda.ready = True
        with pytest.raises(NonFiniteLoss, match="at step 2 .*grad norm inf.*its update was skipped"):
            trainer.train_step(data[4])  # reads step 1 (clean), then step 2: stops before step 5 runs
    assert host.reads == [] and cuda.synchronized == []  # only the pinned copies were read
    assert trainer.verdicts.pending == deque()
    assert [float(f) for f in seen] == [0.0, 1.0, 1.0, 1.0]  # step 3 skipped too: the flag stays set
    assert_unchanged(model, before)
    assert_adam_unchanged(optimizer, state)


def test_on_a_gpu_a_forced_read_waits_on_each_event_in_order(tmp_path, monkeypatch):
    """Before a log, an evaluation, a checkpoint or the end, the verdicts are awaited
    (event.synchronize), oldest first: clean ones pass, and the first bad one stops the
    run before anything is saved."""
    _, _, inject, trainer = ddp_path_with_inf_hook(tmp_path, 1.0, fused=True)
    cuda = FakeCuda(monkeypatch)
    trainer.verdicts = Verdicts(asynchronous=True)
    data = batches(5)
    assert trainer.train_step(data[0]) and trainer.train_step(data[1])
    trainer._read_verdict()  # as fit does before a log or an evaluation
    assert cuda.synchronized == [0, 1] and trainer.verdicts.pending == deque()
    assert trainer.train_step(data[2])  # step 3: clean
    inject.on = True
    assert trainer.train_step(data[3]) and trainer.train_step(data[4])  # steps 4 and 5: bad
    with pytest.raises(NonFiniteLoss, match="at step 4 "):
        trainer.save_checkpoint()
    assert cuda.synchronized == [0, 1, 2, 3]  # up to the first bad one
    assert not (tmp_path / "checkpoints").exists()


def test_parameters_on_another_device_than_the_loss_are_checked_on_the_host(tmp_path, monkeypatch):
    """FSDP2 with offload_params=cpu: the loss on the GPU, fused AdamW on CPU parameters.
    The flag would cross devices inside the kernel (a non_blocking copy into pageable
    memory), so the verdict is read before the step instead."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    for kind in (StrategyKind.ddp, StrategyKind.fsdp):
        strategy = build_strategy(StrategySpec(kind=kind), PrecisionSpec())
        fused = torch.optim.AdamW(params, fused=True)
        assert strategy.found_inf_optimizer(fused, torch.device("cpu")) is fused
        assert strategy.found_inf_optimizer(fused, torch.device("cuda")) is None
        assert strategy.found_inf_optimizer(torch.optim.AdamW(params, fused=False), torch.device("cpu")) is None
    model, optimizer, inject, trainer = ddp_path_with_inf_hook(tmp_path, 1.0, fused=True)
    real = trainer.strategy.found_inf_optimizer
    monkeypatch.setattr(trainer.strategy, "found_inf_optimizer", lambda opt, device: real(opt, torch.device("cuda")))
    first, second = batches(2)
    assert trainer.train_step(first) and trainer.verdicts.pending == deque()  # read at once, not deferred
    before, state = snapshot(model), adam_state(optimizer)
    inject.on = True
    with pytest.raises(NonFiniteLoss, match="at step 2 .*stopped before the optimizer step"):
        trainer.train_step(second)
    assert getattr(optimizer.optimizer, "found_inf", None) is None  # never handed a flag
    assert_unchanged(model, before)
    assert_adam_unchanged(optimizer, state)


def fp16_on_cpu(tmp_path: Path, **kwargs):
    """Accelerate's CUDA fp16 path, reproduced on a CPU: the GradScaler Accelerate builds on
    a GPU (here torch.amp.GradScaler("cpu")) drives backward, unscale and step, with the
    fused AdamW runner builds by default."""
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec(kind=PrecisionKind.fp16)), grad_accum_steps=1, max_grad_norm=0.0)
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None  # on a CPU Accelerate has none
    model = micro_model()
    inject = InfGrad(model.transformer.h[0].mlp.c_fc.weight)
    model = accelerator.prepare(model)  # the forward stays fp32; the scaler is what matters here
    accelerator.scaler, accelerator.native_amp = torch.amp.GradScaler("cpu"), True
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    return accelerator, model, inject, make_trainer(accelerator, model, optimizer, tmp_path, **kwargs)


def test_fp16_overflow_with_fused_adamw_counts_as_skipped_and_holds_the_schedule(tmp_path):
    accelerator, model, inject, trainer = fp16_on_cpu(tmp_path)
    first, second, third = batches(3)
    assert trainer.train_step(first) and trainer.state.skipped_steps == 0
    scale, lr, before = accelerator.scaler.get_scale(), trainer.scheduler.get_last_lr(), snapshot(model)
    inject.on = True
    assert trainer.train_step(second)  # an optimizer step's worth of data, but not stepped
    # What makes the detection necessary: Accelerate's flag misses the skip (fused AdamW).
    assert accelerator.optimizer_step_was_skipped is False
    assert trainer.state.skipped_steps == 1 and accelerator.scaler.get_scale() == scale / 2
    assert trainer.scheduler.get_last_lr() == lr
    assert_unchanged(model, before)
    inject.on = False
    assert trainer.train_step(third)
    assert trainer.scheduler.get_last_lr() != lr and trainer.state.consecutive_skips == 0
    assert not all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))


def test_fp16_consecutive_overflows_stop_the_run(tmp_path):
    accelerator, model, inject, trainer = fp16_on_cpu(tmp_path, max_consecutive_skipped_steps=3)
    data = batches(6)
    inject.on = True
    assert trainer.train_step(data[0]) and trainer.train_step(data[1])  # two skips: not yet
    inject.on = False
    assert trainer.train_step(data[2])  # a step taken resets the count
    inject.on = True
    assert trainer.train_step(data[3]) and trainer.train_step(data[4])
    with pytest.raises(NonFiniteLoss, match=r"3 optimizer steps in a row were skipped.*steps 4-6.*precision.max_consecutive_skipped_steps"):
        trainer.train_step(data[5])
    assert trainer.state.skipped_steps == 5


@pytest.mark.e2e
@pytest.mark.parametrize("bad", ["mlp.c_fc.weight", "mlp.c_fc.bias"])
def test_under_deepspeed_the_check_runs_before_the_engine_steps(tmp_path, monkeypatch, bad):
    """ZeRO-2 in one process (gloo), with runner's optimizer and its two parameter
    groups (weight decay on matrices, none on biases and norms), as every run has them:
    the engagement check reads the engine's offload and optimizer; an inf gradient in
    either group stops the run with the engine's weights and step count as they were
    (Accelerate's own backward would have stepped the engine already). ZeRO-2's norm is
    one per group combined: a group left out of it, or an inf group norm turned finite
    (DeepSpeed 0.19.7 and older), lets the update through."""
    from runner.components.optim import build_optimizer
    from runner.launch.launcher import free_port, prepare_environment

    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    prepare_environment(1)
    zero2 = build_strategy(StrategySpec(kind=StrategyKind.zero2), PrecisionSpec())
    accelerator = build_accelerator(zero2, grad_accum_steps=1, max_grad_norm=0.0,
                                    per_device_batch_size=2)  # DeepSpeed's micro-batch, as the loader below
    try:
        model = micro_model()
        param = model.transformer.h[0].get_parameter(bad)
        inject = InfGrad(param)
        loader = torch.utils.data.DataLoader(list(torch.zeros(4, 8, dtype=torch.long)), batch_size=2)  # sets DeepSpeed's micro-batch
        optimizer = build_optimizer(OptimSpec(fused=False, weight_decay=0.1), model, 1e-2)
        group = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        assert len(optimizer.param_groups) == 2 and group[id(param)] == (0 if bad.endswith("weight") else 1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        assert len(model.optimizer.bit16_groups) == 2  # ZeRO-2 partitions each group on its own
        spec = RunSpec(strategy=StrategySpec(kind=StrategyKind.zero2), optim=OptimSpec(fused=False))
        assert check_engaged(accelerator, model, optimizer, spec, planned_world_size=1) == "AdamW (foreach)"
        spec.strategy.offload_optimizer = OffloadDevice.cpu
        with pytest.raises(EngagementError, match="offloads offload_optimizer to none, expected cpu.*DeepSpeedCPUAdam"):
            check_engaged(accelerator, model, optimizer, spec, planned_world_size=1)
        trainer = make_trainer(accelerator, model, optimizer, tmp_path, strategy=zero2)
        first, second = batches(2)
        assert trainer.train_step(first) and model.global_steps == 1
        assert 0 < float(trainer.grad_norm) < float("inf")
        before = snapshot(model)
        inject.on = True
        with pytest.raises(NonFiniteLoss, match="grad norm inf"):
            trainer.train_step(second)
        assert model.global_steps == 1 and model.global_samples == first["input_ids"].shape[0]
        assert_unchanged(model, before)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
