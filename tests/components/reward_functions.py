"""Reward functions a test names as `function: tests.components.reward_functions:NAME`,
written as a user writes one for TRL's GRPOTrainer (tests/components/test_rewards.py)."""

from __future__ import annotations

from typing import Any, Optional

SEEN: dict[str, Any] = {}  # what `graded` was last called with, for the test to read

NOT_CALLABLE = 3


def graded(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], answer: list[str],
           level: list[int], **kwargs: Any) -> list[Optional[float]]:
    """The row's level when the completion holds its answer; None (unscored) on level 0 rows."""
    SEEN.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer,
                level=level, **kwargs)
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if lv == 0 else float(lv) * (a in t) for t, a, lv in zip(texts, answer, level)]


def every_other(completions: list[Any], **kwargs: Any) -> list[Optional[float]]:
    """0.5, None, 0.5, ...: None where TRL's trainer then has a NaN."""
    return [None if i % 2 else 0.5 for i in range(len(completions))]


def never(completions: list[Any], **kwargs: Any) -> list[Optional[float]]:
    return [None] * len(completions)


def flags(completions: list[Any], **kwargs: Any) -> list[Optional[bool]]:
    """Booleans, which TRL's torch.tensor(..., dtype=float32) reads as 1.0 and 0.0; None
    for a hedged answer."""
    return [None if c.endswith("surely") else "<think>" in c for c in completions]


def text_at_three(completions: list[Any], **kwargs: Any) -> list[Any]:
    return [1.0, 0.0, 1.0, "abc"][: len(completions)]


def one_short(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) - 1)


def a_dict(completions: list[Any], **kwargs: Any) -> dict[str, float]:
    return {"score": 1.0}
