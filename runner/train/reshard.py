"""Resume a checkpoint on another number of processes or under another strategy.

A checkpoint holds what its strategy holds, and Accelerate's `load_state` reads it back
only in the strategy that wrote it, at any world size or only at its own
(`Strategy.loads_at_any_world_size`). Across, the checkpoint is read as one portable
state, by parameter name: the fp32 master weights (never re-derived from 16-bit
weights), AdamW's exp_avg and exp_avg_sq, and its step count
(runner/distributed/portable.py). Each strategy owns its format: the strategy that
wrote the checkpoint (its run_spec.yaml records which) reads it with its library's own
tool (`prepare_portable` once on the main process, into a scratch folder, then
`read_portable` on every rank), and the strategy that runs now sets it into its prepared
model and optimizer (`set_portable`), each rank keeping its own shard or partition of the
full tensors. This module only pairs the two: which resumes are read across and which are
refused (`needs_reshard`, `unsupported`), the scratch folder, the schedule, and each
rank's random state, which come from the same files as in a plain resume. It names no
strategy (tests/train/test_reshard.py).

With adapters (peft) the trainable parameters are the adapters and modules_to_save: they
are the portable state, and the frozen base is this run's own pretrained model, which
training never changed.

Reading a checkpoint this way holds the whole fp32 state (weights and two moments) in
each process's host memory, once, at the resume.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from runner.components.optim import param_groups
from runner.config.errors import UserError
from runner.distributed.portable import PortableState
from runner.distributed.strategies import STRATEGIES, strategy_of_kind
from runner.distributed.strategy import innermost_optimizer
from runner.train.checkpoint import CHECKPOINTS_DIRNAME, read_marker
from runner.train.rng import restore_random_states

log = logging.getLogger(__name__)

SCRATCH_DIRNAME = ".reshard"  # in the resuming run's checkpoints folder; removed after the resume


def needs_reshard(old_strategy: str, new_strategy: str, old_world: int, new_world: int) -> bool:
    """Whether Accelerate's own load_state cannot read the checkpoint in this run: another
    strategy, or another world size where the writer's checkpoint loads only at its own
    (a strategy that reshards as it loads reads only the pieces of its new shards: no gather)."""
    if old_strategy != new_strategy:
        return True
    if old_world == new_world:
        return False
    try:
        return not strategy_of_kind(old_strategy).loads_at_any_world_size()
    except ValueError:  # a kind with no strategy object: not known to load at another world size
        return True


def unsupported(old_strategy: str, new_strategy: str, old_world: int, precision: str,
                offload: bool = False) -> Optional[str]:
    """Why this checkpoint cannot be resharded into this run (None: it can)."""
    own = f"in the checkpoint's own layout ({old_world} processes under strategy={old_strategy})"
    if offload:  # an optimizer stepped on the CPU keeps its own state format; not verified across yet
        return f"a checkpoint read across with strategy.offload_optimizer or offload_params set is not verified yet; resume {own}"
    try:
        refusal = strategy_of_kind(new_strategy).read_across_refusal()
    except ValueError:  # a kind with no strategy object
        return (f"resuming under strategy={new_strategy} from another number of processes or another strategy is not "
                f"supported: resume under strategy={', '.join(kind.value for kind in STRATEGIES)}, or {own}")
    if refusal:
        return f"{refusal}, or {own}"
    if precision == "fp16":
        return (f"precision=fp16: the dynamic loss scale is kept by each strategy's own scaler and does not move "
                f"across; resume {own}")
    return None


# ---------------------------------------------------------------------- reading
def prepare(checkpoint: Path, strategy: str, scratch: Path) -> None:
    """What the main process does once, into an empty `scratch`, before every rank reads
    the state of a checkpoint written under `strategy` (that strategy's own conversion)."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    strategy_of_kind(strategy).prepare_portable(checkpoint, scratch)


def read_state(checkpoint: Path, strategy: str, names: list[str], scratch: Path) -> PortableState:
    """The portable state of a checkpoint written under `strategy` (after `prepare`).
    `names` are this run's trainable parameters in its optimizer's order."""
    return strategy_of_kind(strategy).read_portable(checkpoint, names, scratch)


# ---------------------------------------------------------------------- setting
def trainable_names(model: torch.nn.Module, weight_decay: float) -> list[str]:
    """This run's trainable parameters by name, in the order its optimizer holds them."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for group in param_groups(model, weight_decay) for p in group["params"]]


def set_state(state: PortableState, model: torch.nn.Module, optimizer: Any, names: list[str], strategy: str,
              last_lrs: list[float]) -> None:
    """The portable state into this run's (prepared) model and optimizer, by the strategy
    that runs; the learning rates of the restored schedule into the optimizer's groups, as
    a plain resume restores them."""
    inner = innermost_optimizer(optimizer)
    groups = []
    for group, lr in zip(inner.param_groups, last_lrs):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "lr": lr})
    strategy_of_kind(strategy).set_portable(state, model, optimizer, names, groups)


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
    """The restored schedule's rates, one for each of this run's optimizer groups. A
    strategy may leave an empty group out of its optimizer, and its schedule then holds
    rates only for the groups it kept: adapters alone have no bias or norm weight for the
    no-decay group. Every group starts at one rate (runner/components/optim.py) and
    follows one schedule, so the rates are one value, spread over this run's groups."""
    groups = len(scheduler.optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):
        rates = list(getattr(scheduler, key))
        if len(rates) == groups:
            continue
        if len(set(rates)) != 1:
            raise UserError(f"checkpoint {checkpoint}: its schedule holds {len(rates)} different rates for this run's "
                            f"{groups} parameter groups. Resume it in its own layout.")
        setattr(scheduler, key, rates[:1] * groups)
