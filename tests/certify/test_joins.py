"""`runner certify --joins`' covering array and its invariants, without a run: every pair of
factor values that can meet meets; a new value joins every pair by itself; each cell's
legs compose and validate to what it says; the checks read what the legs log."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from runner.certify import joins, pairwise
from runner.certify.joins import FACTORS, Join, applies


def test_the_array_covers_every_pair_that_can_meet_in_tens_of_cells():
    cells = joins.cells()
    assert all(applies(cell) for cell in cells)
    assert pairwise.uncovered_pairs(cells, FACTORS, applies) == set()
    combinations = len(pairwise.candidates(FACTORS, applies))
    assert 12 <= len(cells) <= 30 and combinations > 25 * len(cells), (len(cells), combinations)
    assert cells == joins.cells()  # the same array every time: the docs' table names its cells


def test_a_pair_that_cannot_meet_is_not_asked_for():
    required = pairwise.required_pairs(FACTORS, applies)
    assert (("peft", "none"), ("reference", "adapter_off")) not in required
    assert (("objective", "causal_lm"), ("packing", "on")) not in required
    assert (("objective", "sft"), ("reference", "frozen")) not in required
    assert (("objective", "dpo"), ("reference", "frozen")) in required


def test_a_new_value_of_a_factor_joins_every_pair():
    """The next objective (say RLOO) meets every value of every other factor; and online RL
    (grpo), which joined as such a value, meets every one that applies to it (its rows are
    its generations: never packed; its layouts are held in fp32: joins.applies says why)."""
    grown = {**FACTORS, "objective": (*FACTORS["objective"], "rloo")}
    cells = pairwise.covering_array(grown, applies)
    for name, values in grown.items():
        if name in ("objective", "reference"):
            continue
        for value in values:
            assert any(c["objective"] == "rloo" and c[name] == value for c in cells), (name, value)
    for name, values in FACTORS.items():
        for value in values:
            if name in ("objective", "reference") or (name, value) in (("packing", "on"), ("precision", "bf16")):
                continue
            assert any(c["objective"] == "grpo" and c[name] == value for c in joins.cells()), (name, value)


def test_a_small_array_is_the_classic_one():
    """Three two-valued factors: four cells hold all twelve pairs (of the eight combinations)."""
    factors = {"a": ("0", "1"), "b": ("0", "1"), "c": ("0", "1")}
    cells = pairwise.covering_array(factors, lambda cell: all(v is not None for v in cell.values()))
    assert len(cells) == 4
    held = set().union(*(pairwise.pairs_of(c) for c in cells))
    assert held == {((x, u), (y, v)) for x, y in itertools.combinations("abc", 2) for u in "01" for v in "01"}


def test_every_cells_legs_compose_and_validate_to_what_the_cell_says(tmp_path):
    from runner.config.spec import ObjectiveKind, PeftKind, PrecisionKind, StrategyKind
    from runner.config.validate import spec_problems

    joins.write_sources(tmp_path / "sources")
    for values in joins.cells():
        join = Join(values, tmp_path / "cell")
        for which in ("one", "two", "moved"):
            spec = joins.leg_spec(join, tmp_path / "model", tmp_path / "sources", which, tmp_path / "cache")
            world = 2 if which == "two" else 1
            assert spec_problems(spec, world_size=world) == [], (join.name, which)
            assert spec.precision.kind is PrecisionKind(values["precision"])
            assert spec.peft.kind is PeftKind(values["peft"])
            assert (spec.train.objective is ObjectiveKind.dpo) == (values["objective"] == "dpo")
            assert bool(spec.data.mixture) == (values["data"] == "mixture")
            assert spec.data.packing == (values["packing"] == "on")
            if values["reference"] is not None:
                assert spec.preference.reference.value == values["reference"]
            expected = StrategyKind(values["strategy"]) if which == "two" else StrategyKind.ddp
            assert spec.strategy.kind is expected
        assert spec.resume and spec.resume.endswith("step_7") and spec.train.log_every == joins.RESUME_LOG_EVERY


def _write_legs(cell: Path, one: list[float], two: list[float], moved: dict[int, float],
                train_loss: tuple[float, float]) -> None:
    for leg, losses in (("one", one), ("two", two)):
        (cell / leg).mkdir(parents=True)
        (cell / leg / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "loss": v, "grad_norm": 1.0}) + "\n" for i, v in enumerate(losses, 1)))
    (cell / "moved").mkdir()
    (cell / "moved" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": v, "grad_norm": 1.0}) + "\n" for s, v in moved.items()))
    for leg, value in zip(("one", "moved"), train_loss):
        (cell / leg / "all_results.json").write_text(json.dumps({"train_loss": value}))


def test_the_resumed_windows_are_held_to_the_mean_of_their_steps(tmp_path):
    values = next(cell for cell in joins.cells() if cell["objective"] == "causal_lm")
    losses = [10.0 - 0.1 * i for i in range(12)]
    join = Join({**values, "precision": "fp32"}, tmp_path)
    mean = sum(losses) / 12
    _write_legs(tmp_path, losses, losses, {9: sum(losses[7:9]) / 2, 12: sum(losses[9:12]) / 3}, (mean, mean))
    assert joins.layout_problems(join) == [] and joins.resume_problems(join) == []
    weighted = (2 * losses[9] / 2 + losses[10] + losses[11]) / 3  # any other weighting than the steps' mean
    (tmp_path / "moved" / "metrics.jsonl").write_text(
        json.dumps({"step": 9, "loss": sum(losses[7:9]) / 2, "grad_norm": 1.0}) + "\n"
        + json.dumps({"step": 12, "loss": weighted + 0.01, "grad_norm": 1.0}) + "\n")
    assert any("resumed window 10-12" in p for p in joins.resume_problems(join))


def test_the_table_lists_a_refused_cell_and_the_pairs_only_it_held(tmp_path):
    cells = [Join(values, tmp_path / str(i), "exact") for i, values in enumerate(joins.cells())]
    cells[1].verdict, cells[1].detail = "refused", ["data.packing=true cannot work here: one line"]
    text = joins.render(cells, "runner certify --joins")
    assert f"| 2 | {' | '.join(v or '-' for v in cells[1].values.values())} | refused |" in text
    assert "- 2 (" in text and "refused: data.packing=true cannot work here" in text
    assert "pairs no passing cell holds:" in text


@pytest.mark.parametrize("reference", ["precomputed", "frozen", "adapter_off"])
def test_dpo_cells_read_their_reference_mode(tmp_path, reference):
    values = {**{n: v[0] for n, v in FACTORS.items()}, "objective": "dpo", "peft": "lora", "reference": reference}
    assert f"preference.reference={reference}" in joins.data_overrides(values, tmp_path)
