"""The preference losses as tensor math on per-pair sequence log-probs, each equal to
TRL 1.16's (tests/components/test_preference_loss.py runs TRL's own code as the oracle;
docs/preference.md says what each computes).

A pair's inputs are the sums of its chosen and rejected answers' token log-probs (the
completion's tokens, its EOS included, as TRL sums them) and the answers' token counts.
sigmoid, ipo and hinge compare the policy with a reference (DPOTrainer._compute_loss);
simpo and orpo use the length-normalised log-probs alone (CPOTrainer with
loss_type=simpo, ORPOTrainer). The mean over pairs, and ORPO's NLL on the chosen
answers, are the caller's: they are weighted across ranks and accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from runner.components.data.labels import token_losses
from runner.components.data.preference_batch import per_sequence
from runner.config.spec import PreferenceLoss, PreferenceSpec

NEEDS_REFERENCE = frozenset({PreferenceLoss.sigmoid, PreferenceLoss.ipo, PreferenceLoss.hinge})


@dataclass(frozen=True)
class PairTerms:
    """Each pair's loss and TRL's logged rewards for it, all [P]."""

    loss: torch.Tensor  # orpo: the odds-ratio term only, -lambda * logsigmoid(log_odds)
    chosen_rewards: torch.Tensor  # detached: TRL's rewards/chosen for this loss type
    rejected_rewards: torch.Tensor  # detached


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   batch: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's sum of its trained tokens' log-probs (fp32) and their count
    (int64): token t's label is labels[t + 1], a label of -100 trains nothing. A sequence
    is a row, or in a packed `batch` (preference_batch.pack_pairs) its sequence ids' span."""
    losses, mask = token_losses(logits, labels)
    layout = batch if batch is not None else {}
    return per_sequence(-losses, layout), per_sequence(mask.long(), layout)


def pair_terms(
    settings: PreferenceSpec,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    ref_chosen_logps: Optional[torch.Tensor] = None,
    ref_rejected_logps: Optional[torch.Tensor] = None,
) -> PairTerms:
    """The loss and rewards of P pairs, from [P] log-prob sums and token counts."""
    kind = PreferenceLoss(settings.loss_type)
    beta, smoothing = settings.beta, settings.label_smoothing
    # Counts are small integers, exact in fp32; at least one, as TRL's ipo clamps (an
    # answer always holds its EOS, so the clamp never acts on real data).
    chosen_count = chosen_tokens.to(chosen_logps.dtype).clamp(min=1.0)
    rejected_count = rejected_tokens.to(rejected_logps.dtype).clamp(min=1.0)

    if kind in NEEDS_REFERENCE:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"preference.loss_type={kind.value} needs the reference's log-probs")
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        if kind is PreferenceLoss.ipo:
            # TRL divides each answer's log-ratio by its token count (the IPO authors' form).
            delta = chosen_logratios / chosen_count - rejected_logratios / rejected_count
            loss = (delta - 1 / (2 * beta)) ** 2
        else:
            delta = chosen_logratios - rejected_logratios
            if kind is PreferenceLoss.hinge:
                loss = torch.relu(1 - beta * delta)
            else:
                loss = _smoothed_sigmoid(beta * delta, smoothing)
        return PairTerms(loss, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())

    # Reference-free: each answer's mean token log-prob (CPO's and ORPO's average_log_prob).
    chosen_mean = chosen_logps / chosen_count
    rejected_mean = rejected_logps / rejected_count
    if kind is PreferenceLoss.simpo:
        logits = (chosen_mean - rejected_mean) - settings.gamma / beta
        loss = _smoothed_sigmoid(beta * logits, smoothing)
    else:  # orpo: log odds(chosen) - log odds(rejected), odds(y) = p / (1 - p) with p the mean's exp
        log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
        loss = -(beta * F.logsigmoid(log_odds))
    return PairTerms(loss, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def _smoothed_sigmoid(scaled: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-logsigmoid, with a share `smoothing` of the pairs taken as flipped (conservative
    DPO; CPO's simpo). Without smoothing, TRL 1.16's sigmoid exactly."""
    if smoothing == 0.0:
        return -F.logsigmoid(scaled)
    return -F.logsigmoid(scaled) * (1 - smoothing) - F.logsigmoid(-scaled) * smoothing


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branching at -ln 2 against cancellation (as TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
