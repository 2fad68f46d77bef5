"""`train.objective=rloo`: REINFORCE leave-one-out, as TRL 1.16's RLOOTrainer computes it,
on GRPO's sampling, rollouts, rewards and layout (grpo.py): only the advantages and the
loss differ.

- Each completion's reward less beta x its KL (k1, the sampling pass's log-probs less the
  reference's, summed over its tokens), less the mean of its group's other rewards: the
  leave-one-out baseline. TRL's normalize_advantages is off by default, and so here.
- One importance ratio a completion, of its summed log-probs against the sampling
  policy's (scored at generation, as TRL always scores them), clipped two-sided; the
  step's loss is the mean over its completions, on every rank and micro-batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from runner.components.objectives.grpo import GroupRelative
from runner.components.objectives.rl_loss import (PolicyTerms, reward_figures, rloo_advantages, rloo_sequence_kl,
                                                  rloo_share, rloo_terms)
from runner.components.rollouts import Rollouts
from runner.config.rl_spec import ScaleRewards


class LeaveOneOut(GroupRelative):
    def needs_old_logps(self) -> bool:
        return True  # the KL in the reward and the sequence ratio read them

    def advantages(self, buffer: Rollouts) -> None:
        rl, g = self.settings, self.settings.num_generations
        kl = None
        if rl.beta:
            assert buffer.old_logps is not None and buffer.ref_logps is not None
            mask = self._loss_mask(buffer, torch.arange(len(buffer.lengths)))
            kl = rloo_sequence_kl(buffer.old_logps, buffer.ref_logps, mask)
            buffer.figures["kl"] = float(kl.sum() / mask.sum().clamp(min=1.0))  # TRL's: over the batch's tokens
        buffer.advantages = rloo_advantages(buffer.rewards, g, kl, rl.beta)
        penalised = buffer.rewards - rl.beta * kl if kl is not None else buffer.rewards
        summary = reward_figures(buffer.rewards, g, ScaleRewards.group, zero_std_of=penalised)
        buffer.figures.update(reward=float(summary.reward), reward_std=float(summary.reward_std),
                              frac_reward_zero_std=float(summary.frac_reward_zero_std))

    def terms(self, logps: torch.Tensor, old: torch.Tensor, ref: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, counts: dict[str, float]) -> tuple[PolicyTerms, torch.Tensor]:
        rl = self.settings
        terms = rloo_terms(logps, old, advantages, mask, epsilon_low=rl.epsilon,
                           epsilon_high=rl.epsilon if rl.epsilon_high is None else rl.epsilon_high)
        return terms, rloo_share(terms, int(counts["completions"]))
