"""`train.objective=dpo`: preference optimisation on chosen/rejected pairs.

Each micro-batch holds P pairs as 2P sequences (runner/components/preference_batch.py);
one forward scores both halves: each answer's summed log-probs and its token count. The
reference's log-probs come from preference.reference (reference.py), and the loss type's
per-pair terms from preference_loss.py (each equal to TRL's).

A step's loss is the mean over its pairs on every rank and micro-batch: `open_window`
counts the real pairs of the whole step before it runs (one all-reduce; an epoch's
fillers hold none), and each micro-batch adds its pairs' sum over that count, so a
micro-batch with fewer pairs weighs less, in every layout. ORPO's chosen-answer NLL is
token-weighted the same way, over the step's chosen answer tokens. What the loop logs
(loss, rewards/*, logps/*) is the step's pair mean, as TRL names them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from runner.components.labels import IGNORE_INDEX, row_real_tokens
from runner.components.objectives.base import Batch, MicroBatchLoss, Objective, ObjectiveSetup, Window
from runner.components.objectives.preference_loss import pair_terms
from runner.components.objectives.reference import Reference, sequence_logps
from runner.components.preference_batch import PAIR_INDEX, pairs_in
from runner.config.spec import PreferenceLoss

_PAIRS, _CHOSEN_TOKENS, _MICRO_BATCHES = "window_pairs", "window_chosen_tokens", "window_micro_batches"

# The per-pair figures logged and evaluated, by TRL's names
PAIR_FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


class DirectPreference(Objective):
    figures = ("eval_loss", *PAIR_FIGURES)
    summarised = ("eval_loss", "rewards/accuracies", "rewards/margins")
    chunked_head = False  # per-sequence log-probs come from the whole logits (the chunked head sums all tokens)

    def __init__(self, setup: ObjectiveSetup) -> None:
        self.processes, self.grad_accum_steps = setup.processes, setup.grad_accum_steps
        self.cache = not setup.compiled
        self.settings = setup.preference
        self.reference: Reference = setup.reference if setup.reference is not None else Reference()
        self.orpo = self.settings.loss_type is PreferenceLoss.orpo

    # ------------------------------------------------------------------ training
    def open_window(self, window: Sequence[Batch], device: torch.device, all_ranks: bool) -> Window:
        """Each micro-batch carries the step's real pairs and chosen answer tokens on all ranks."""
        chosen = [self._chosen(batch["labels"][:, 1:] != IGNORE_INDEX) for batch in window]  # trained, per token
        counted = torch.stack([
            torch.stack([trained.any(dim=1).sum() for trained in chosen]).sum(),
            torch.stack([trained.sum() for trained in chosen]).sum(),
            torch.stack([row_real_tokens(batch).sum() for batch in window]).sum(),
        ]).to(device=device, dtype=torch.int64)
        if all_ranks:
            torch.distributed.all_reduce(counted)
        batches = [{**batch, _PAIRS: counted[0].float(), _CHOSEN_TOKENS: counted[1].float(), _MICRO_BATCHES: len(window)}
                   for batch in window]
        return Window(batches, counted[2])

    @staticmethod
    def _chosen(rows: torch.Tensor) -> torch.Tensor:
        return rows[: rows.shape[0] // 2]

    def loss(self, model: Any, batch: Batch) -> MicroBatchLoss:
        pairs, chosen_tokens, micro = batch.pop(_PAIRS), batch.pop(_CHOSEN_TOKENS), batch.pop(_MICRO_BATCHES)
        scored = self._score(model, batch, "train")
        # Backward averages over ranks and divides by the accumulation: undone here. The
        # log averages over ranks and the window's micro-batches.
        undo, logged_by = self.processes * self.grad_accum_steps, self.processes * micro
        total = scored["loss_sum"] / pairs.clamp(min=1)
        if self.orpo:
            total = total + scored["nll_sum"] / chosen_tokens.clamp(min=1)
        metrics = {name: scored[name].detach() / pairs.clamp(min=1) * logged_by for name in PAIR_FIGURES}
        return MicroBatchLoss(total * undo, total * logged_by, metrics)

    def _score(self, model: Any, batch: Batch, split: str) -> dict[str, torch.Tensor]:
        """Sums over the batch's real pairs: their losses, the figures, and the chosen NLL."""
        reference = self.reference.logps(model, batch, split)
        batch = {k: v for k, v in batch.items() if k != PAIR_INDEX}
        logps, tokens = sequence_logps(model, batch, self.cache)
        p = pairs_in(batch)
        real = (tokens[:p] > 0).float()  # an epoch's fillers train nothing
        terms = pair_terms(self.settings, logps[:p], logps[p:], tokens[:p], tokens[p:],
                           None if reference is None else reference[:p], None if reference is None else reference[p:])
        figures = {
            "rewards/chosen": terms.chosen_rewards, "rewards/rejected": terms.rejected_rewards,
            "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).float(),
            "rewards/margins": terms.chosen_rewards - terms.rejected_rewards,
            "logps/chosen": logps[:p].detach(), "logps/rejected": logps[p:].detach(),
        }
        sums = {name: (value * real).sum() for name, value in figures.items()}
        return {**sums, "loss_sum": (terms.loss * real).sum(), "nll_sum": -(logps[:p] * real).sum(),
                "per_pair_loss": terms.loss.detach(), "chosen_tokens": tokens[:p] * real,
                "chosen_logps": logps[:p].detach(), **{f"pair:{k}": v for k, v in figures.items()}}

    # ------------------------------------------------------------------ evaluation
    def eval_rows(self, model: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """Each pair's loss terms and figures (the loop gathers them over ranks)."""
        scored = self._score(model, dict(batch), "validation")
        rows = {"loss": scored["per_pair_loss"], "chosen_nll": -scored["chosen_logps"],
                "chosen_tokens": scored["chosen_tokens"]}
        rows.update({name: scored[f"pair:{name}"] for name in PAIR_FIGURES})
        return rows

    def eval_figures(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        loss = rows["loss"].mean()
        if self.orpo:
            loss = loss + rows["chosen_nll"].sum() / rows["chosen_tokens"].sum().clamp(min=1)
        return {"eval_loss": loss.item(), **{name: rows[name].mean().item() for name in PAIR_FIGURES}}

    def describe(self, figures: dict[str, float]) -> str:
        return (f"eval_loss {figures['eval_loss']:.4f}, rewards/accuracies {figures['rewards/accuracies']:.3f}, "
                f"rewards/margins {figures['rewards/margins']:.4f}")
