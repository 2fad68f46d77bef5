"""Resume a checkpoint on another number of processes or under another strategy.

A checkpoint holds what its strategy holds: ddp the whole model and torch AdamW's state
(`model.safetensors`, `optimizer.bin`); fsdp each rank's shards as a DCP checkpoint
(`pytorch_model_fsdp_0/`, `optimizer_0/`, keyed by parameter name); zero2/zero3 each
rank's partitions of DeepSpeed's flat fp32 groups and Adam moments
(`pytorch_model/zero_pp_rank_R_*`). Accelerate's `load_state` reads each back only in
the strategy that wrote it: ddp's at any world size, fsdp's too (DCP reshards as it
loads), DeepSpeed's only at its own.

Across, the checkpoint is read as one portable state, by parameter name: the fp32
master weights (never re-derived from bf16 weights), AdamW's exp_avg and exp_avg_sq,
and its step count. Each format is read with its library's own tool: safetensors and
torch for ddp; torch's `dcp_to_torch_save` for DCP, which reassembles every shard;
DeepSpeed's universal-checkpoint converter (`ds_to_universal`) for ZeRO, which merges
the partitions per parameter. The state is then set into this run's model and
optimizer: plainly under ddp; under fsdp through torch's `set_model_state_dict` /
`set_optimizer_state_dict`, and under ZeRO through DeepSpeed's tensor-fragment API
(`safe_set_full_fp32_param`, `safe_set_full_optimizer_state`), each of which keeps
each rank's own shard or partition of the full tensors. The schedule and each rank's random state come from the same files
as in a plain resume.

With adapters (peft) the trainable parameters are the adapters and modules_to_save: they
are the portable state, and the frozen base is this run's own pretrained model, which
training never changed.

Reading a checkpoint this way holds the whole fp32 state (weights and two moments) in
each process's host memory, once, at the resume.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from runner.components.optim import param_groups
from runner.config.errors import UserError
from runner.distributed.patches import ZERO2_LINK_READ_ACROSS_STATE, engaged
from runner.distributed.strategy import innermost_optimizer
from runner.train.checkpoint import CHECKPOINTS_DIRNAME, read_marker
from runner.train.rng import restore_random_states

log = logging.getLogger(__name__)

READS = ("ddp", "zero2", "zero3", "fsdp")  # the checkpoints read into a portable state
WRITES = ("ddp", "zero2", "zero3", "fsdp")  # the strategies a portable state is set into
SCRATCH_DIRNAME = ".reshard"  # in the resuming run's checkpoints folder; removed after the resume


@dataclass
class PortableState:
    """A checkpoint's trainable parameters by name: fp32 master weights, AdamW moments, step."""

    weights: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: float


def needs_reshard(old_strategy: str, new_strategy: str, old_world: int, new_world: int) -> bool:
    """Whether Accelerate's own load_state cannot read the checkpoint in this run: another
    strategy, or another world size under ZeRO. ddp holds everything on each rank; fsdp's
    DCP checkpoint is resharded by `torch.distributed.checkpoint.load` itself, each rank
    reading only the pieces of its new shards (no gather)."""
    return old_strategy != new_strategy or (old_world != new_world and old_strategy not in ("ddp", "fsdp"))


def unsupported(old_strategy: str, new_strategy: str, old_world: int, precision: str,
                offload: bool = False) -> Optional[str]:
    """Why this checkpoint cannot be resharded into this run (None: it can)."""
    own = f"in the checkpoint's own layout ({old_world} processes under strategy={old_strategy})"
    if offload:  # DeepSpeedCPUAdam keeps its own state format; not verified across yet
        return f"a checkpoint read across with strategy.offload_optimizer or offload_params set is not verified yet; resume {own}"
    if new_strategy not in WRITES:
        return (f"resuming under strategy={new_strategy} from another number of processes or another strategy is not "
                f"supported: resume under strategy={', '.join(WRITES)}, or {own}")
    if new_strategy == "zero2" and not engaged(ZERO2_LINK_READ_ACROSS_STATE):
        return (f"resuming under zero2 from another layout or strategy needs DeepSpeed "
                f"{', '.join(ZERO2_LINK_READ_ACROSS_STATE.verified)} (runner/distributed/patches.py): resume under "
                f"strategy=zero3, ddp or fsdp, or {own}")
    if precision == "fp16":
        return (f"precision=fp16: the dynamic loss scale is kept by each strategy's own scaler and does not move "
                f"across; resume {own}")
    return None


# ---------------------------------------------------------------------- reading
def prepare(checkpoint: Path, strategy: str, scratch: Path) -> None:
    """What the main process does once before every rank reads the state: reassemble a
    DCP checkpoint (fsdp) into whole tensors, or convert a ZeRO one to DeepSpeed's
    universal format, into `scratch`."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    if strategy == "fsdp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(checkpoint / "pytorch_model_fsdp_0"), str(scratch / "model.pt"))
        dcp_to_torch_save(str(checkpoint / "optimizer_0"), str(scratch / "optimizer.pt"))
    elif strategy in ("zero2", "zero3"):
        convert_zero(checkpoint, scratch)


def read_state(checkpoint: Path, strategy: str, names: list[str], scratch: Path) -> PortableState:
    """The portable state of a checkpoint written under `strategy` (after `prepare`).
    `names` are this run's trainable parameters in its optimizer's order (ddp's
    optimizer.bin is keyed by that order)."""
    if strategy == "ddp":
        return _read_ddp(checkpoint, names)
    if strategy == "fsdp":
        return _read_fsdp(checkpoint, names, scratch)
    return _read_universal(scratch / "universal", names)


def _only(names: list[str], found: dict[str, torch.Tensor], what: str, checkpoint: Path) -> dict[str, torch.Tensor]:
    missing = [n for n in names if n not in found]
    if missing:
        raise UserError(f"checkpoint {checkpoint}: its {what} has no {missing[:3]} ({len(missing)} missing): it was not "
                        "written for this model. Resume it with its own spec, or start a new run.")
    return {n: found[n].float() for n in names}


def _read_ddp(checkpoint: Path, names: list[str]) -> PortableState:
    from safetensors.torch import load_file

    file = checkpoint / "model.safetensors"
    weights = load_file(str(file)) if file.exists() else torch.load(checkpoint / "pytorch_model.bin", map_location="cpu")
    optim = torch.load(checkpoint / "optimizer.bin", map_location="cpu", weights_only=False)
    ids = [i for group in optim["param_groups"] for i in group["params"]]
    if len(ids) != len(names):
        raise UserError(f"checkpoint {checkpoint}: its optimizer holds {len(ids)} parameters, this run trains "
                        f"{len(names)}. Resume it with its own spec, or start a new run.")
    state = {names[position]: optim["state"][i] for position, i in enumerate(ids)}
    return PortableState(_only(names, weights, "model", checkpoint),
                         {n: s["exp_avg"] for n, s in state.items()}, {n: s["exp_avg_sq"] for n, s in state.items()},
                         _one_step(state.values(), checkpoint))


def _read_fsdp(checkpoint: Path, names: list[str], scratch: Path) -> PortableState:
    model = torch.load(scratch / "model.pt", map_location="cpu", weights_only=False)["model"]
    optim = torch.load(scratch / "optimizer.pt", map_location="cpu", weights_only=False)["optimizer"]["state"]
    state = {n: optim[n] for n in names if n in optim}
    return PortableState(_only(names, model, "model", checkpoint),
                         _only(names, {n: s["exp_avg"] for n, s in state.items()}, "optimizer", checkpoint),
                         _only(names, {n: s["exp_avg_sq"] for n, s in state.items()}, "optimizer", checkpoint),
                         _one_step(state.values(), checkpoint))


def convert_zero(checkpoint: Path, scratch: Path) -> None:
    """DeepSpeed's universal checkpoint of a ZeRO checkpoint, in `scratch/universal` (main
    process only). The converter asks for the `universal_checkpoint_info` a Megatron
    client stores (an empty one serves a plain model): given to a copy of the small
    model-state files, the shards themselves are linked, not copied."""
    source = checkpoint / "pytorch_model"
    given = scratch / "zero_input"
    given.mkdir(parents=True)
    for file in source.iterdir():
        if file.name.endswith("model_states.pt"):
            state = torch.load(file, map_location="cpu", weights_only=False)
            state.setdefault("universal_checkpoint_info", {})
            torch.save(state, given / file.name)
        else:
            (given / file.name).symlink_to(file.resolve())
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(given),
         "--output_folder", str(scratch / "universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"],
        capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        raise UserError(f"checkpoint {checkpoint}: DeepSpeed's universal-checkpoint conversion failed ({last[0]}). "
                        "Resume it in its own layout, or start a new run.")


def _read_universal(universal: Path, names: list[str]) -> PortableState:
    """ds_to_universal's folder: zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt, a tensor or
    {'param': tensor} (flattened under ZeRO-3), and the step per parameter (zero2) or in
    the optimizer's common state (zero3)."""
    root = universal / "zero"

    def tensor(name: str, what: str) -> torch.Tensor:
        value = torch.load(root / name / f"{what}.pt", map_location="cpu", weights_only=False)
        return (value["param"] if isinstance(value, dict) else value).detach().float()

    missing = [n for n in names if not (root / n).is_dir()]
    if missing:
        raise UserError(f"checkpoint: the universal conversion has no {missing[:3]} ({len(missing)} missing): it was "
                        "not written for this model. Resume it with its own spec, or start a new run.")
    weights = {n: tensor(n, "fp32") for n in names}
    steps = [torch.load(root / n / "step.pt", weights_only=False) for n in names if (root / n / "step.pt").exists()]
    if not steps:
        common = torch.load(root / "optimizer_state.pt", map_location="cpu", weights_only=False)
        steps = [s["step"] for s in common["optimizer_state_dict"]["state"].values() if "step" in s]
    return PortableState(weights, {n: tensor(n, "exp_avg") for n in names}, {n: tensor(n, "exp_avg_sq") for n in names},
                         _one_step([{"step": s} for s in steps], universal))


def _one_step(states: Any, where: Path) -> float:
    steps = {float(s["step"]) for s in states if "step" in s}
    if len(steps) != 1:
        raise UserError(f"checkpoint {where}: its optimizer's step counts disagree ({sorted(steps)}). "
                        "Resume it in its own layout.")
    return steps.pop()


# ---------------------------------------------------------------------- setting
def trainable_names(model: torch.nn.Module, weight_decay: float) -> list[str]:
    """This run's trainable parameters by name, in the order its optimizer holds them."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for group in param_groups(model, weight_decay) for p in group["params"]]


def set_state(state: PortableState, model: torch.nn.Module, optimizer: Any, names: list[str], strategy: str,
              last_lrs: list[float]) -> None:
    """The portable state into this run's (prepared) model and optimizer; the learning rates
    of the restored schedule into the optimizer's groups, as a plain resume restores them."""
    inner = innermost_optimizer(optimizer)
    groups = []
    for group, lr in zip(inner.param_groups, last_lrs):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "lr": lr})
    if strategy == "fsdp":
        _set_fsdp(state, model, inner, names, groups)
        return
    if strategy in ("zero2", "zero3"):
        _set_zero(state, model, optimizer, inner, names, groups)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].copy_(state.weights[name].view_as(params[name]))
    by_param = {id(params[n]): n for n in names}
    order = [by_param[id(p)] for group in inner.param_groups for p in group["params"]]
    inner.load_state_dict({
        "state": {i: _adam(state, n, params[n]) for i, n in enumerate(order)},
        "param_groups": [{**g, "params": list(range(start, start + len(group["params"])))}
                         for g, group, start in zip(groups, inner.param_groups, _starts(inner.param_groups))],
    })


def _starts(groups: list[dict[str, Any]]) -> list[int]:
    starts, at = [], 0
    for group in groups:
        starts.append(at)
        at += len(group["params"])
    return starts


def _adam(state: PortableState, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    shape = param.shape
    return {"step": torch.tensor(state.step, dtype=torch.float32),
            "exp_avg": state.exp_avg[name].reshape(shape), "exp_avg_sq": state.exp_avg_sq[name].reshape(shape)}


def _set_fsdp(state: PortableState, model: torch.nn.Module, inner: Any, names: list[str],
              groups: list[dict[str, Any]]) -> None:
    """Full tensors in, each rank keeping its own shard (torch's state-dict API for FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    params = dict(model.named_parameters())
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, {n: state.weights[n].view(params[n].shape) for n in names}, options=options)
    by_param = {id(params[n]): n for n in names}
    fqn_groups = [[by_param[id(p)] for p in group["params"]] for group in inner.param_groups]
    set_optimizer_state_dict(model, inner, {
        "state": {n: _adam(state, n, params[n]) for n in names},
        "param_groups": [{**g, "params": fqns} for g, fqns in zip(groups, fqn_groups)],
    }, options=options)


def load_across(accelerator: Any, checkpoint: Path, old_strategy: str, new_strategy: str, model: torch.nn.Module,
                optimizer: Any, scheduler: Any, weight_decay: float, run_dir: Path) -> dict[str, Any]:
    """Restore a checkpoint of another layout or strategy into this run's prepared model,
    optimizer and schedule, and each rank's random state; returns its loop state (as
    checkpoint.load_checkpoint does for a checkpoint of this layout). The conversion's
    scratch (up to about three times the fp32 state) goes into this run's folder
    `run_dir`, never the checkpoint's: that one may be read-only or shared, and another
    run resuming the same checkpoint would remove it."""
    meta = read_marker(checkpoint)
    scratch = run_dir / CHECKPOINTS_DIRNAME / f"{SCRATCH_DIRNAME}_{checkpoint.name}"
    bare = accelerator.unwrap_model(model)
    names = trainable_names(bare, weight_decay)
    try:
        if accelerator.is_main_process:
            prepare(checkpoint, old_strategy, scratch)
        accelerator.wait_for_everyone()
        state = read_state(checkpoint, old_strategy, names, scratch)
        scheduler.load_state_dict(torch.load(checkpoint / "custom_checkpoint_0.pkl", weights_only=False))
        _one_rate_per_group(getattr(scheduler, "scheduler", scheduler), checkpoint)
        set_state(state, bare, optimizer, names, new_strategy, scheduler.get_last_lr())
        del state
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(scratch, ignore_errors=True)
    restore_random_states(checkpoint, accelerator.process_index, int(meta.get("world_size", accelerator.num_processes)))
    return meta


def _one_rate_per_group(scheduler: Any, checkpoint: Path) -> None:
    """The restored schedule's rates, one for each of this run's optimizer groups. ZeRO
    leaves an empty group out of its optimizer, and its schedule then holds rates only for
    the groups it kept: adapters alone have no bias or norm weight for the no-decay group.
    Every group starts at one rate (runner/components/optim.py) and follows one schedule,
    so the rates are one value, spread over this run's groups."""
    groups = len(scheduler.optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):
        rates = list(getattr(scheduler, key))
        if len(rates) == groups:
            continue
        if len(set(rates)) != 1:
            raise UserError(f"checkpoint {checkpoint}: its schedule holds {len(rates)} different rates for this run's "
                            f"{groups} parameter groups. Resume it in its own layout.")
        setattr(scheduler, key, rates[:1] * groups)


def _zero_flat_partitions(optimizer: Any, inner: Any) -> list[torch.Tensor]:
    """The flat fp32 partitions AdamW steps under ZeRO: ZeRO-3 keeps them itself (its
    AdamW's param_groups hold none between steps), ZeRO-1/2 in AdamW's groups."""
    zero = optimizer
    while zero is not None and not hasattr(zero, "fp32_partitioned_groups_flat"):
        zero = getattr(zero, "optimizer", None)
    if zero is not None:
        return list(zero.fp32_partitioned_groups_flat)
    return [flat for group in inner.param_groups for flat in group["params"]]


def _materialise_zero_state(optimizer: Any, inner: Any, flats: list[torch.Tensor], step: float) -> None:
    """AdamW's state for each of ZeRO's flat partitions, before the first step creates it
    (torch creates it lazily), so the fragment API has moments to write into. ZeRO-1/2
    link each parameter's fragment to that state on their first step; that link is
    made here (DeepSpeed's `_lazy_init_hp_params_optimizer_state`, a private method:
    fenced by version in runner/distributed/patches.py)."""
    on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
    for flat in flats:
        if not inner.state.get(flat):
            inner.state[flat] = {
                "step": torch.tensor(step, dtype=torch.float32, device=flat.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format)}
    zero = optimizer
    while zero is not None and not hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero = getattr(zero, "optimizer", None)
    if zero is not None:  # ZeRO-1/2 (ZeRO-3 reads the optimizer's state directly); unsupported() refused other versions
        assert engaged(ZERO2_LINK_READ_ACROSS_STATE), "refused before launch on an unverified DeepSpeed"
        zero._lazy_init_hp_params_optimizer_state()


def _set_zero(state: PortableState, module: torch.nn.Module, optimizer: Any, inner: Any, names: list[str],
              groups: list[dict[str, Any]]) -> None:
    """Into ZeRO's partitions: the fp32 master weights and AdamW moments through DeepSpeed's
    tensor-fragment API (each rank takes its partition of the full tensor), the working
    weights (bf16/fp16, or fp32) from the master, and the step count into every flat
    group's state (the partitions of one group share it)."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    params = dict(module.named_parameters())
    stage3 = any(hasattr(p, "ds_id") for p in params.values())
    flats = _zero_flat_partitions(optimizer, inner)
    _materialise_zero_state(optimizer, inner, flats, state.step)

    def full(name: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        p = params[name]
        return values[name].reshape(p.ds_shape if stage3 else p.shape).to(p.device)

    for name in names:
        safe_set_full_fp32_param(params[name], full(name, state.weights))
        safe_set_full_optimizer_state(params[name], full(name, state.exp_avg), "exp_avg")
        safe_set_full_optimizer_state(params[name], full(name, state.exp_avg_sq), "exp_avg_sq")
    trained = [params[n] for n in names]
    # The working copy the forward reads: under ZeRO-3 partitioned, so gathered, set on
    # rank 0 and partitioned again on leaving (a collective); under ZeRO-2 whole on each rank.
    with deepspeed.zero.GatheredParameters(trained, modifier_rank=0, enabled=stage3), torch.no_grad():
        for name in names:
            params[name].data.copy_(state.weights[name].reshape(params[name].shape).to(params[name].dtype))
    for group, settings in zip(inner.param_groups, groups):
        group["lr"] = settings["lr"]
    for flat in flats:  # the partitions of one group share the step count
        held = inner.state[flat]
        held["step"] = torch.tensor(state.step, dtype=held["step"].dtype, device=held["step"].device) \
            if torch.is_tensor(held["step"]) else state.step
