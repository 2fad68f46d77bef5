"""The declared rewards (runner/components/rewards/): each built-in on its own strings,
think_format and soft_overlong against TRL 1.16's own functions, the batch's matrix
against TRL's GRPOTrainer._calculate_rewards (on a stand-in trainer) and its total
against TRL's weighted nansum, and every declaration refused with one line naming the fix."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from runner.components.rewards import BadReward, RewardInputs, build_rewards, score_all, total
from runner.components.rewards.builtins import (
    REGEX_FLAGS,
    contains,
    exact_match,
    length_target,
    regex,
    soft_overlong,
    think_format,
)
from runner.config.rl_spec import Extract, RegexMode, RewardKind, RewardSpec
from tests.components import reward_functions

FUNCTIONS = "tests.components.reward_functions"


@pytest.mark.parametrize("completion, answer, strip, casefold, expected", [
    ("85", "85", True, False, 1.0),
    ("  85\n", "85", True, False, 1.0),  # surrounding whitespace dropped
    ("  85\n", "85", False, False, 0.0),  # ... unless strip=false
    ("85", 85, True, False, 1.0),  # an int column compares as its text
    ("Paris", "paris", True, False, 0.0),
    ("Paris", "paris", True, True, 1.0),
    ("", "", True, False, 1.0),
    ("", "85", True, False, 0.0),
    ("line one\nline two", "line one\nline two", True, False, 1.0),
    ("line one\nline two", "line two", True, False, 0.0),  # whole text, not a part
])
def test_exact_match_compares_the_whole_text(completion: str, answer: Any, strip: bool, casefold: bool,
                                            expected: float) -> None:
    assert exact_match(completion, answer, Extract.none, strip, casefold) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("6 + 7 = 13, so the answer is 85.", "85", 1.0),
    ("The answer is 85.0", "85", 1.0),  # by value: 85.0 is 85
    ("It costs $1,234.", "1234", 1.0),  # thousands commas dropped
    ("It costs 1234", "Natalia sold 48/2 = 24 clips.\n#### 1,234", 1.0),  # GSM8K's answer: its last number
    ("the temperature fell to -7", "-7", 1.0),
    ("the temperature fell to -7", "7", 0.0),
    ("pages 3-5", "5", 1.0),  # a hyphen between numbers is not a minus
    ("x = -2.5", "-2.50", 1.0),
    ("either 1,2,3", "3", 1.0),  # not one number 123
    ("first 12\nthen\n40\n", "40", 1.0),  # multi-line: the last number
    ("no number here", "85", 0.0),
    ("", "85", 0.0),
    ("85", "no number", 0.0),
    ("0.1", "0.10", 1.0),
    ("0.1", "0.11", 0.0),
])
def test_exact_match_on_the_last_number(completion: str, answer: str, expected: float) -> None:
    assert exact_match(completion, answer, Extract.last_number) == expected


@pytest.mark.parametrize("completion, pattern, mode, expected", [
    ("<answer>42</answer>", r"<answer>\d+</answer>", RegexMode.fullmatch, 1.0),
    ("so <answer>42</answer>", r"<answer>\d+</answer>", RegexMode.fullmatch, 0.0),  # fullmatch is the whole text
    ("<answer>42</answer> done", r"<answer>\d+</answer>", RegexMode.fullmatch, 0.0),
    ("so <answer>42</answer> done", r"<answer>\d+</answer>", RegexMode.search, 1.0),
    ("<answer>4\n2</answer>", r"<answer>.*</answer>", RegexMode.fullmatch, 1.0),  # . spans lines (DOTALL)
    ("<answer>4\n2</answer>", r"<answer>(?-s:.*)</answer>", RegexMode.fullmatch, 0.0),  # ... unless opted out
    ("", r"", RegexMode.fullmatch, 1.0),
    ("", r"x", RegexMode.search, 0.0),
])
def test_regex_fullmatch_or_search(completion: str, pattern: str, mode: RegexMode, expected: float) -> None:
    assert regex(completion, re.compile(pattern, REGEX_FLAGS), mode) == expected


@pytest.mark.parametrize("completion, text, casefold, expected", [
    ("The Answer is 4", "Answer", False, 1.0),
    ("The Answer is 4", "answer", False, 0.0),
    ("The Answer is 4", "answer", True, 1.0),
    ("two\nlines", "o\nl", False, 1.0),
    ("", "x", False, 0.0),
])
def test_contains(completion: str, text: str, casefold: bool, expected: float) -> None:
    assert contains(completion, text, casefold) == expected


THINK = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
    "<think>\nThis is my reasoning.\nThis is my answer.",  # never closed
    "<think></think>",
    "<think>a</think>",
    " <think>a</think>b",  # something before it
    "Answer first <think>a</think>",
    "Answer first\n<think>a</think>b",  # at a line's start, not the text's: ^ of MULTILINE with match
    "<think>a<think>b</think>c",  # a second <think>
    "<think>a</think>b<think>c</think>",
    "<think>a</think>b</think>",
    "<THINK>a</THINK>b",
    "<think>line\n\n</think>\n\nline\nline",
    "<think>a\n</think>",
    "",
    "</think><think>",
]


def test_think_format_is_trls() -> None:
    from trl.rewards import think_format_reward

    expected = think_format_reward([[{"role": "assistant", "content": text}] for text in THINK])
    assert [think_format(text) for text in THINK] == expected
    assert 0.0 in expected and 1.0 in expected  # the strings tell the two apart


@pytest.mark.parametrize("n, target, expected", [
    (100, 100, 1.0), (50, 100, 0.5), (150, 100, 0.5), (0, 100, 0.0), (200, 100, 0.0), (300, 100, -1.0), (1, 1, 1.0),
])
def test_length_target(n: int, target: int, expected: float) -> None:
    assert length_target(n, target) == pytest.approx(expected)


@pytest.mark.parametrize("max_length, cache", [(100, 20), (16, 16), (16, 1), (7, 3)])
def test_soft_overlong_is_trls(max_length: int, cache: int) -> None:
    from trl.rewards import get_soft_overlong_punishment

    lengths = list(range(0, max_length + 4))  # below, at max - cache, inside, at max, past it
    expected = get_soft_overlong_punishment(max_completion_len=max_length, soft_punish_cache=cache)(
        [[1] * n for n in lengths])
    assert [soft_overlong(n, max_length, cache) for n in lengths] == expected
    assert min(expected) == -1.0 and max(expected) == 0.0


# --- a batch: 2 prompts x 2 completions, with the rows' columns ------------------------------------------------


def batch(prompts: list[Any] | None = None) -> RewardInputs:
    completions = ["<think>hm</think>so 4", "it is 5", "<think>x</think>PARIS", "paris, surely"]
    return RewardInputs(
        prompts=prompts or ["2+2?", "2+2?", "capital?", "capital?"],
        completions=completions,
        completion_ids=[[1] * n for n in (3, 8, 10, 12)],
        columns={"answer": ["4", "4", "Paris", "Paris"], "level": [1, 1, 0, 0]},
    )


def test_a_declared_batch_scores_each_reward() -> None:
    specs = [
        RewardSpec(kind=RewardKind.exact_match, extract=Extract.last_number, weight=2.0),
        RewardSpec(kind=RewardKind.think_format),
        RewardSpec(kind=RewardKind.contains, text="paris", casefold=True),
        RewardSpec(kind=RewardKind.regex, pattern=r"\d", match=RegexMode.search, name="digit"),
        RewardSpec(kind=RewardKind.length, target=10),
        RewardSpec(kind=RewardKind.length, soft_cache=4, name="overlong"),
        RewardSpec(kind=RewardKind.function, function=f"{FUNCTIONS}:graded"),
    ]
    rewards = build_rewards(specs, max_completion_length=10)
    names = [r.name for r in rewards]
    assert names == ["exact_match", "think_format", "contains", "digit", "length", "overlong", "graded"]
    matrix = score_all(rewards, batch())
    assert matrix.dtype == torch.float32 and matrix.shape == (4, 7)
    nan = math.nan
    expected = torch.tensor([
        [1.0, 1.0, 0.0, 1.0, 0.3, 0.0, 1.0],
        [0.0, 0.0, 0.0, 1.0, 0.8, -0.5, 0.0],
        [0.0, 1.0, 1.0, 0.0, 1.0, -1.0, nan],
        [0.0, 0.0, 1.0, 0.0, 0.8, -1.0, nan],
    ])
    torch.testing.assert_close(matrix, expected, equal_nan=True)


def test_a_user_function_gets_the_rows_columns_as_trl_gives_them() -> None:
    rewards = build_rewards([RewardSpec(kind=RewardKind.function, function=f"{FUNCTIONS}:graded")], 10)
    inputs = batch()
    score_all(rewards, inputs)
    seen = reward_functions.SEEN
    assert seen["prompts"] == inputs.prompts and seen["completions"] == inputs.completions
    assert seen["completion_ids"] == inputs.completion_ids
    assert seen["answer"] == ["4", "4", "Paris", "Paris"] and seen["level"] == [1, 1, 0, 0]
    # A chat prompt: TRL hands the completions over as assistant messages.
    chat = [[{"role": "user", "content": "2+2?"}]] * 4
    score_all(rewards, batch(chat))
    assert seen["completions"][0] == [{"role": "assistant", "content": "<think>hm</think>so 4"}]


@pytest.fixture
def trl_trainer() -> Iterator[Any]:
    """GRPOTrainer._calculate_rewards' self: what it reads of the trainer, nothing else.
    Accelerate's process state is set up for its gather and warning, and forgotten after."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    was_set = bool(AcceleratorState._shared_state or PartialState._shared_state)
    PartialState(cpu=True)
    yield SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
                          state=SimpleNamespace(global_step=0), args=SimpleNamespace(report_to=[]),
                          reward_processing_classes=[], reward_func_names=[], reward_funcs=[],
                          _log_completion_extra=None, _log_metric=None, environments=None)
    if not was_set:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_matrix_and_total_are_trls(trl_trainer: Any) -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    names = ["graded", "every_other", "flags", "never"]
    weights = [2.0, -0.5, 1.0, 3.0]
    specs = [RewardSpec(kind=RewardKind.function, function=f"{FUNCTIONS}:{name}", weight=w)
             for name, w in zip(names, weights)]
    rewards = build_rewards(specs, 10)
    inputs = batch()
    matrix = score_all(rewards, inputs)

    funcs = [getattr(reward_functions, name) for name in names]
    trl_trainer.reward_funcs, trl_trainer.reward_func_names = funcs, names
    trl_trainer.reward_processing_classes = [None] * len(funcs)
    rows = [{"prompt": p, **{k: v[i] for k, v in inputs.columns.items()}} for i, p in enumerate(inputs.prompts)]
    expected = GRPOTrainer._calculate_rewards(trl_trainer, rows, inputs.prompts, inputs.completions,
                                              inputs.completion_ids)
    torch.testing.assert_close(matrix, expected, equal_nan=True, atol=0, rtol=0)
    assert torch.isnan(matrix).all(dim=1).any()  # row 3: every_other's and graded's None, never's None

    # TRL 1.16's _generate_and_score_completions, its lines verbatim on its matrix.
    reward_weights = torch.tensor(weights, dtype=torch.float32)
    unscorable_mask = torch.isnan(expected).all(dim=1)
    trl_rewards = (expected * reward_weights.unsqueeze(0)).nansum(dim=1)
    trl_rewards[unscorable_mask] = torch.nan
    ours = total(matrix, [r.weight for r in rewards])
    torch.testing.assert_close(ours, trl_rewards, equal_nan=True, atol=0, rtol=0)
    assert not torch.isnan(ours[:3]).any() and torch.isnan(ours[3])


# --- what is refused, each with one line naming the fix ----------------------------------------------------------


def function(name: str | None) -> RewardSpec:
    return RewardSpec(kind=RewardKind.function, function=name)


REFUSED = {
    "none": ([], "declare at least one, e.g. rl.rewards=[{kind: exact_match"),
    "regex compiles not": ([RewardSpec(), RewardSpec(kind=RewardKind.regex, pattern="(")],
                           "rl.rewards[1]: regex pattern '(' does not compile (missing ), unterminated subpattern "
                           "at position 0): fix the pattern"),
    "regex with a newline": ([RewardSpec(kind=RewardKind.regex, pattern="a\n(")],
                             "rl.rewards[0]: regex pattern 'a\\n(' does not compile"),
    "regex without pattern": ([RewardSpec(kind=RewardKind.regex)], "needs a pattern: add pattern:"),
    "contains without text": ([RewardSpec(kind=RewardKind.contains)], "needs a non-empty text: add text:"),
    "contains empty text": ([RewardSpec(kind=RewardKind.contains, text="")], "needs a non-empty text: add text:"),
    "length without either": ([RewardSpec(kind=RewardKind.length)], "has neither: set target"),
    "length with both": ([RewardSpec(kind=RewardKind.length, target=5, soft_cache=2)], "has both: set target"),
    "length target 0": ([RewardSpec(kind=RewardKind.length, target=0)], "set target to 1 or more"),
    "soft_cache 0": ([RewardSpec(kind=RewardKind.length, soft_cache=0)], "set soft_cache between 1 and 10"),
    "soft_cache past max": ([RewardSpec(kind=RewardKind.length, soft_cache=11)],
                            "soft_cache=11 is not in (0, rl.max_completion_length=10]: set soft_cache between"),
    "function unset": ([function(None)], "needs a function: add function: my_module:my_reward"),
    "function no colon": ([function("my_rewards")], "is not module:callable: write it as"),
    "module imports not": ([function("tests.components.no_such_module:f")],
                           "module 'tests.components.no_such_module' does not import (ModuleNotFoundError"),
    "attribute missing": ([function(f"{FUNCTIONS}:missing")], "has no attribute 'missing': name a function"),
    "not callable": ([function(f"{FUNCTIONS}:NOT_CALLABLE")], "'NOT_CALLABLE' is a int, not callable: name a function"),
    "duplicate names": ([RewardSpec(kind=RewardKind.think_format), RewardSpec(kind=RewardKind.regex, pattern="x"),
                         RewardSpec(kind=RewardKind.regex, pattern="y")],
                        "rl.rewards[2]: name 'regex' is rl.rewards[1]'s too: give one of them its own name"),
    "duplicate function name": ([function(f"{FUNCTIONS}:flags"), RewardSpec(kind=RewardKind.regex, pattern="y",
                                                                             name="flags")],
                                "name 'flags' is rl.rewards[0]'s too"),
    "weight nan": ([RewardSpec(weight=math.nan)], "is not a finite number: set weight"),
}


def one_line(error: pytest.ExceptionInfo[BadReward]) -> str:
    message = str(error.value)
    assert "\n" not in message and message.startswith("rl.rewards")
    return message


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_declaration_is_refused_with_the_fix(case: str) -> None:
    specs, fix = REFUSED[case]
    with pytest.raises(BadReward) as error:
        build_rewards(specs, max_completion_length=10)
    assert fix in one_line(error)


RETURNS = "a reward function returns a list of floats (None to skip)"
REFUSED_RETURNS = {
    "text_at_three": f"rl.rewards[0] (text_at_three): returned 'abc' for completion 3, not a number: {RETURNS}",
    "one_short": f"rl.rewards[0] (one_short): returned 3 values for 4 completions: {RETURNS}, one per completion",
    "a_dict": f"rl.rewards[0] (a_dict): returned {{'score': 1.0}}, not a list: {RETURNS}",
}


@pytest.mark.parametrize("name", REFUSED_RETURNS)
def test_a_bad_return_is_refused_with_the_fix(name: str) -> None:
    rewards = build_rewards([function(f"{FUNCTIONS}:{name}")], 10)
    with pytest.raises(BadReward) as error:
        score_all(rewards, batch())
    assert one_line(error).startswith(REFUSED_RETURNS[name])


def test_a_missing_answer_column_names_the_columns() -> None:
    rewards = build_rewards([RewardSpec(column="solution", name="correct")], 10)
    with pytest.raises(BadReward) as error:
        score_all(rewards, batch())
    assert one_line(error) == ("rl.rewards[0] (correct): the rows have no column 'solution' (they have: answer, "
                               "level): set column to the one holding the right answer")


def test_a_column_named_as_an_argument_is_refused() -> None:
    rewards = build_rewards([function(f"{FUNCTIONS}:flags")], 10)
    inputs = batch()
    clashing = RewardInputs(inputs.prompts, inputs.completions, inputs.completion_ids,
                            {**inputs.columns, "completions": list(inputs.completions)})
    with pytest.raises(BadReward) as error:
        score_all(rewards, clashing)
    assert "column 'completions' has the name of an argument" in one_line(error)
    assert "rename the column" in str(error.value)
