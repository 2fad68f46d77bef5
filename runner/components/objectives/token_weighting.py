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
a copy of what it returned, so the objective reads the model's additions as
`outputs.loss - cross_entropy`: whatever the model adds, under whatever coefficient name
(`router_aux_loss_coef`, JetMoE's `aux_loss_coef`, a z-loss), and nothing for a model
that adds nothing (the difference is exactly zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from runner.components.chunked_loss import transformers_model
from runner.components.data.labels import IGNORE_INDEX, row_real_tokens


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
             added_weight: Union[float, torch.Tensor]) -> torch.Tensor:
    """`loss` (the model's: its cross-entropy plus what it added) with the cross-entropy
    weighted by `cross_entropy_weight` and the additions by `added_weight`. Without a
    tapped cross-entropy, the whole loss is the cross-entropy."""
    if cross_entropy is None:
        return loss * cross_entropy_weight
    return cross_entropy * cross_entropy_weight + (loss - cross_entropy) * added_weight


@dataclass(frozen=True)
class WindowCounts:
    """One optimizer step's counts over its micro-batches on all ranks, on the device."""

    trained_tokens: torch.Tensor  # float: the cross-entropy's divisor (`num_items_in_batch`)
    real_tokens: torch.Tensor  # int64: tokens that are not padding nor fillers (the rates')
    # Each of this rank's micro-batches' weight in the mean of what the model adds (a
    # router loss): 1 / the step's micro-batches that are not all fillers, on all ranks;
    # 0 for one of fillers only, whose router loss balances nothing real.
    added_shares: list[torch.Tensor]


def window_counts(window: Sequence[dict[str, torch.Tensor]], device: torch.device, all_ranks: bool) -> WindowCounts:
    """The counts of a step's window of micro-batches, summed over ranks (one all-reduce,
    when `all_ranks`); counted on the device, so the host never waits for them."""
    real = [row_real_tokens(batch).to(device).sum() for batch in window]
    counted = torch.stack([
        torch.stack([(batch["labels"][:, 1:] != IGNORE_INDEX).sum() for batch in window]).sum(),
        torch.stack(real).sum(),
        torch.stack([count > 0 for count in real]).sum(),
    ]).to(torch.int64)
    if all_ranks:
        torch.distributed.all_reduce(counted)
    micro_batches = counted[2].clamp(min=1).float()
    return WindowCounts(counted[0].float(), counted[1], [(count > 0).float() / micro_batches for count in real])
