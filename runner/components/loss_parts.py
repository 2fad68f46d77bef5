"""A model's training loss in its two parts: the cross-entropy, and what the model adds to it.

Mixtures of experts (Mixtral, Qwen-MoE, OLMoE, ... with `output_router_logits=True`)
add a router load-balancing term after the cross-entropy: transformers computes
`loss = self.loss_function(...)`, then `loss += router_aux_loss_coef * aux_loss`. Token
weighting (instruction data) scales a micro-batch's summed cross-entropy by processes x
accumulation, undoing what backward averages over ranks and micro-batches. The added
term is already a mean over the micro-batch's tokens: scaled with the rest, it would
weigh processes x accumulation times what one process gives it.

`CrossEntropyTap` wraps the model's `loss_function` (transformers' per-instance setter;
the chunked loss's when that is installed, runner/components/chunked_loss.py) and keeps
a copy of what it returned, so the trainer reads the model's additions as
`outputs.loss - cross_entropy`: whatever the model adds, under whatever coefficient name
(`router_aux_loss_coef`, JetMoE's `aux_loss_coef`, a z-loss), and nothing for a model
that adds nothing (the difference is exactly zero).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from runner.components.chunked_loss import transformers_model


class CrossEntropyTap:
    """Installed on one model (bare or under peft); `take()` after each forward."""

    def __init__(self, model: Any) -> None:
        base = transformers_model(model)
        inner = getattr(base, "loss_function", None)
        self._value: Optional[torch.Tensor] = None
        if inner is None:  # not a transformers model: its loss is all cross-entropy
            return

        def loss_function(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = inner(*args, **kwargs)
            # A copy in the graph: the model adds its terms to the returned tensor in place.
            self._value = loss.clone()
            return loss

        base.loss_function = loss_function

    def take(self) -> Optional[torch.Tensor]:
        """The cross-entropy of the last forward with labels (None: none ran since the last take)."""
        value, self._value = self._value, None
        return value


def weighted(loss: torch.Tensor, cross_entropy: Optional[torch.Tensor], cross_entropy_weight: float,
             added_weight: float) -> torch.Tensor:
    """`loss` (the model's: its cross-entropy plus what it added) with the cross-entropy
    weighted by `cross_entropy_weight` and the additions by `added_weight`. Without a
    tapped cross-entropy, the whole loss is the cross-entropy."""
    if cross_entropy is None:
        return loss * cross_entropy_weight
    return cross_entropy * cross_entropy_weight + (loss - cross_entropy) * added_weight
