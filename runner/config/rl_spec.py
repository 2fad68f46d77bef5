"""The run spec's online RL section (`rl.*`): train.objective=grpo|rloo generates
completions to prompts, scores them with rewards declared here, and learns from the
scores (docs/rl.md).

Part of the schema in runner.config.spec, which nests `RLSpec` as `RunSpec.rl` and
re-exports these names; apart because an objective's own settings grow with it. Every
field is documented under it, as in spec.py (docs/configuration.md is generated from it).
The defaults are TRL 1.16's GRPOConfig's unless a field says otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class RLLoss(str, enum.Enum):
    """How a step's per-token terms become its loss (TRL's `loss_type`)."""

    grpo = "grpo"  # each completion's token mean, then the mean over completions
    dr_grpo = "dr_grpo"  # Dr. GRPO: the tokens' sum over completions x max_completion_length
    dapo = "dapo"  # DAPO (TRL's default): the tokens' sum over the generation batch's tokens per step
    cispo = "cispo"  # CISPO (MiniMax-M1): the clipped, detached ratio weights the log-prob; normalised as dapo
    bnpo = "bnpo"  # TRL's: over a micro-batch's own tokens; refused (it changes with the layout)


class ScaleRewards(str, enum.Enum):
    group = "group"  # advantage = (r - group mean) / (group std + 1e-4)
    batch = "batch"  # ... / (the generation batch's std + 1e-4)
    none = "none"  # r - group mean (Dr. GRPO)


class ImportanceSampling(str, enum.Enum):
    token = "token"  # GRPO: one ratio per token
    sequence = "sequence"  # GSPO: one ratio per completion, its tokens' mean log-ratio


class RewardKind(str, enum.Enum):
    exact_match = "exact_match"  # the completion equals a column of the row (after `extract`, `strip`, `casefold`)
    regex = "regex"  # the completion matches `pattern` (`match`: fullmatch or search)
    length = "length"  # closeness to `target` tokens, or DAPO's soft overlong penalty (`soft_cache`)
    contains = "contains"  # the completion contains `text`
    think_format = "think_format"  # TRL's think_format_reward: <think>...</think> then an answer
    function = "function"  # `function: module:callable` with TRL's reward signature


class Extract(str, enum.Enum):
    none = "none"  # the whole completion
    last_number = "last_number"  # the completion's last number (GSM8K's answers), commas dropped


class RegexMode(str, enum.Enum):
    fullmatch = "fullmatch"
    search = "search"


@dataclass
class RewardSpec:
    """One reward: what it scores and its weight in the total (TRL's reward_weights)."""

    kind: RewardKind = RewardKind.exact_match
    """exact_match | regex | length | contains | think_format | function."""
    weight: float = 1.0
    """Its weight in the reward: the sum of weight x score over the rewards."""
    name: Optional[str] = None
    """The name its metrics carry (rewards/<name>/mean). null: the kind, or the function's name."""
    column: Optional[str] = None
    """exact_match: the row's column holding the right answer. null: `answer`."""
    extract: Extract = Extract.none
    """exact_match: what of the completion is compared (last_number: its last number)."""
    strip: bool = True
    """exact_match: compare without surrounding whitespace."""
    casefold: bool = False
    """exact_match, contains: compare without case."""
    pattern: Optional[str] = None
    """regex: the pattern (Python's re)."""
    match: RegexMode = RegexMode.fullmatch
    """regex: the whole completion must match (fullmatch), or a part of it (search)."""
    text: Optional[str] = None
    """contains: the text the completion must contain."""
    target: Optional[int] = None
    """length: the completion length (tokens) scored 1; the score falls as |length -
    target| / target. Leave null with soft_cache for DAPO's overlong penalty."""
    soft_cache: Optional[int] = None
    """length: DAPO's soft overlong penalty (TRL's get_soft_overlong_punishment): 0 up to
    rl.max_completion_length - soft_cache tokens, then falling linearly to -1 at the maximum."""
    function: Optional[str] = None
    """function: `module:callable`, called as TRL calls a reward function: (prompts=,
    completions=, completion_ids=, the row's other columns as lists=) -> a list of floats
    (None for a completion it does not score: counted as 0)."""


def _default_rewards() -> list[RewardSpec]:
    return []


@dataclass
class RLSpec:
    """train.objective=grpo|rloo: generation, rewards and the policy loss (docs/rl.md)."""

    rewards: list[RewardSpec] = field(default_factory=_default_rewards)
    """The rewards, each scored on every completion; the reward is their weighted sum. The
    prompt is the record's data.prompt_field (a string, or {role, content} messages
    formatted by the chat template with the generation prompt); every other field of the
    record reaches the rewards under its own name."""
    chat_prompts: bool = False
    """A prompt that is text is sent as the user's one message through the tokenizer's chat
    template, with the generation prompt (an instruct model's format; GSM8K's questions).
    Messages always are. The rewards see the record's text as it is."""
    num_generations: int = 8
    """Completions per prompt (G): a group, whose rewards' mean is the baseline. At least 2;
    the global batch (completions per optimizer step) must hold whole groups."""
    max_completion_length: int = 256
    """Tokens generated per completion at most (prompt + this must fit the model's positions)."""
    temperature: float = 1.0
    """Sampling temperature; training scores log-probs at the same temperature (logits / T)."""
    loss_type: RLLoss = RLLoss.dapo
    """grpo | dr_grpo | dapo | cispo (bnpo is refused: it changes with the layout)."""
    importance_sampling_level: ImportanceSampling = ImportanceSampling.token
    """token (GRPO) | sequence (GSPO: the completion's mean log-ratio, one ratio a completion)."""
    epsilon: float = 0.2
    """The clip range's lower side: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: Optional[float] = None
    """The clip range's upper side. null: epsilon. cispo: the ratio's cap (TRL's default 5.0 there)."""
    beta: float = 0.0
    """The KL coefficient. 0: no reference (TRL's default). Above 0: the k3 estimator against
    the starting weights (with peft: the model with its adapters switched off)."""
    use_bias_correction_kl: bool = True
    """beta > 0: weigh each token's KL by its importance ratio (TRL's default, DeepSeek-V3.2's
    unbiased reverse-KL gradient): 1 in value on policy, yet it changes the KL's gradient."""
    scale_rewards: ScaleRewards = ScaleRewards.group
    """group | batch | none: what divides a completion's reward less its group's mean."""
    steps_per_generation: int = 1
    """Optimizer steps trained on each generation batch, each on its own share of it
    (TRL counts micro-batches: TRL's value = this x accumulation). The generation batch
    is this x the global batch completions."""
    num_iterations: int = 1
    """Passes over each generation batch (PPO's epochs, TRL's mu)."""
    mask_truncated_completions: bool = False
    """Leave completions that reached max_completion_length without an end-of-sequence
    out of the loss (DAPO)."""
    disable_dropout: bool = True
    """Turn the policy's dropout off: generation and training then score the same model, and
    the sampling log-probs equal the training pass's. TRL 1.16's GRPOConfig keeps dropout
    on by default (its DPOConfig turns it off); false keeps the model's dropout in training."""
