"""What the launcher refuses of an online RL run (train.objective=grpo), one line each,
before any process starts: the checks of `rl.*` that need only the spec. The rewards'
own problems (a regex that does not compile, a `module:function` that is not there) are
the rewards' to find (runner/components/rewards), at the launch's preflight."""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from runner.config.batch import global_batch
from runner.config.mixture import row_format
from runner.config.data_spec import DataFormat
from runner.config.rl_spec import RLLoss, RLSpec
from runner.config.spec import ObjectiveKind, RunSpec


def check_rl(spec: RunSpec, world_size: Optional[int]) -> list[str]:
    rl, p = spec.rl, []
    kind = spec.train.objective
    grpo = kind.online_rl
    prompts = row_format(spec.data) is DataFormat.prompts
    if grpo != prompts:
        p.append(f"train.objective={kind.value} trains on data.format=prompts (a prompt and the columns its rewards "
                 "read), and only online RL does: use objective=grpo or rloo with prompt data, or neither." if grpo else
                 "data.format=prompts is trained by online RL: add objective=grpo (or objective=rloo).")
    if not grpo:
        defaults = RLSpec()
        changed = [f"rl.{f.name}" for f in fields(RLSpec) if getattr(rl, f.name) != getattr(defaults, f.name)]
        if changed:
            p.append(f"{', '.join(changed)} set, but train.objective is not online RL: add objective=grpo (or rloo) or "
                     "remove them.")
        return p
    if rl.num_generations < 2:
        p.append(f"rl.num_generations={rl.num_generations}: a group needs at least 2 completions (its mean is the "
                 "baseline). Set rl.num_generations=2 or more.")
    elif world_size is not None:
        batch = global_batch(spec.train, world_size)
        if batch % rl.num_generations:
            p.append(f"the global batch ({batch} completions: train.per_device_batch_size x {world_size} processes x "
                     f"accumulation) does not hold whole groups of rl.num_generations={rl.num_generations}: make it a "
                     "multiple of it (train.global_batch_size or train.per_device_batch_size).")
    if kind is ObjectiveKind.rloo:
        defaults = RLSpec()
        grpo_only = [f"rl.{name}" for name in ("loss_type", "importance_sampling_level", "scale_rewards",
                                               "use_bias_correction_kl", "mask_truncated_completions")
                     if getattr(rl, name) != getattr(defaults, name)]
        if grpo_only:
            p.append(f"{', '.join(grpo_only)} set: GRPO's, and objective=rloo's loss is RLOO's (a sequence ratio, the "
                     "leave-one-out baseline, the KL in the reward): remove them, or use objective=grpo.")
    elif rl.loss_type is RLLoss.bnpo:
        p.append("rl.loss_type=bnpo normalises over each micro-batch's own tokens, so its loss changes with the number "
                 "of processes and the accumulation: use rl.loss_type=dapo (normalised over the generation batch's "
                 "tokens).")
    if rl.max_completion_length < 1:
        p.append(f"rl.max_completion_length={rl.max_completion_length} must be at least 1.")
    if rl.temperature <= 0:
        p.append(f"rl.temperature={rl.temperature} must be above 0 (sampling divides the logits by it).")
    if rl.steps_per_generation < 1 or rl.num_iterations < 1:
        p.append("rl.steps_per_generation and rl.num_iterations must be at least 1.")
    if rl.epsilon < 0 or (rl.epsilon_high is not None and rl.epsilon_high < 0):
        p.append("rl.epsilon and rl.epsilon_high must be 0 or more.")
    if rl.beta < 0:
        p.append(f"rl.beta={rl.beta} must be 0 (no reference) or more.")
    if not rl.rewards:
        p.append("rl.rewards is empty: declare at least one, e.g. rl.rewards='[{kind: exact_match, column: answer}]'.")
    if spec.data.streaming:
        p.append("data.streaming=true is for text corpora; prompts for train.objective=grpo are read whole: set "
                 "data.streaming=false.")
    return p
