"""Which layout changes a resume may make: exact continuation or a named refusal."""

from __future__ import annotations

from runner.train.resume import compare, layout_change_problems

MARKER = {"samples_in_epoch": 32}


def test_an_equal_global_batch_in_another_layout_is_accepted(compose_spec):
    old = compose_spec("train.per_device_batch_size=4")
    new = compose_spec("train.per_device_batch_size=4", "train.grad_accum_steps=2")
    assert layout_change_problems(old, new, 2, 1, train_samples=64, marker=MARKER) == []
    assert compare(old, new, 2, 1, 64, MARKER) == ([], [])


def test_a_short_last_step_refuses_the_change_and_names_the_fix(compose_spec):
    old, new = compose_spec("train.per_device_batch_size=8"), compose_spec("train.per_device_batch_size=4", "train.grad_accum_steps=2")
    [problem] = layout_change_problems(old, new, 1, 1, train_samples=60, marker=MARKER)
    assert "1x8x1 -> 1x4x2" in problem and "60 training samples" in problem and "data.max_train_samples" in problem


def test_zero_world_size_and_old_checkpoints_are_refused(compose_spec):
    old = compose_spec("strategy=zero2", "train.per_device_batch_size=4")
    new = compose_spec("strategy=zero2", "train.per_device_batch_size=8")
    problems = layout_change_problems(old, new, 2, 1, train_samples=64, marker={"batches_in_epoch": 4})
    assert any("world size under zero2: 2 -> 1" in p for p in problems)
    assert any("predates sample-exact positions" in p for p in problems)


def test_a_position_between_micro_batches_is_refused(compose_spec):
    old, new = compose_spec("train.per_device_batch_size=2"), compose_spec("train.per_device_batch_size=8")
    [problem] = layout_change_problems(old, new, 4, 1, train_samples=64, marker={"samples_in_epoch": 4})
    assert "not a whole number of this layout's micro-batches" in problem


def test_the_same_layout_needs_no_check(compose_spec):
    spec = compose_spec()
    assert layout_change_problems(spec, spec, 1, 1, train_samples=61, marker={}) == []
