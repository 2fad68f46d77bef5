"""The per-step comparison that equivalence tests and strategy sweeps rely on."""

from __future__ import annotations

import json

from runner.report.parity import parity_problems, step_records


def records(*rows):
    return {step: {"loss": loss, "grad_norm": norm} for step, loss, norm in rows}


def test_equal_math_within_the_tolerances_passes():
    a = records((1, 10.0, 2.0), (2, 9.0, 1.5))
    b = records((1, 10.00005, 2.0015), (2, 9.0, 1.5))
    assert parity_problems(a, b) == []


def test_a_gradient_off_by_a_factor_is_named_even_when_losses_agree():
    a, b = records((1, 10.0, 2.0)), records((1, 10.0, 4.0))
    [problem] = parity_problems(a, b)
    assert "step 1: grad_norm 2 vs 4" in problem and "100.00% apart" in problem


def test_loss_gaps_missing_steps_and_missing_norms_are_named():
    a = records((1, 10.0, 2.0), (2, 9.0, 1.5))
    b = records((1, 10.001, None))
    problems = parity_problems(a, b)
    assert any("logged steps differ" in p for p in problems)
    assert any("step 1: loss 10.0 vs 10.001" in p for p in problems)
    assert any("grad_norm missing" in p for p in problems)


def test_step_records_reads_training_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 3.0, "grad_norm": 1.0}, {"step": 1, "eval_loss": 2.0}, {"step": 2, "loss": 2.5}]) + "\n")
    assert step_records(path) == {1: {"loss": 3.0, "grad_norm": 1.0}, 2: {"loss": 2.5, "grad_norm": None}}
