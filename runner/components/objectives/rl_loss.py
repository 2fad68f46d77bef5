"""The policy-loss math of online RL (train.objective=grpo|rloo) as tensor functions,
each equal to TRL 1.16's (tests/components/objectives/test_rl_loss.py runs TRL's own
GRPOTrainer._compute_loss, RLOOTrainer._compute_loss and advantage lines as the oracle).

Advantages are computed once per generation batch, over all ranks' rewards (TRL gathers
them), since a group's baseline needs every completion of the group.

A micro-batch's loss here is its SHARE of the optimizer step's loss: the shares of all
micro-batches on all ranks sum to the step's loss, whatever the layout (1 process x 8
micro-batches, 8 x 1, 2 x 4, unequal micro-batches). TRL's normalisers, per micro-batch
on each of P processes with A accumulation steps and S_trl = TRL's steps_per_generation
(micro-batches per generation batch; ours counts optimizer steps, S = S_trl / A), are:
  grpo     mean over its rows of each row's masked token mean, / A
  dr_grpo  its tokens' sum / (its rows x max_completion_length), / A
  dapo     its tokens' sum / (N / P x A / S_trl), N = num_items_in_batch, the loss-mask
  cispo    tokens of the whole generation batch gathered over ranks (not of a micro-batch)
DDP then averages the gradients over P. For dapo the step's loss is therefore
  (1 / P) x sum over P x A micro-batches of sum_mb x P x S_trl / (N x A)
  = (sum over the step's tokens) / (N x A / S_trl) = (sum over the step's tokens) / (N / S),
N / S being the tokens a step trains on average. For grpo and dr_grpo it is the mean of
the micro-batch means, i.e. the step's completions' mean when micro-batches hold equal
rows; here it is that mean (or sum / (completions x max length)) for any split.
`step_normaliser` gives that denominator and `loss_share` one micro-batch's part of it.
A process's TRL loss is P x its share (the DDP mean): scaling for backward is the caller's.

bnpo (each micro-batch's own tokens) is refused: it changes with the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from runner.config.rl_spec import ImportanceSampling, RLLoss, ScaleRewards

BNPO_REFUSED = ("bnpo normalises over each micro-batch's own tokens, so its loss changes with the number of "
                "processes and the accumulation; use dapo, which normalises over the whole generation batch's tokens")
STD_EPSILON = 1e-4  # TRL's: what keeps a group's zero std from dividing by zero


# --- advantages, over the whole generation batch --------------------------------------


@dataclass(frozen=True)
class RewardFigures:
    """What TRL logs of a generation batch's rewards (0-dim, detached)."""

    reward: torch.Tensor  # the rewards' mean
    reward_std: torch.Tensor  # TRL 1.16's: the std over ALL the rewards (not the groups' mean std)
    frac_reward_zero_std: torch.Tensor  # the share of completions whose scaling std is ~0 (a group all alike)


def _nanstd(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """TRL's nanstd: the std of the non-NaN values with Bessel's correction (NaN below two)."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dims, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count / 1.0, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[n] -> [n / G, G]: a group is a contiguous run of G completions of one prompt."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not make whole groups of {group_size} (at least 2)")
    return rewards.view(-1, group_size)


def _scaling_std(rewards: torch.Tensor, group_size: int, scale: ScaleRewards) -> torch.Tensor:
    """Each completion's std: its group's (group, and none for the zero-std figure) or the batch's."""
    if ScaleRewards(scale) is ScaleRewards.batch:
        return _nanstd(rewards).expand_as(rewards)
    return _nanstd(_grouped(rewards, group_size), dim=1).repeat_interleave(group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: ScaleRewards) -> torch.Tensor:
    """GRPO's advantages [n]: the reward less its group's mean, divided by the group's std
    (group), the generation batch's std (batch) or nothing (none, Dr. GRPO), + 1e-4. NaN
    rewards (unscorable completions) stay out of the mean and std and get 0, as TRL's."""
    grouped = _grouped(rewards, group_size)
    advantages = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)
    if ScaleRewards(scale) is not ScaleRewards.none:
        advantages = advantages / (_scaling_std(rewards, group_size, scale) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def reward_figures(rewards: torch.Tensor, group_size: int, scale: ScaleRewards = ScaleRewards.group,
                   zero_std_of: Optional[torch.Tensor] = None) -> RewardFigures:
    """TRL's reward, reward_std and frac_reward_zero_std of a generation batch's rewards.
    `zero_std_of`: the rewards whose std is tested for zero when not these (RLOO: the
    KL-penalised rewards, with scale=group)."""
    with torch.no_grad():
        tested = rewards if zero_std_of is None else zero_std_of
        std = _scaling_std(tested, group_size, scale)
        is_zero = torch.isclose(std, torch.zeros_like(std))
        return RewardFigures(torch.nanmean(rewards), _nanstd(rewards), is_zero.float().mean())


def rloo_sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO's KL per completion [B]: the sum of the k1 estimate old - ref over its tokens,
    from the sampling pass's log-probs (so a constant of the loss, as TRL's). Its logged
    `kl` is the sum of these over the generation batch / the batch's loss tokens."""
    return ((old_logps - ref_logps) * mask.to(old_logps.dtype)).sum(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int, kl_per_sequence: Optional[torch.Tensor] = None,
                    beta: float = 0.0, normalize: bool = False) -> torch.Tensor:
    """RLOO's advantages [n]: the reward (less beta x its sequence KL) less the mean of
    its group's OTHER rewards. TRL 1.16's RLOOConfig has normalize_advantages=False: no
    scaling by default; `normalize` is its option (the batch's mean 0, std 1, + 1e-4)."""
    if beta != 0.0:
        if kl_per_sequence is None:
            raise ValueError("rloo_advantages with beta != 0 needs each completion's KL (rloo_sequence_kl)")
        rewards = rewards - beta * kl_per_sequence
    grouped = _grouped(rewards, group_size)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (_nanstd(advantages) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


# --- the per-token terms of a micro-batch ---------------------------------------------


@dataclass(frozen=True)
class PolicyTerms:
    """A micro-batch's loss terms and the indicators TRL logs of them."""

    per_token_loss: torch.Tensor  # [B, T]; [B, 1] (one a completion) at sequence level without KL, and RLOO's
    per_token_kl: Optional[torch.Tensor]  # [B, T] k3 against the reference, in the graph; None at beta=0
    is_low_clipped: Optional[torch.Tensor]  # bool, like the ratio ([B, T] or [B, 1]); None for cispo
    is_high_clipped: Optional[torch.Tensor]
    is_region_clipped: Optional[torch.Tensor]
    cispo_clip: Optional[torch.Tensor]  # cispo: the ratio above its cap with a positive advantage
    per_sequence: bool  # one ratio a completion (GSPO, RLOO): the indicators count completions


def _loss_kind(loss_type: Union[RLLoss, str]) -> RLLoss:
    kind = RLLoss(loss_type)
    if kind is RLLoss.bnpo:
        raise ValueError(BNPO_REFUSED)
    return kind


def _clips(coef: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
           epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the clip acts: a ratio below 1 - eps_low on a negative advantage, or above 1 + eps_high on a positive."""
    low = (coef < 1 - epsilon_low) & (advantages < 0)
    high = (coef > 1 + epsilon_high) & (advantages > 0)
    return low, high, low | high


def policy_terms(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor],
                 advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: Union[RLLoss, str],
                 epsilon_low: float, epsilon_high: float, beta: float = 0.0,
                 importance_sampling_level: Union[ImportanceSampling, str] = ImportanceSampling.token,
                 bias_correction_kl: bool = True) -> PolicyTerms:
    """GRPOTrainer._compute_loss's per-token terms from [B, T] log-probs (the policy's in
    the graph, the sampling pass's and the reference's constants) and [B] advantages.
    token: one ratio a token; sequence (GSPO): exp of the completion's mean log-ratio.
    grpo/dr_grpo/dapo clip the ratio two-sided; cispo weighs the log-prob by the ratio
    capped at epsilon_high and detached. beta > 0 adds beta x the k3 KL to each token;
    `bias_correction_kl` (TRL's use_bias_correction_kl, on by default there) weighs it by the
    ratio first: 1 in value on policy, but in the graph, so it changes the KL's gradient."""
    kind = _loss_kind(loss_type)
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    per_sequence = ImportanceSampling(importance_sampling_level) is ImportanceSampling.sequence
    if per_sequence:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef = torch.exp(log_ratio)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("a KL term (beta != 0) needs the reference's log-probs")
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if bias_correction_kl:
            kl = kl * coef
    low = high = region = cispo = None
    if kind is RLLoss.cispo:
        loss = -torch.clamp(coef, max=epsilon_high).detach() * adv * logps
        cispo = (coef > epsilon_high) & (adv > 0)
    else:
        clipped = torch.clamp(coef, 1 - epsilon_low, 1 + epsilon_high)
        loss = -torch.min(coef * adv, clipped * adv)
        low, high, region = _clips(coef, adv, epsilon_low, epsilon_high)
    if kl is not None:
        loss = loss + beta * kl
    return PolicyTerms(loss, kl, low, high, region, cispo, per_sequence)


def rloo_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               epsilon_low: float, epsilon_high: float) -> PolicyTerms:
    """RLOOTrainer._compute_loss's terms: one ratio a completion, of its summed log-probs,
    clipped two-sided; per_token_loss is [B, 1], one loss a completion (the KL is in the
    reward, not here)."""
    m = mask.to(logps.dtype)
    log_ratio = (logps * m).sum(1) - (old_logps * m).sum(1)
    coef = torch.exp(log_ratio)
    clipped = torch.clamp(coef, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(coef * advantages, clipped * advantages)
    low, high, region = _clips(coef, advantages, epsilon_low, epsilon_high)
    return PolicyTerms(loss.unsqueeze(1), None, low.unsqueeze(1), high.unsqueeze(1), region.unsqueeze(1), None, True)


# --- the step's normalisation ----------------------------------------------------------


def step_normaliser(loss_type: Union[RLLoss, str], step_completions: int,
                    generation_tokens: Union[int, torch.Tensor], steps_per_generation: int,
                    max_completion_length: int) -> Union[float, torch.Tensor]:
    """The denominator of one optimizer step's loss (the same on every rank and micro-batch):
    grpo: the step's completions (all ranks); dr_grpo: those x max_completion_length;
    dapo, cispo: the generation batch's loss tokens (all ranks, at least 1) / the optimizer
    steps it trains (runner's steps_per_generation)."""
    kind = _loss_kind(loss_type)
    if kind is RLLoss.grpo:
        return float(step_completions)
    if kind is RLLoss.dr_grpo:
        return float(step_completions * max_completion_length)
    if isinstance(generation_tokens, torch.Tensor):
        return generation_tokens.clamp(min=1.0) / steps_per_generation
    return max(float(generation_tokens), 1.0) / steps_per_generation


def loss_share(terms: PolicyTerms, mask: torch.Tensor, loss_type: Union[RLLoss, str],
               normaliser: Union[float, torch.Tensor]) -> torch.Tensor:
    """This micro-batch's share of the step's loss: grpo, its completions' masked token
    means summed; the others, its loss tokens summed; over the step's `normaliser`."""
    kind = _loss_kind(loss_type)
    mask = mask.to(terms.per_token_loss.dtype)
    masked = terms.per_token_loss * mask
    if kind is RLLoss.grpo:
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / normaliser
    return masked.sum() / normaliser


def rloo_share(terms: PolicyTerms, step_completions: int) -> torch.Tensor:
    """This micro-batch's share of RLOO's step loss, the mean over the step's completions."""
    return terms.per_token_loss.sum() / step_completions


# --- the logged figures, as sums to pool over ranks and micro-batches -------------------


def figure_sums(terms: PolicyTerms, mask: torch.Tensor,
                entropies: Optional[torch.Tensor] = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """TRL's loss figures as (numerator, denominator), fp32 and detached: summed over ranks
    and micro-batches, numerator / denominator.clamp(min=1) is TRL's masked mean over them
    (kl, entropy: over loss tokens; clip ratios: over tokens, or completions when one ratio
    a completion). Unlike TRL, a batch with T = 1 still counts tokens at token level."""
    with torch.no_grad():
        m = mask.float()
        tokens = m.sum()
        completions = torch.tensor(float(mask.size(0)), device=mask.device)

        def over_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (x.float() * m).sum(), tokens

        def per_ratio(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (x.float().sum(), completions) if terms.per_sequence else over_tokens(x)

        sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if terms.per_token_kl is not None:
            sums["kl"] = over_tokens(terms.per_token_kl)
        if entropies is not None:
            sums["entropy"] = over_tokens(entropies)
        clips = {"clip_ratio/low_mean": terms.is_low_clipped, "clip_ratio/high_mean": terms.is_high_clipped,
                 "clip_ratio/region_mean": terms.is_region_clipped, "cispo_clip_ratio": terms.cispo_clip}
        sums.update({name: per_ratio(x) for name, x in clips.items() if x is not None})
        return sums
