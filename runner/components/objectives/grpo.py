"""`train.objective=grpo`: online RL with group-relative advantages (GRPO, Dr. GRPO,
DAPO, CISPO, GSPO), as TRL 1.16's GRPOTrainer computes them, in any layout.

The loader hands out *slots*: a step's B places (runner/components/rollouts.py says how a
step maps to a generation batch and its share). `open_window` makes sure this step's
generation batch exists (sampled by all ranks, gathered, scored: the same on every rank),
and turns this rank's slots into its completions' rows. `loss` scores them exactly
(completion_scores.py) and adds this micro-batch's share of the step's loss
(rl_loss.py: the normalisation is over the whole step, so every layout trains the
same loss). Because every rank holds the whole generation batch, the step's counts
(completions, tokens) are known without a collective.

What is logged is TRL's: `reward`, `reward_std`, `rewards/<name>/mean|std`,
`frac_reward_zero_std`, `completions/*` from the generation batch; `kl`, `entropy`,
`clip_ratio/*` and `sampling/logp_difference/mean` as the step's token means (and its `/max`, the largest). A
generation batch that trains on later steps (rl.steps_per_generation or
rl.num_iterations above 1) is checkpointed with them (`state_dict`), so a resume trains
the samples the uninterrupted run trained.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from runner.components.chunked_loss import transformers_model
from runner.components.objectives.base import Batch, MicroBatchLoss, Objective, ObjectiveSetup, Window
from runner.components.objectives.completion_scores import CompletionRows, completion_logps, completion_rows
from runner.components.objectives.dpo import router_coefficient
from runner.components.objectives.rl_loss import (PolicyTerms, figure_sums, group_advantages, loss_share, policy_terms,
                                                  reward_figures, step_normaliser)
from runner.components.rollouts import Rollouts, RolloutSource

SLOT = "slot"  # the loader's rows: a place in the run's stream of completions
_ROWS, _INDEX, _STEP = "rows", "completions", "step_counts"


class GroupRelative(Objective):
    figures = ("reward", "reward_std", "completions/mean_length")
    summarised = ("reward",)
    chunked_head = False

    def __init__(self, setup: ObjectiveSetup) -> None:
        self.processes, self.grad_accum_steps = setup.processes, setup.grad_accum_steps
        self.model = setup.model  # the bare model: generation runs it directly (no wrapper's collectives)
        self.source: RolloutSource = setup.rollouts
        self.settings = self.source.settings
        self.layout = self.source.layout
        self.reference = setup.reference  # beta > 0: scores the reference's log-probs at generation
        self.buffer: Optional[Rollouts] = None
        self.generation_seconds = 0.0  # not yet booked by the ledger (take_timings)
        self.router_coefficient = router_coefficient(transformers_model(setup.model))
        self.on_generation: Any = None  # called with each new generation batch (completions.jsonl)
        self.pad_id = self.source.pad_id

    # ------------------------------------------------------------------ generation
    def rollouts(self, generation: int) -> Rollouts:
        """The generation batch, sampled once (all ranks) and kept while its steps train."""
        if self.buffer is None or self.buffer.generation != generation:
            started = time.perf_counter()
            was_training = self.model.training
            self.model.eval()
            try:
                self.buffer = buffer = self.source.generate(self.model, generation)
                if self.needs_old_logps():
                    buffer.old_logps = self._score_all(self.model)
                if self.settings.beta:
                    buffer.ref_logps = self._score_all(self.reference)
                self.advantages(buffer)
            finally:
                self.model.train(was_training)
                self.generation_seconds += time.perf_counter() - started
            if self.on_generation is not None:
                self.on_generation(self.buffer)
        return self.buffer

    def needs_old_logps(self) -> bool:
        """The policy's log-probs at generation are scored apart only when later steps train
        on the batch (TRL: else the training pass's own, detached, are the old ones)."""
        return self.layout.steps_per_generation > 1 or self.layout.iterations > 1

    def advantages(self, buffer: Rollouts) -> None:
        """The generation batch's advantages and reward figures (GRPO's: group-relative)."""
        rl = self.settings
        buffer.advantages = group_advantages(buffer.rewards, rl.num_generations, rl.scale_rewards)
        summary = reward_figures(buffer.rewards, rl.num_generations, rl.scale_rewards)
        buffer.figures.update(reward=float(summary.reward), reward_std=float(summary.reward_std),
                              frac_reward_zero_std=float(summary.frac_reward_zero_std))

    def terms(self, logps: torch.Tensor, old: torch.Tensor, ref: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, counts: dict[str, float]) -> tuple[PolicyTerms, torch.Tensor]:
        """A micro-batch's loss terms and its share of the step's loss (GRPO's family)."""
        rl = self.settings
        terms = policy_terms(logps, old, ref, advantages, mask, loss_type=rl.loss_type, epsilon_low=rl.epsilon,
                             epsilon_high=rl.epsilon if rl.epsilon_high is None else rl.epsilon_high, beta=rl.beta,
                             importance_sampling_level=rl.importance_sampling_level,
                             bias_correction_kl=rl.use_bias_correction_kl)
        share = loss_share(terms, mask, rl.loss_type, torch.as_tensor(counts["normaliser"], device=logps.device))
        return terms, share

    @torch.no_grad()
    def _score_all(self, scorer: Any) -> torch.Tensor:
        """Per-token log-probs [n, L] of the whole generation batch under `scorer` (a model;
        "adapter_off": the policy with its adapters switched off), one group a forward,
        each rank its groups, then gathered."""
        buffer = self.buffer
        assert buffer is not None
        return self.source.per_group(lambda q: self._group_logps(scorer, buffer, q), len(buffer.prompt_ids))[0]

    def _group_logps(self, scorer: Any, buffer: Rollouts, q: int) -> torch.Tensor:
        g = self.settings.num_generations
        rows = self._rows(buffer, torch.arange(q * g, (q + 1) * g))
        device = next(self.model.parameters()).device
        if scorer == "adapter_off":
            with self.model.disable_adapter():
                scores = completion_logps(self.model, rows.to(device), self.settings.temperature, entropy=False)[0]
        else:
            scores = completion_logps(scorer, rows.to(device), self.settings.temperature, entropy=False)[0]
        return scores.float().cpu()

    def _loss_mask(self, buffer: Rollouts, index: torch.Tensor) -> torch.Tensor:
        """[len(index), L] float: the completions' tokens the loss counts (the end-of-sequence
        included; none of a truncated one's with rl.mask_truncated_completions)."""
        length = buffer.completion_ids.shape[1]
        mask = (torch.arange(length)[None, :] < buffer.lengths[index][:, None]).float()
        if self.settings.mask_truncated_completions:
            mask = mask * buffer.ended[index, None].float()
        return mask

    def _rows(self, buffer: Rollouts, index: torch.Tensor) -> CompletionRows:
        g = self.settings.num_generations
        prompts = [self.source.prompts.ids[buffer.prompt_ids[int(c) // g]] for c in index]
        rows = completion_rows(prompts, buffer.completion_ids[index], buffer.lengths[index], self.pad_id)
        rows.mask = self._loss_mask(buffer, index)
        return rows

    # ------------------------------------------------------------------ training
    def open_window(self, window: Sequence[Batch], device: torch.device, all_ranks: bool) -> Window:
        b, g = self.layout.global_batch, self.settings.num_generations
        step = int(window[0][SLOT][0]) // b
        buffer = self.rollouts(self.layout.generation_of(step))
        first = self.layout.share_of(step) * b
        step_index = torch.arange(first, first + b)
        # every rank holds the whole generation batch: the step's counts need no collective
        generation_tokens = float(self._loss_mask(buffer, torch.arange(len(buffer.lengths))).sum())
        counts = {
            "completions": float(b),
            "tokens": float(self._loss_mask(buffer, step_index).sum().clamp(min=1)),
            "normaliser": float(step_normaliser(self.settings.loss_type, b, generation_tokens,
                                                self.layout.steps_per_generation, self.settings.max_completion_length)),
        }
        batches = []
        for batch in window:
            index = batch[SLOT].cpu() % b + first
            batches.append({_ROWS: self._rows(buffer, index).to(device), _INDEX: index, _STEP: counts,
                            "micro_batches": len(window)})
        prompt_tokens = sum(len(self.source.prompts.ids[buffer.prompt_ids[int(c) // g]]) for c in step_index)
        real = int(buffer.lengths[step_index].sum()) + prompt_tokens
        return Window(batches, torch.as_tensor(real, dtype=torch.int64, device=device))

    def loss(self, model: Any, batch: Batch) -> MicroBatchLoss:
        rows: CompletionRows = batch[_ROWS]
        index, counts, micro = batch[_INDEX], batch[_STEP], batch["micro_batches"]
        buffer = self.buffer
        assert buffer is not None
        extras: dict[str, Any] = {}
        logps, entropies = completion_logps(model, rows, self.settings.temperature, extras=extras)
        device = logps.device
        old = buffer.old_logps[index].to(device) if buffer.old_logps is not None else logps.detach()
        ref = buffer.ref_logps[index].to(device) if getattr(buffer, "ref_logps", None) is not None else None
        terms, share = self.terms(logps, old, ref, buffer.advantages[index].to(device), rows.mask, counts)
        undo, logged_by = self.processes * self.grad_accum_steps, self.processes * micro
        metrics: dict[str, torch.Tensor] = {}
        for name, (numerator, _) in figure_sums(terms, rows.mask, entropies).items():
            per = "completions" if terms.per_sequence and name not in ("kl", "entropy") else "tokens"
            metrics[name] = numerator / counts[per] * logged_by  # the step's mean over all ranks
        sampled = buffer.sampling_logps[index].to(device)
        # TRL's measure: the sampling pass against the training pass at the weights that sampled
        # (`old`: this step's own log-probs at a generation's first step, else those recorded then)
        difference = (old - sampled).abs() * rows.mask
        metrics["sampling/logp_difference/mean"] = difference.sum() / counts["tokens"] * logged_by
        metrics["sampling/logp_difference/max"] = difference.max()
        for name, value in buffer.figures.items():
            metrics[name] = torch.tensor(value, device=device)
        total = share
        if self.router_coefficient is not None and extras.get("aux_loss") is not None:
            # TRL's: the router loss x its coefficient, a mean over the step's micro-batches and ranks
            router = extras["aux_loss"].to(device) / (self.processes * micro)
            total = total + self.router_coefficient * router
            metrics["aux_loss"] = router.detach() * logged_by
        return MicroBatchLoss(total * undo, total.detach() * logged_by, metrics)

    # ------------------------------------------------------------------ evaluation
    def eval_rows(self, model: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """Each evaluation prompt's group: its completions' mean reward and length."""
        ids = [int(i) for i in batch["prompt"]]
        completions, lengths, ended, _ = self.source.sample(self.model, -1, ids, prompts=self.source.evaluation,
                                                            gather=False)
        matrix = self.source.score(ids, completions, lengths, prompts=self.source.evaluation)
        rewards = self.source.total(matrix).view(len(ids), -1)
        return {"reward": rewards.mean(1), "reward_std": rewards.std(1),
                "length": lengths.float().view(len(ids), -1).mean(1)}

    def eval_figures(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"reward": rows["reward"].mean().item(), "reward_std": rows["reward_std"].mean().item(),
                "completions/mean_length": rows["length"].mean().item()}

    def describe(self, figures: dict[str, float]) -> str:
        return f"reward {figures['reward']:.4f} (std {figures['reward_std']:.4f}), mean length {figures['completions/mean_length']:.1f}"

    def take_timings(self) -> dict[str, float]:
        seconds, self.generation_seconds = self.generation_seconds, 0.0
        return {"generation": seconds} if seconds else {}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": None if self.buffer is None else self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("rollouts")
        self.buffer = None if saved is None else Rollouts.from_state_dict(saved)
