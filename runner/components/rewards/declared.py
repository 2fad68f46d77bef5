"""The rewards a run declares (`rl.rewards`, runner/config/rl_spec.py) as callables, and a
batch's scores as TRL 1.16's GRPOTrainer computes them.

build_rewards reads every spec once, before training: a pattern that does not compile, a
field a kind needs and lacks, a `module:function` that does not import, each stops the run
with one line naming the fix (BadReward), not a traceback mid-run. Scoring then follows
TRL's `_calculate_rewards`: a user function is called with TRL's keywords, None becomes NaN
in the [completions, rewards] matrix, and the total is the weighted nansum, NaN where every
reward returned None (TRL 1.16 leaves such a completion out of its group's baseline).
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from runner.components.rewards import builtins
from runner.config.errors import UserError
from runner.config.rl_spec import Extract, RegexMode, RewardKind, RewardSpec

EMPTY = "rl.rewards is empty: declare at least one, e.g. rl.rewards=[{kind: exact_match, column: answer}]"
RETURNS = "a reward function returns a list of floats (None to skip)"
# The keywords TRL gives every reward function besides the rows' columns.
ARGUMENTS = frozenset({"prompts", "completions", "completion_ids"})


class BadReward(UserError, ValueError):
    """A reward the user declared or wrote is unusable: one line saying where and the fix.
    A UserError, so the CLI prints it without a traceback; a ValueError, as a bad value."""

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\n", "\\n"))  # one line, whatever a pattern or value holds


@dataclass(frozen=True)
class RewardInputs:
    """What the rewards see of a generation batch, one entry per completion (a prompt and
    its row's columns repeat for each of its completions, as TRL repeats them)."""

    prompts: list[Any]  # strings, or lists of {role, content} messages
    completions: list[str]  # the decoded completions, special tokens skipped
    completion_ids: list[list[int]]  # each completion's tokens, its EOS included, no padding
    columns: dict[str, list[Any]]  # the rows' other fields by name

    def __post_init__(self) -> None:
        n = len(self.completions)
        sizes = {"prompts": len(self.prompts), "completion_ids": len(self.completion_ids)}
        sizes.update({f"columns[{name!r}]": len(values) for name, values in self.columns.items()})
        wrong = {key: size for key, size in sizes.items() if size != n}
        if wrong:
            raise ValueError(f"RewardInputs: {n} completions but {wrong}: one entry per completion")


Scorer = Callable[[RewardInputs], list[float]]


@dataclass(frozen=True)
class Reward:
    """One declared reward: its metric name, its weight in the total, and its scorer,
    which returns one float per completion (NaN where a user function returned None)."""

    name: str
    weight: float
    score: Scorer


def build_rewards(specs: Sequence[RewardSpec], max_completion_length: int) -> list[Reward]:
    """Every declared reward, checked and ready to score; BadReward names the first problem."""
    if not specs:
        raise BadReward(EMPTY)
    rewards: list[Reward] = []
    for index, spec in enumerate(specs):
        reward = _build(index, spec, max_completion_length)
        for other, earlier in enumerate(rewards):
            if earlier.name == reward.name:
                raise BadReward(f"rl.rewards[{index}]: name '{reward.name}' is rl.rewards[{other}]'s too: give one "
                                f"of them its own name (name: ...), as its metrics are rewards/<name>/mean")
        rewards.append(reward)
    return rewards


def score_all(rewards: Sequence[Reward], inputs: RewardInputs) -> torch.Tensor:
    """[completions, rewards] float32, TRL's rewards_per_func: NaN where a function returned None."""
    columns = [reward.score(inputs) for reward in rewards]
    matrix = torch.tensor(columns, dtype=torch.float32).reshape(len(rewards), len(inputs.completions))
    return matrix.T.contiguous()


def total(matrix: torch.Tensor, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """[completions]: sum of weight x score over the rewards, NaN scores skipped (TRL's
    `(rewards_per_func * reward_weights).nansum(dim=1)`), and NaN where every score is NaN:
    TRL 1.16 marks such a completion unscorable, out of its group's mean and std, with an
    advantage of 0; a 0 here would pull its group's baseline down instead."""
    w = torch.as_tensor(weights, dtype=matrix.dtype, device=matrix.device)
    summed = (matrix * w.unsqueeze(0)).nansum(dim=1)
    return summed.masked_fill(torch.isnan(matrix).all(dim=1), math.nan)


def _build(index: int, spec: RewardSpec, max_completion_length: int) -> Reward:
    where = f"rl.rewards[{index}]"
    kind = RewardKind(spec.kind)
    if not math.isfinite(spec.weight):
        raise BadReward(f"{where}: weight {spec.weight} is not a finite number: set weight to a float such as 1.0")
    if kind is RewardKind.function:
        func = load_function(where, spec.function)
        name = spec.name or getattr(func, "__name__", None) or str(spec.function).rpartition(":")[2]
        return Reward(name, float(spec.weight), _user_scorer(f"{where} ({name})", func))
    name = spec.name or kind.value
    return Reward(name, float(spec.weight), _BUILTINS[kind](spec, where, f"{where} ({name})", max_completion_length))


# --- the built-in kinds: each checks its fields and returns a batch scorer -----------------------------------


def _exact_match(spec: RewardSpec, where: str, label: str, max_completion_length: int) -> Scorer:
    column, extract, strip, casefold = spec.column or "answer", Extract(spec.extract), spec.strip, spec.casefold

    def score(inputs: RewardInputs) -> list[float]:
        answers = _column(inputs, column, label)
        return [builtins.exact_match(c, a, extract, strip, casefold) for c, a in zip(inputs.completions, answers)]
    return score


def _regex(spec: RewardSpec, where: str, label: str, max_completion_length: int) -> Scorer:
    if spec.pattern is None:
        raise BadReward(f"{where}: kind regex needs a pattern: add pattern: '<answer>.*</answer>' (Python's re)")
    try:
        pattern = re.compile(spec.pattern, builtins.REGEX_FLAGS)
    except re.error as exc:
        raise BadReward(f"{where}: regex pattern '{spec.pattern}' does not compile ({exc}): fix the pattern") from exc
    mode = RegexMode(spec.match)
    return lambda inputs: [builtins.regex(c, pattern, mode) for c in inputs.completions]


def _contains(spec: RewardSpec, where: str, label: str, max_completion_length: int) -> Scorer:
    text, casefold = spec.text, spec.casefold  # read now: the scorer never looks at the spec again
    if not text:  # "" is in every completion: a reward that cannot tell completions apart
        raise BadReward(f"{where}: kind contains needs a non-empty text: add text: '...' (the text to look for)")
    return lambda inputs: [builtins.contains(c, text, casefold) for c in inputs.completions]


def _length(spec: RewardSpec, where: str, label: str, max_completion_length: int) -> Scorer:
    target, cache = spec.target, spec.soft_cache
    if (target is None) == (cache is None):
        given = "both" if target is not None else "neither"
        raise BadReward(f"{where}: kind length takes a target or a soft_cache, and has {given}: set target "
                        f"(tokens scored 1) or soft_cache (DAPO's overlong penalty), not both")
    if target is not None:
        if target < 1:
            raise BadReward(f"{where}: length target={target} is not a token count: set target to 1 or more")
        return lambda inputs: [builtins.length_target(len(ids), target) for ids in inputs.completion_ids]
    assert cache is not None
    if not 0 < cache <= max_completion_length:
        raise BadReward(f"{where}: length soft_cache={cache} is not in (0, rl.max_completion_length="
                        f"{max_completion_length}]: set soft_cache between 1 and {max_completion_length}")
    return lambda inputs: [builtins.soft_overlong(len(ids), max_completion_length, cache)
                           for ids in inputs.completion_ids]


_BUILTINS: dict[RewardKind, Callable[[RewardSpec, str, str, int], Scorer]] = {
    RewardKind.exact_match: _exact_match,
    RewardKind.regex: _regex,
    RewardKind.contains: _contains,
    RewardKind.think_format: lambda *_: lambda inputs: [builtins.think_format(c) for c in inputs.completions],
    RewardKind.length: _length,
}


def _column(inputs: RewardInputs, column: str, label: str) -> list[Any]:
    if column not in inputs.columns:
        have = ", ".join(sorted(inputs.columns)) or "none besides the prompt"
        raise BadReward(f"{label}: the rows have no column '{column}' (they have: {have}): set column to the one "
                        f"holding the right answer")
    return inputs.columns[column]


# --- user functions: `module:callable`, called as TRL calls a reward function -----------------------------


def load_function(where: str, reference: Optional[str]) -> Callable[..., Any]:
    """The callable `reference` names (module:attribute, the attribute possibly dotted)."""
    if not reference:
        raise BadReward(f"{where}: kind function needs a function: add function: my_module:my_reward")
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise BadReward(f"{where}: function '{reference}' is not module:callable: write it as e.g. my_module:my_reward")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the module raises while it imports
        raise BadReward(f"{where}: function '{reference}': module '{module_name}' does not import "
                        f"({type(exc).__name__}: {_short(str(exc), 120)}): put it on PYTHONPATH or fix it") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise BadReward(f"{where}: function '{reference}': module '{module_name}' has no attribute "
                            f"'{attribute}': name a function the module defines")
        target = getattr(target, part)
    if not callable(target):
        raise BadReward(f"{where}: function '{reference}': '{attribute}' is a {type(target).__name__}, "
                        f"not callable: name a function")
    return target


def _user_scorer(label: str, func: Callable[..., Any]) -> Scorer:
    def score(inputs: RewardInputs) -> list[float]:
        clash = sorted(ARGUMENTS & inputs.columns.keys())
        if clash:
            raise BadReward(f"{label}: the rows' column '{clash[0]}' has the name of an argument every reward "
                            f"function is given: rename the column in the data")
        completions: list[Any] = inputs.completions
        if inputs.prompts and _is_conversation(inputs.prompts[0]):
            # TRL hands a chat's completions over as messages, [{"role": "assistant", "content": text}]
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        returned = func(prompts=inputs.prompts, completions=completions, completion_ids=inputs.completion_ids,
                        **inputs.columns)
        return _as_scores(label, returned, len(inputs.completions))
    return score


def _as_scores(label: str, returned: Any, n: int) -> list[float]:
    """A user function's return as floats, None as NaN (TRL's), or BadReward."""
    if isinstance(returned, torch.Tensor):
        returned = returned.tolist()
    if not isinstance(returned, (list, tuple)):
        raise BadReward(f"{label}: returned {_show(returned)}, not a list: {RETURNS}, one per completion")
    if len(returned) != n:
        raise BadReward(f"{label}: returned {len(returned)} values for {n} completions: {RETURNS}, one per completion")
    return [_as_score(label, value, i) for i, value in enumerate(returned)]


def _as_score(label: str, value: Any, i: int) -> float:
    # What torch.tensor(..., dtype=float32) takes, as TRL converts: ints, floats, bools, numpy
    # and 0-d tensor scalars (anything with __float__); never a string, even one of digits.
    if value is None:
        return math.nan
    if not isinstance(value, (str, bytes)) and hasattr(type(value), "__float__"):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise BadReward(f"{label}: returned {_show(value)} for completion {i}, not a number: {RETURNS}")


def _is_conversation(prompt: Any) -> bool:
    """TRL's is_conversational for a prompt: a list of messages with a role."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _show(value: Any) -> str:
    return _short(repr(value), 60)


def _short(text: str, most: int) -> str:
    """`text` on one line, cut at `most` characters: a message stays one readable line."""
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 3] + "..."
