"""One object per strategy (ddp, zero, fsdp), one interface: what the worker and the
trainer ask of a strategy, so neither branches on which one runs.

`Strategy` is the interface, its defaults the plain Accelerate path (torch's optimizer
and GradScaler, the model's own parameters), which `DDPStrategy` (ddp, or one process)
adds only its engagement check to; runner/distributed/deepspeed.py
and runner/distributed/fsdp.py override what differs. The object is built from the
spec before the Accelerator (runner/distributed/strategies.py) and lives for the run.

Order of use (runner/train/worker.py, runner/train/trainer.py):
  accelerator_options -> after_accelerator -> before_prepare -> prepare -> after_prepare
  -> engagement_problems -> frozen_copy (a frozen reference) -> per micro-batch: backward; per window: grad_norm,
  found_inf_optimizer, optimizer_step, loss_scale -> after_evaluation -> parameter_pieces
  (fingerprints) -> full_state_dict (model/) -> alone (peft.save_merged, rank 0).
A resume in another layout or strategy (runner/train/resume.py, runner/train/reshard.py):
  loads_at_any_world_size, read_across_refusal -> the writer's prepare_portable (main
  process) and read_portable -> this run's set_portable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate
from pathlib import Path
from types import MethodType
from typing import Any, Optional

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from runner.config.errors import UserError
from runner.config.spec import PrecisionKind, PrecisionSpec, StrategyKind, StrategySpec
from runner.distributed.grad_norm import clip_and_norm
from runner.distributed.patches import fence_notes
from runner.distributed.portable import PortableState, adam_state, one_step, only

# Accelerate's name for each precision.
MIXED_PRECISION = {PrecisionKind.fp32: "no", PrecisionKind.bf16: "bf16", PrecisionKind.fp16: "fp16"}


def innermost_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's wrapper and, under DeepSpeed, ZeRO's."""
    inner = optimizer
    while hasattr(inner, "optimizer"):  # AcceleratedOptimizer, DeepSpeed's wrapper, its ZeRO optimizer
        inner = inner.optimizer
    return inner


def adamw_name(fused: bool) -> str:
    return f"AdamW ({'fused' if fused else 'foreach'})"


class Strategy:
    """The interface, with the plain Accelerate path as its default behaviour."""

    library = "torch"  # whose private code this strategy may patch (runner/distributed/patches.py)

    def __init__(self, spec: StrategySpec, precision: PrecisionSpec) -> None:
        self.spec = spec
        self.precision = precision

    @property
    def kind(self) -> StrategyKind:
        return self.spec.kind

    @property
    def name(self) -> str:
        return self.spec.kind.value

    # ------------------------------------------------------------ the launcher
    def needs_process_group(self) -> bool:
        """True when even one process needs a process group (DeepSpeed always does; FSDP2
        shards over one)."""
        return False

    def spec_notes(self, fused: bool) -> list[str]:
        """What the strategy will do that the spec's keys do not say."""
        return []

    def compile_note(self) -> str:
        """What model.compile=true (each layer compiled in place, runner/components/compile.py)
        gives under this strategy, for the banner."""
        return "each transformer layer compiled in place (inductor); compile time and recompilations are reported at the end"

    def precision_policy(self) -> str:
        """What `precision` means under this strategy: the dtype of the weights, the compute,
        the gradients and the optimizer's copy. bf16 is three different numerics across
        ddp, zero2/zero3 and fsdp, so a bf16 parity sweep across them allows for bf16
        rounding (runner/report/parity.py)."""
        kind = self.precision.kind
        if kind is PrecisionKind.fp32:
            return "fp32 throughout (TF32 off)"
        scaling = "; dynamic loss scaling (GradScaler)" if kind is PrecisionKind.fp16 else ""
        return f"{kind.value} autocast over fp32 weights: matmuls in {kind.value}; weights, gradients and AdamW in fp32{scaling}"

    def notes(self, fused: bool) -> list[str]:
        """What run_spec.yaml and the start banner say beside the spec: the strategy's own
        notes, the precision policy, and each private patch of the libraries it uses left
        out on this machine."""
        return [*self.spec_notes(fused), f"precision: {self.precision_policy()}", *fence_notes({"torch", "accelerate", self.library})]

    # ------------------------------------------------------------ the Accelerator
    def accelerator_options(self, *, cuda: bool, grad_accum_steps: int, max_grad_norm: float,
                            per_device_batch_size: int, world_size: int, hidden_size: Optional[int],
                            model_type: str, layer_parameters: int | None = None,
                            layer_classes: Sequence[str] = ()) -> dict[str, Any]:
        """Keyword arguments for Accelerator(): a plugin, and whether it runs as `cpu`.
        DDP on CPU needs cpu=True, else two unsynchronised copies."""
        return {"cpu": not cuda}

    def after_accelerator(self, accelerator: "Accelerator") -> None:
        """What Accelerate does not do for this strategy itself."""

    # ------------------------------------------------------------ prepare()
    def before_prepare(self, model: torch.nn.Module, accelerator: "Accelerator") -> None:
        """Called with the bare model just before accelerator.prepare()."""

    def after_prepare(self, accelerator: "Accelerator", model: Any) -> None:
        """Called with the prepared model."""

    def engagement_problems(self, accelerator: "Accelerator", model: Any, planned_world_size: int) -> list[str]:
        """What differs between the wrapping in effect and the spec (empty: engaged as asked)."""
        return []

    def expected_optimizer(self, fused: bool) -> str:
        """The optimizer the run will step, as engaged_optimizer names it."""
        return adamw_name(fused)

    # ------------------------------------------------------------ a step
    def backward(self, accelerator: "Accelerator", loss: torch.Tensor) -> None:
        accelerator.backward(loss)

    def grad_norm(self, accelerator: "Accelerator", model: Any, max_grad_norm: float) -> torch.Tensor:
        """The global gradient norm before the optimizer step (0-d float64, not read on the
        host), clipping to `max_grad_norm` when it is > 0. Under DDP the gradients are
        already all-reduced, so the local norm is the global one; under fp16 they are
        unscaled first (and what is clipped is the true gradient)."""
        accelerator.unscale_gradients()  # a no-op unless fp16
        return clip_and_norm([p for p in model.parameters() if p.grad is not None], max_grad_norm)

    def found_inf_optimizer(self, optimizer: Any, device: torch.device) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer if it skips its own update on a `found_inf` flag that lives
        on `device` (the loss's; GradScaler's protocol, torch's fused AdamW); None otherwise.

        None too when any parameter is on another device (FSDP2 with offload_params=cpu:
        the loss on the GPU, the fused step on the CPU). The kernel would copy the flag to
        the CPU with non_blocking=True into pageable memory and could read it before the
        copy lands, so the verdict is checked on the host before the step instead."""
        inner = innermost_optimizer(optimizer)
        if not getattr(inner, "_step_supports_amp_scaling", False):
            return None
        params = (p for group in inner.param_groups for p in group["params"])
        return inner if all(p.device == device for p in params) else None

    def optimizer_step(self, accelerator: "Accelerator", optimizer: Any) -> bool:
        """Step the optimizer of a closed accumulation window; False when the step was
        skipped (an fp16 overflow)."""
        scaler = getattr(accelerator, "scaler", None)
        scale_before = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        optimizer.step()
        if accelerator.optimizer_step_was_skipped:
            return False
        # With a fused AdamW, GradScaler.step always calls optimizer.step() (the kernel
        # skips the update itself on found_inf), so Accelerate's flag stays False. The
        # sign of a skip is then the scale backing off (update() halves it on found_inf).
        return scale_before is None or scaler.get_scale() >= scale_before

    def loss_scale(self, accelerator: "Accelerator", model: Any) -> Optional[float]:
        """fp16's dynamic loss scale, else None."""
        scaler = getattr(accelerator, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def after_evaluation(self, model: Any) -> None:
        """Called after an evaluation's last forward (and after each forward of a frozen copy)."""

    # ------------------------------------------------------------ a frozen copy (preference.reference=frozen)
    def frozen_copy(self, accelerator: "Accelerator", build: Callable[[], torch.nn.Module]) -> Any:
        """A second model that only scores: `build()` (the starting weights) prepared as
        this strategy prepares the policy, minus everything training needs: eval mode, no
        gradient, no optimizer; never stepped, saved or checkpointed (Accelerate is not
        told of it). Its forward runs in the policy's precision. Here (ddp, one process)
        a whole copy on the device, under the autocast Accelerate wraps the policy's
        forward in."""
        from accelerate.utils import get_mixed_precision_context_manager

        model = build().requires_grad_(False).to(accelerator.device).eval()
        if accelerator.native_amp:  # as Accelerator.prepare_model wraps the policy's forward
            autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
            model.forward = MethodType(autocast(model.forward.__func__), model)
        return model

    # ------------------------------------------------------------ the end
    def parameter_pieces(self, model: Any) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """For each parameter, in the same order on every rank: (this rank's shard, or None
        when the parameter is not sharded; the whole parameter if this rank holds it, else
        None). Nothing is gathered (runner/distributed/engagement.py rank_fingerprints)."""
        for p in model.parameters():
            yield None, p

    def full_state_dict(self, accelerator: "Accelerator", model: Any) -> dict[str, Any]:
        """The whole model's fp32 state dict on the main process (empty elsewhere); a
        collective: every rank calls it. A sharding strategy gathers one parameter at a
        time into it, never the whole model on the device (tests/train/test_finish.py)."""
        return accelerator.get_state_dict(model)

    def alone(self, accelerator: "Accelerator") -> AbstractContextManager[None]:
        """Around work one rank does by itself on a model of its own, outside the wrapped
        one (the merged export: a base read again and merged with peft): nothing in it may
        start a collective, which the other ranks would never join."""
        return nullcontext()

    # ------------------------------------------------------------ a checkpoint read across
    # The strategy that wrote a checkpoint reads it; the strategy that runs sets it
    # (runner/train/reshard.py pairs them). The defaults are ddp's format: the whole model
    # and torch AdamW's state on every rank (`model.safetensors`, `optimizer.bin`).
    def loads_at_any_world_size(self) -> bool:
        """Whether Accelerate's own load_state reads this strategy's checkpoint at another
        number of processes (else it is read across as a portable state): every rank holds
        everything here."""
        return True

    def read_across_refusal(self) -> Optional[str]:
        """Why a portable state cannot be set into this strategy on this machine, naming
        the strategies that can (None: it can)."""
        return None

    def prepare_portable(self, checkpoint: Path, scratch: Path) -> None:
        """What the main process does once, into `scratch`, before every rank reads this
        strategy's checkpoint: nothing for one written whole."""

    def read_portable(self, checkpoint: Path, names: list[str], scratch: Path) -> PortableState:
        """The portable state of a checkpoint this strategy wrote (after prepare_portable).
        `names` are this run's trainable parameters in its optimizer's order, which keys
        torch's optimizer.bin (the run rebuilds it from the same spec)."""
        from safetensors.torch import load_file

        file = checkpoint / "model.safetensors"
        weights = (load_file(str(file)) if file.exists()
                   else torch.load(checkpoint / "pytorch_model.bin", map_location="cpu"))
        optim = torch.load(checkpoint / "optimizer.bin", map_location="cpu", weights_only=False)
        ids = [i for group in optim["param_groups"] for i in group["params"]]
        if len(ids) != len(names):
            raise UserError(f"checkpoint {checkpoint}: its optimizer holds {len(ids)} parameters, this run trains "
                            f"{len(names)}. Resume it with its own spec, or start a new run.")
        state = {names[position]: optim["state"][i] for position, i in enumerate(ids)}
        return PortableState(only(names, weights, "model", checkpoint), {n: s["exp_avg"] for n, s in state.items()},
                             {n: s["exp_avg_sq"] for n, s in state.items()}, one_step(state.values(), checkpoint))

    def set_portable(self, state: PortableState, model: torch.nn.Module, optimizer: Any, names: list[str],
                     groups: list[dict[str, Any]]) -> None:
        """The portable state into this run's prepared (unwrapped) `model` and `optimizer`
        (Accelerate's wrapper); `groups` are the optimizer's group settings, with the
        restored schedule's learning rates. Here: into the parameters and torch's
        load_state_dict, keyed by the optimizer's order."""
        inner = innermost_optimizer(optimizer)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in names:
                params[name].copy_(state.weights[name].view_as(params[name]))
        by_param = {id(params[n]): n for n in names}
        order = [by_param[id(p)] for group in inner.param_groups for p in group["params"]]
        starts = [0, *accumulate(len(group["params"]) for group in inner.param_groups)]  # each group's first index
        inner.load_state_dict({
            "state": {i: adam_state(state, n, params[n]) for i, n in enumerate(order)},
            "param_groups": [{**g, "params": list(range(start, start + len(group["params"])))}
                             for g, group, start in zip(groups, inner.param_groups, starts)],
        })


class DDPStrategy(Strategy):
    """strategy=ddp: DistributedDataParallel across processes; one process runs the same
    path unwrapped."""

    def engagement_problems(self, accelerator: "Accelerator", model: Any, planned_world_size: int) -> list[str]:
        if planned_world_size <= 1:
            return []
        if not isinstance(model, DistributedDataParallel):
            return [f"expected DistributedDataParallel, got {type(model).__name__} ({accelerator.state.distributed_type})"]
        return []
