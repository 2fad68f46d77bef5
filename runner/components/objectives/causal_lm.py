"""`train.objective=causal_lm`: next-token cross-entropy over the trained tokens (run_clm's
loss, and instruction data's loss on the answers).

The model computes the loss itself (transformers' ForCausalLMLoss, or the chunked head
and loss when installed: runner/components/chunked_loss.py, with Liger's kernel on a
GPU). A step's loss is the sum over its trained tokens, on every rank and micro-batch,
over their number: answer tokens of instruction data, and run_clm's blocks too, whose
epoch ends in a short step (a short window, and fillers that train nothing:
runner/components/data/epoch_batches.py). `open_window` counts them before the step runs
(runner/components/objectives/token_weighting.py). A stream's steps are all whole, so its
micro-batches come without a window and keep the mean per micro-batch.

Evaluation is token-weighted too: the sum of every trained token's loss over their
number, so neither padding nor packing changes the figure; for run_clm's equal blocks it
is the mean of the blocks' means.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional, Sequence

import torch

from runner.components.chunked_loss import ChunkedLoss
from runner.components.data.labels import model_inputs, token_losses
from runner.components.objectives.base import Batch, MicroBatchLoss, Objective, ObjectiveSetup, Window
from runner.components.objectives.token_weighting import CrossEntropyTap, weighted, window_counts

# What open_window adds to a micro-batch for its loss (taken off again before the forward).
_ITEMS, _MICRO_BATCHES, _ADDED_SHARE = "num_items_in_batch", "window_micro_batches", "added_share"


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


def evaluation_scores(model: Any, inputs: dict[str, Any], labels: torch.Tensor,
                      chunked: Optional[ChunkedLoss]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token losses, trained mask, correct predictions) of one evaluation forward,
    aligned with labels[:, 1:]. Through the chunked head when installed: the whole logits
    in fp32 would be the largest thing evaluation holds (GPT-2's vocabulary: 200 KB a
    token), larger than the training step's planned peak. Without it they are held, with
    the loss's temporaries: the memory plan traces this function (runner/components/
    step_trace.py trace_evaluation)."""
    if chunked is not None:
        scores = chunked.scores(model, inputs, labels)
        return scores.losses, scores.trained, scores.correct
    logits = model(**inputs).logits
    token_loss, trained = token_losses(logits, labels)
    predicted = logits[:, :-1].argmax(-1) == labels[:, 1:]
    return token_loss, trained, predicted & trained


class CausalLM(Objective):
    figures = ("eval_loss", "perplexity", "eval_accuracy")
    summarised = ("eval_loss", "perplexity")

    def __init__(self, setup: ObjectiveSetup) -> None:
        # processes x accumulation: what backward divides a micro-batch's loss by.
        self.processes, self.grad_accum_steps = setup.processes, setup.grad_accum_steps
        self.chunked: Optional[ChunkedLoss] = setup.chunked
        self.compiled = setup.compiled  # no forward builds a KV cache (model_inputs)
        # Only the cross-entropy is token-weighted: what the model adds after it (a mixture
        # of experts' router loss) stays a mean per micro-batch (token_weighting.py).
        self.cross_entropy = CrossEntropyTap(setup.model)

    # ------------------------------------------------------------------ training
    def open_window(self, window: Sequence[Batch], device: torch.device, all_ranks: bool) -> Window:
        """Each micro-batch carries the step's trained tokens on all ranks (transformers'
        `num_items_in_batch`, one all-reduce a step) and its share of the model's additions."""
        counts = window_counts(window, device, all_ranks)
        batches = [{**batch, _ITEMS: counts.trained_tokens, _MICRO_BATCHES: len(window),
                    _ADDED_SHARE: counts.added_shares[index]} for index, batch in enumerate(window)]
        return Window(batches, counts.real_tokens)

    def loss(self, model: Any, batch: Batch) -> MicroBatchLoss:
        items, micro = batch.pop(_ITEMS, None), batch.pop(_MICRO_BATCHES, None)
        added_share = batch.pop(_ADDED_SHARE, None)
        inputs = model_inputs(batch, labels=True, cache=not self.compiled)
        if items is None:  # a stream's micro-batch: its own mean
            with self._chunked(batch):
                loss = model(**inputs).loss
            return MicroBatchLoss(loss, loss)
        # transformers' loss: this micro-batch's token losses summed, over the step's
        # trained tokens on all ranks. Backward averages over ranks (DDP, ZeRO, FSDP) and
        # divides by the accumulation (Accelerate, DeepSpeed): undone here, so the step's
        # gradient is that of the sum over all its tokens / their number. The log averages
        # over ranks and the window's micro-batches. What the model adds (a router loss) is
        # a mean per micro-batch: averaged over the step's micro-batches that are not all
        # fillers, on all ranks (`added_share`).
        with self._chunked(batch):
            share = model(**inputs, num_items_in_batch=items).loss
        cross_entropy = self.cross_entropy.take()
        undo = self.processes * self.grad_accum_steps  # what backward divides by: ranks x accumulation
        logged_by = self.processes * micro
        return MicroBatchLoss(weighted(share, cross_entropy, undo, undo * added_share),
                              weighted(share, cross_entropy, logged_by, logged_by * added_share))

    def _chunked(self, batch: Batch) -> Any:
        """The next forward's head and loss chunked, when installed."""
        return contextlib.nullcontext() if self.chunked is None else self.chunked.labels(batch["labels"])

    # ------------------------------------------------------------------ evaluation
    def eval_rows(self, model: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """Each row's summed token loss, trained tokens and correct next-token predictions."""
        token_loss, trained, correct = self.token_scores(model, batch)
        return {"loss": token_loss.sum(dim=1), "tokens": trained.sum(dim=1), "correct": correct.sum(dim=1)}

    def token_scores(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-token losses, trained mask, correct predictions) of one evaluation batch,
        aligned with labels[:, 1:] (evaluation_scores)."""
        return evaluation_scores(model, model_inputs(batch, cache=not self.compiled), batch["labels"], self.chunked)

    def eval_figures(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        tokens = rows["tokens"].sum().clamp(min=1)
        eval_loss = (rows["loss"].sum() / tokens).item()
        return {"eval_loss": eval_loss, "perplexity": perplexity(eval_loss),
                "eval_accuracy": (rows["correct"].sum() / tokens).item()}

    def describe(self, figures: dict[str, float]) -> str:
        return f"eval_loss {figures['eval_loss']:.4f}, perplexity {figures['perplexity']:.2f}"
