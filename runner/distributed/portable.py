"""A checkpoint's portable state: what every strategy's checkpoint holds, by parameter name.

Each strategy reads its own checkpoint into a `PortableState` and sets one into its own
prepared model and optimizer (runner/distributed/strategy.py `read_portable` /
`set_portable`); runner/train/reshard.py only pairs the strategy that wrote a checkpoint
with the one that runs. This module holds the state and the checks every reader makes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.config.errors import UserError


@dataclass
class PortableState:
    """A checkpoint's trainable parameters by name: fp32 master weights, AdamW moments, step."""

    weights: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: float


def only(names: list[str], found: dict[str, torch.Tensor], what: str, checkpoint: Path) -> dict[str, torch.Tensor]:
    """`found`'s tensors for this run's trainable `names`, in fp32; a checkpoint that lacks
    one was written for another model."""
    missing = [n for n in names if n not in found]
    if missing:
        raise UserError(f"checkpoint {checkpoint}: its {what} has no {missing[:3]} ({len(missing)} missing): it was "
                        "not written for this model. Resume it with its own spec, or start a new run.")
    return {n: found[n].float() for n in names}


def one_step(states: Iterable[dict[str, Any]], where: Path) -> float:
    """The optimizer's step count, which every parameter's state must agree on."""
    steps = {float(s["step"]) for s in states if "step" in s}
    if len(steps) != 1:
        raise UserError(f"checkpoint {where}: its optimizer's step counts disagree ({sorted(steps)}). "
                        "Resume it in its own layout.")
    return steps.pop()


def adam_state(state: PortableState, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch AdamW's state for one parameter, shaped as this run holds it."""
    shape = param.shape
    return {"step": torch.tensor(state.step, dtype=torch.float32),
            "exp_avg": state.exp_avg[name].reshape(shape), "exp_avg_sq": state.exp_avg_sq[name].reshape(shape)}
