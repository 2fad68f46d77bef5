"""The built-in rewards as pure functions on ONE completion: text (or its token count)
in, a float out. declared.py maps them over a batch; keeping them scalar keeps each rule
readable and testable on its own strings.

think_format and soft_overlong are TRL 1.16's think_format_reward and
get_soft_overlong_punishment, rule for rule (tests/components/test_rewards.py runs
TRL's own functions as the oracle); the others are runner's, documented here.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Optional

from runner.config.rl_spec import Extract, RegexMode

# A number as a completion writes it: an optional minus, then either digits grouped by
# thousands commas ("1,234,567") or plain digits, then an optional decimal part; or a
# bare decimal (".5"). The minus counts only where it cannot be a hyphen or an operator
# ("pages 3-5" ends with 5, not -5). Grouping must be in threes, so a list such as
# "1,2,3" reads as three numbers (its last is 3), not as 123, and "12,3456" ends with 3456.
NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+)")

# Patterns declared in YAML are compiled with DOTALL: completions run over several lines,
# and `<answer>.*</answer>` should match an answer that does too. ^ and $ keep their
# whole-text meaning (no MULTILINE); a pattern can still opt out inline with (?-s:...).
REGEX_FLAGS = re.DOTALL

# TRL 1.16's think_format_reward, its pattern and flags verbatim: the completion starts
# with <think>, holds no second <think>, and closes the block with </think>.
THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def last_number(text: str) -> Optional[Decimal]:
    """The last number written in `text`, thousands commas dropped, or None if it has none.

    A Decimal, not a float: "85", "85.0" and "85.00" are the same answer (GSM8K writes
    integers, models often add ".0"), and a Decimal compares them exactly, with none of
    a float's rounding ("0.1" stays 0.1)."""
    found = NUMBER.findall(text)
    return Decimal(found[-1].replace(",", "")) if found else None


def exact_match(completion: str, answer: object, extract: Extract = Extract.none, strip: bool = True,
                casefold: bool = False) -> float:
    """1.0 if the completion gives the answer, else 0.0.

    extract=none compares the texts (the answer as str(), so an int column works),
    after `strip` (surrounding whitespace) and `casefold` (case) on both sides.
    extract=last_number compares the last number of each side by value ("so 85." and
    "85.0" both match an answer of "85", and a GSM8K answer "... #### 1,234" reads as
    1234); a side without a number scores 0.0. strip and casefold do not matter there."""
    if Extract(extract) is Extract.last_number:
        got, want = last_number(completion), last_number(str(answer))
        return float(got is not None and want is not None and got == want)
    got, want = completion, str(answer)
    if strip:
        got, want = got.strip(), want.strip()
    if casefold:
        got, want = got.casefold(), want.casefold()
    return float(got == want)


def regex(completion: str, pattern: re.Pattern[str], mode: RegexMode = RegexMode.fullmatch) -> float:
    """1.0 if the pattern matches the whole completion (fullmatch) or a part of it
    (search), else 0.0. The pattern comes compiled (with REGEX_FLAGS): built once, when
    the spec is read, so a bad pattern fails before training."""
    matcher = pattern.fullmatch if RegexMode(mode) is RegexMode.fullmatch else pattern.search
    return float(matcher(completion) is not None)


def contains(completion: str, text: str, casefold: bool = False) -> float:
    """1.0 if `text` occurs in the completion (both casefolded with `casefold`), else 0.0."""
    if casefold:
        completion, text = completion.casefold(), text.casefold()
    return float(text in completion)


def think_format(completion: str) -> float:
    """TRL's think_format_reward on one completion's text: 1.0 for `<think>...</think>`
    at the very start (nothing before it, one <think> only) followed by anything, else 0.0."""
    return float(THINK_FORMAT.match(completion) is not None)


def length_target(n_tokens: int, target: int) -> float:
    """1 - |n_tokens - target| / target: 1.0 at the target, 0.0 at none or twice the target,
    and negative beyond twice it (not clipped: a far longer completion keeps being pushed
    back, as a clipped 0 would stop doing). `target` is at least 1 (declared.py checks)."""
    return 1.0 - abs(n_tokens - target) / target


def soft_overlong(n_tokens: int, max_completion_length: int, soft_cache: int) -> float:
    """DAPO's soft overlong punishment, as TRL's get_soft_overlong_punishment computes it
    from len(completion_ids): 0.0 up to max - cache tokens, then falling linearly to -1.0
    at max tokens, and -1.0 past it. Only lengthy completions lose; short ones gain nothing.
    TRL's branches and its division are kept as they are, so the floats are the same."""
    free = max_completion_length - soft_cache
    if n_tokens <= free:
        return 0.0
    if n_tokens <= max_completion_length:
        return (free - n_tokens) / soft_cache
    return -1.0
