"""Training objectives: what a micro-batch's loss is and what evaluation reports.

The trainer holds one `Objective` (base.py) and knows nothing of how the loss is made.
`train.objective` picks it here. A new objective is a module in this package (a
subclass of `Objective`), a member of `ObjectiveKind` (runner/config/spec.py) and a line
in OBJECTIVES; nothing under runner/train/ changes.
"""

from __future__ import annotations

from runner.components.objectives.base import Objective, ObjectiveSetup
from runner.components.objectives.causal_lm import CausalLM
from runner.components.objectives.dpo import DirectPreference
from runner.components.objectives.grpo import GroupRelative
from runner.components.objectives.rloo import LeaveOneOut
from runner.config.spec import ObjectiveKind

# One line an objective: its spec value and its class, built from the run's ObjectiveSetup.
OBJECTIVES: dict[ObjectiveKind, type[Objective]] = {
    ObjectiveKind.causal_lm: CausalLM,
    ObjectiveKind.dpo: DirectPreference,
    ObjectiveKind.grpo: GroupRelative,
    ObjectiveKind.rloo: LeaveOneOut,
}


def build_objective(kind: ObjectiveKind, setup: ObjectiveSetup) -> Objective:
    return OBJECTIVES[kind](setup)


def reported_figures(kind: ObjectiveKind) -> tuple[str, ...]:
    """The figures an objective's evaluation reports (a resume finds a logged one by them)."""
    return OBJECTIVES[kind].figures


def summarised_figures(kind: ObjectiveKind) -> tuple[str, ...]:
    """The figures a sweep's summary shows for a job of this objective."""
    return OBJECTIVES[kind].summarised


def objective_class(kind: ObjectiveKind) -> type[Objective]:
    return OBJECTIVES[kind]
