"""What the training loop asks of an objective: the one seam between the loop and the loss.

The trainer (runner/train/trainer.py) runs forwards, backwards and steps; an objective
says what a micro-batch's loss is and what evaluation reports. It is built once per run
from `train.objective` (runner/components/objectives/__init__.py) and asked:

- `open_window`: before a step's micro-batches run (all of a token-weighted step's,
  read ahead by the loop), what they need from the whole step on all ranks (one
  collective a step), handed back as the micro-batches to run, each carrying its
  share; and the step's real tokens, for the loop's rates and checkpoints;
- `loss`: one micro-batch's forward, what to backward and what to log. A micro-batch
  that did not come through `open_window` (a stream's) is a mean of its own;
- `eval_rows` / `eval_figures`: per-row figures of an evaluation batch, which the loop
  gathers over ranks and concatenates; then the reported figures from all rows;
- `state_dict` / `load_state_dict`: what it holds between steps, saved with checkpoints;
- `take_timings`: the seconds it spent in parts of its own (generation), for the ledger;
- `figures`, `describe`: the names of what evaluation reports (metrics.jsonl's eval
  lines), and the log line; `summarised`: those of them a sweep's summary shows.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from runner.components.data.labels import SOURCE

Batch = dict[str, Any]


@dataclass(frozen=True)
class MicroBatchLoss:
    """A micro-batch's loss: what backward receives (scaled so that, after the strategy
    averages over ranks and accumulation, the step's gradient is the objective's), and
    what the loop logs (its train loss is the mean of these over the window's
    micro-batches and ranks)."""

    backward: torch.Tensor
    logged: torch.Tensor
    # Further per-step figures, each weighted like `logged` (the loop averages them over
    # the window's micro-batches and ranks): a preference objective's rewards/*. A name
    # ending in `/max` is not weighted: the loop keeps the largest, over micro-batches,
    # steps and ranks (runner/train/loop_state.py).
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """A step's micro-batches as the objective hands them back from `open_window`."""

    batches: list[Batch]
    real_tokens: torch.Tensor  # int64, on the device: the window's tokens that are not padding, all ranks


class Objective(abc.ABC):
    """A training objective (see the module's docstring), built once per run from an
    ObjectiveSetup after the model is prepared: `Kind(setup)`."""

    #: The figures evaluation reports, in metrics.jsonl's eval lines (the first is the headline).
    figures: tuple[str, ...] = ()
    #: The figures a sweep's summary shows for each job (runner/sweep/summary.py), of `figures`.
    summarised: tuple[str, ...] = ()
    #: Whether the chunked head and loss (model.chunked_loss) compute this objective's loss.
    chunked_head: bool = True
    #: What computes it there, for the banner, when not the token loss's kernel (None).
    chunked_head_kernel: Optional[str] = None

    @abc.abstractmethod
    def open_window(self, window: Sequence[Batch], device: torch.device, all_ranks: bool) -> Window:
        """The step's micro-batches (this rank's), each carrying what its loss needs from
        the whole step; `all_ranks`: counts are summed over the ranks."""

    @abc.abstractmethod
    def loss(self, model: Any, batch: Batch) -> MicroBatchLoss:
        """One micro-batch's forward on `model` (the prepared one) and its loss."""

    @abc.abstractmethod
    def eval_rows(self, model: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """One evaluation batch's figures, one value a row, under no_grad: the loop
        gathers each over ranks (padding duplicates dropped) and concatenates them."""

    @abc.abstractmethod
    def eval_figures(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        """The reported figures (`figures`) from every row's `eval_rows`, concatenated."""

    def rows_with_sources(self, model: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """`eval_rows`, and for a mixture's batch each row's source (runner/components/data/mixture.py)."""
        rows = self.eval_rows(model, batch)
        if SOURCE in batch:
            rows[SOURCE] = batch[SOURCE]
        return rows

    def figures_by_source(self, rows: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, float]:
        """`eval_figures` of every row, and each source's eval_loss over its own rows alone
        (`eval_loss/<name>`, weighted as the total is), where the rows carry their source."""
        sources = rows.pop(SOURCE, None)
        figures = self.eval_figures(rows)
        for index, name in enumerate(names if sources is not None else ()):
            mine = sources == index
            if bool(mine.any()):
                figures[f"eval_loss/{name}"] = self.eval_figures({k: v[mine] for k, v in rows.items()})["eval_loss"]
        return figures

    def describe(self, figures: dict[str, float]) -> str:
        """The log line's account of an evaluation."""
        return ", ".join(f"{name} {figures[name]:.4f}" for name in self.figures)

    def state_dict(self) -> dict[str, Any]:
        """What the objective holds between steps that a checkpoint must keep (online RL's
        generation batch, trained over several steps); the same on every rank. {}: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict`'s state from a checkpoint."""

    def take_timings(self) -> dict[str, float]:
        """Seconds the objective spent in parts of its own since the last call (online RL's
        `generation`), for the goodput ledger (runner/train/ledger.py) to book apart from the steps."""
        return {}


@dataclass(frozen=True)
class ObjectiveSetup:
    """What a run hands an objective's builder (runner/components/objectives/__init__.py)."""

    model: Any  # the bare model, unwrapped from its strategy (a hook on it reaches every strategy's forward)
    processes: int  # ranks: backward averages a micro-batch's loss over them...
    grad_accum_steps: int  # ...and divides it by the accumulation
    chunked: Any = None  # the chunked head and loss installed on the model (model.chunked_loss), or None
    compiled: bool = False  # model.compile: the layers are compiled
    preference: Any = None  # train.objective=dpo: the run's PreferenceSpec
    reference: Any = None  # train.objective=dpo: where the reference's log-probs come from (reference.py); grpo: a frozen model or "adapter_off"
    rollouts: Any = None  # train.objective=grpo: what samples and scores the generation batches (runner/components/rollouts.py)
