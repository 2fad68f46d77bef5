"""The rewards of online RL (train.objective=grpo|rloo), declared under `rl.rewards`.

builtins.py holds each built-in kind as a pure function on one completion; declared.py
turns the specs into `Reward`s (checked before training: BadReward, one line naming the
fix) and scores a generation batch as TRL 1.16's GRPOTrainer does: a [completions,
rewards] matrix with NaN for None, and the weighted nansum as each completion's reward.
"""

from __future__ import annotations

from runner.components.rewards.declared import (
    BadReward,
    Reward,
    RewardInputs,
    build_rewards,
    load_function,
    score_all,
    total,
)

__all__ = ["BadReward", "Reward", "RewardInputs", "build_rewards", "load_function", "score_all", "total"]
