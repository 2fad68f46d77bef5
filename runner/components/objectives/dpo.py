"""`train.objective=dpo`: preference optimisation on chosen/rejected pairs.

Each micro-batch holds P pairs as 2P sequences (runner/components/data/preference_batch.py);
one forward scores both halves: each answer's summed log-probs and its token count. The
reference's log-probs come from preference.reference (reference.py), and the loss type's
per-pair terms from preference_loss.py (each equal to TRL's). With the chunked head
installed (model.chunked_loss, the default), the head computes the pairs' loss chunk by
chunk of pairs and the whole logits are never held (runner/components/chunked_pairs.py);
else from the model's logits.

A step's loss is the mean over its pairs on every rank and micro-batch: `open_window`
counts the real pairs of the whole step before it runs (one all-reduce; an epoch's
fillers hold none), and each micro-batch adds its pairs' sum over that count, so a
micro-batch with fewer pairs weighs less, in every layout. ORPO's chosen-answer NLL is
token-weighted the same way, over the step's chosen answer tokens. What the loop logs
(loss, rewards/*, logps/*) is the step's pair mean, as TRL names them.

A mixture of experts with `output_router_logits` adds its router (load-balancing) loss
x its coefficient, as TRL's DPOTrainer does: once a micro-batch (one forward over its
2P sequences), a mean over the step's micro-batches that hold a real pair on all ranks,
as the causal-LM objective weights it (token_weighting.py); the loop logs that mean as
`aux_loss` (TRL's name), the loss holding it times the coefficient. Evaluation's figures
are the pairs' alone, as eval_loss is the cross-entropy's alone for the causal LM.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from runner.components.chunked_loss import transformers_model
from runner.components.chunked_pairs import forward_pairs
from runner.components.data.labels import IGNORE_INDEX, model_inputs, row_real_tokens
from runner.components.data.preference_batch import PAIR_INDEX, SEQUENCE_IDS, answer_tokens, pairs_in
from runner.components.objectives.base import Batch, MicroBatchLoss, Objective, ObjectiveSetup, Window
from runner.components.objectives.preference_loss import pair_terms
from runner.components.objectives.preference_loss import sequence_logps as logps_of_logits
from runner.components.objectives.reference import Reference
from runner.config.spec import PreferenceLoss

_PAIRS, _CHOSEN_TOKENS, _MICRO_BATCHES = "window_pairs", "window_chosen_tokens", "window_micro_batches"
_ROUTER_SHARE = "router_share"  # this micro-batch's weight in the step's mean router loss

# The per-pair figures logged and evaluated, by TRL's names
PAIR_FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


def _filled(logps: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """An epoch's filler pairs (no answer token: a log-prob sum of 0) given a log-prob of
    -1 a sequence: ORPO's log(1 - p) of p = exp(0) is -inf, and 0 x inf is NaN in the
    sum over pairs and in its gradient. A filler's terms are weighted by 0 anyway."""
    return torch.where(real > 0, logps, torch.full_like(logps, -1.0))


def router_coefficient(model: Any) -> Optional[float]:
    """The router loss's coefficient of a mixture of experts that returns one
    (`output_router_logits`): Mixtral's, Qwen-MoE's `router_aux_loss_coef`, JetMoE's
    `aux_loss_coef`; None for a model without one (TRL's DPOTrainer reads the same)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    coefficient = getattr(config, "router_aux_loss_coef", None)
    if coefficient is None:
        coefficient = getattr(config, "aux_loss_coef", None)
    return None if coefficient is None else float(coefficient)


class DirectPreference(Objective):
    figures = ("eval_loss", *PAIR_FIGURES)
    summarised = ("eval_loss", "rewards/accuracies", "rewards/margins")
    chunked_head_kernel = "runner's chunks of pairs (runner/components/chunked_pairs.py)"

    def __init__(self, setup: ObjectiveSetup) -> None:
        self.processes, self.grad_accum_steps = setup.processes, setup.grad_accum_steps
        self.cache = not setup.compiled
        self.chunked = setup.chunked
        self.settings = setup.preference
        self.reference: Reference = setup.reference if setup.reference is not None else Reference()
        self.orpo = self.settings.loss_type is PreferenceLoss.orpo
        self.router_coefficient = router_coefficient(transformers_model(setup.model))

    # ------------------------------------------------------------------ training
    def open_window(self, window: Sequence[Batch], device: torch.device, all_ranks: bool) -> Window:
        """Each micro-batch carries the step's real pairs and chosen answer tokens on all ranks."""
        chosen = [answer_tokens(batch)[:pairs_in(batch)] for batch in window]  # trained tokens, per answer
        real = [(trained > 0).sum() for trained in chosen]  # real pairs, per micro-batch
        counted = torch.stack([
            torch.stack(real).sum(),
            torch.stack([trained.sum() for trained in chosen]).sum(),
            torch.stack([row_real_tokens(batch).sum() for batch in window]).sum(),
            torch.stack([count > 0 for count in real]).sum(),  # micro-batches with a real pair
        ]).to(device=device, dtype=torch.int64)
        if all_ranks:
            torch.distributed.all_reduce(counted)
        holding = counted[3].clamp(min=1).float()
        batches = [{**batch, _PAIRS: counted[0].float(), _CHOSEN_TOKENS: counted[1].float(), _MICRO_BATCHES: len(window),
                    _ROUTER_SHARE: (count > 0).float().to(device) / holding}
                   for batch, count in zip(window, real)]
        return Window(batches, counted[2])

    def loss(self, model: Any, batch: Batch) -> MicroBatchLoss:
        pairs, chosen_tokens, micro = batch.pop(_PAIRS), batch.pop(_CHOSEN_TOKENS), batch.pop(_MICRO_BATCHES)
        router_share = batch.pop(_ROUTER_SHARE)
        scored = self._score(model, batch, "train", (pairs.clamp(min=1), chosen_tokens.clamp(min=1)))
        # Backward averages over ranks and divides by the accumulation: undone here. The
        # log averages over ranks and the window's micro-batches.
        undo, logged_by = self.processes * self.grad_accum_steps, self.processes * micro
        total = scored["loss"]
        metrics = {name: scored[name].detach() / pairs.clamp(min=1) * logged_by for name in PAIR_FIGURES}
        if self.router_coefficient is not None and scored.get("aux_loss") is not None:
            router = scored["aux_loss"].to(total.device) * router_share
            total = total + self.router_coefficient * router
            metrics["aux_loss"] = router.detach() * logged_by  # the step's mean router loss, as TRL logs it
        return MicroBatchLoss(total * undo, total * logged_by, metrics)

    def _score(self, model: Any, batch: Batch, split: str,
               step_counts: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Sums over the batch's real pairs: the figures; and with `step_counts` (the step's
        pairs and chosen answer tokens, all ranks) the loss to backward, these pairs' part."""
        reference = self.reference.logps(model, batch, split)
        p, layout = pairs_in(batch), batch
        batch = {k: v for k, v in batch.items() if k not in (PAIR_INDEX, SEQUENCE_IDS)}
        ref_chosen, ref_rejected = (None, None) if reference is None else (reference[:p], reference[p:])

        def loss_of(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                    rejected_tokens: torch.Tensor, among: slice) -> torch.Tensor:
            """The part of the step's loss of the pairs `among` (their log-probs given)."""
            assert step_counts is not None
            real = (chosen_tokens > 0).to(chosen.dtype)  # an epoch's fillers train nothing
            chosen, rejected = _filled(chosen, real), _filled(rejected, real)
            terms = pair_terms(self.settings, chosen, rejected, chosen_tokens, rejected_tokens,
                               None if ref_chosen is None else ref_chosen[among],
                               None if ref_rejected is None else ref_rejected[among])
            part = (terms.loss * real).sum() / step_counts[0]
            if self.orpo:  # the chosen answers' NLL, token-weighted over the step's chosen tokens
                part = part - (chosen * real).sum() / step_counts[1]
            return part

        inputs, wanted = model_inputs(batch, cache=self.cache), loss_of if step_counts is not None else None
        extras: dict[str, Any] = {}
        if self.chunked is not None:
            loss, logps, tokens = forward_pairs(self.chunked, model, inputs, batch["labels"], wanted, layout, extras)
        else:
            outputs = model(**inputs)
            extras["aux_loss"] = getattr(outputs, "aux_loss", None)
            logps, tokens = logps_of_logits(outputs.logits, batch["labels"], layout)
            loss = loss_of(logps[:p], logps[p:], tokens[:p], tokens[p:], slice(0, p)) if wanted else None
        real = (tokens[:p] > 0).float()
        logps = torch.cat([_filled(logps[:p].detach(), real), _filled(logps[p:].detach(), real)])
        terms = pair_terms(self.settings, logps[:p], logps[p:], tokens[:p], tokens[p:], ref_chosen, ref_rejected)
        figures = {
            "rewards/chosen": terms.chosen_rewards, "rewards/rejected": terms.rejected_rewards,
            "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).float(),
            "rewards/margins": terms.chosen_rewards - terms.rejected_rewards,
            "logps/chosen": logps[:p].detach(), "logps/rejected": logps[p:].detach(),
        }
        sums = {name: (value * real).sum() for name, value in figures.items()}
        return {**sums, **({"loss": loss} if loss is not None else {}), "aux_loss": extras.get("aux_loss"),
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
