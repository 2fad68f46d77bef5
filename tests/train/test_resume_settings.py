"""What a resume may change: every setting of the spec decided, operational ones accepted
and printed, bookkeeping neither refused nor printed, the math refused; and what
resume=PATH must name."""

from __future__ import annotations

import itertools
import math
import subprocess

import pytest

from runner.config.spec import RunSpec, flat_spec_dict
from runner.train.resume import compare, schedule_note
from runner.train.resume_settings import BOOKKEEPING, HARMLESS, HORIZON, LAYOUT_KEYS, MATH

CLASSES = {"MATH": MATH, "HORIZON": HORIZON, "HARMLESS": HARMLESS, "BOOKKEEPING": BOOKKEEPING, "LAYOUT_KEYS": LAYOUT_KEYS}


def test_every_setting_of_the_spec_is_decided_exactly_once():
    """A field added to the spec fails here until it is put in one of the sets."""
    keys = set(flat_spec_dict(RunSpec()))
    decided = set().union(*CLASSES.values())
    assert sorted(keys - decided) == [], "undecided: add each to MATH, HORIZON, HARMLESS or BOOKKEEPING in runner/train/resume_settings.py"
    assert sorted(decided - keys) == [], "no longer in the spec"
    for (a, first), (b, second) in itertools.combinations(CLASSES.items(), 2):
        assert not first & second, f"in both {a} and {b}: {sorted(first & second)}"


def test_operational_settings_are_accepted_and_printed(compose_spec):
    """The process-group timeout the docs say to raise for a slow step, where metrics go,
    debug logs, host memory, compiled kernels, FSDP's re-gathering: none changes the math."""
    old = compose_spec("strategy=fsdp")
    new = compose_spec("strategy=fsdp", "launch.timeout_minutes=90", "tracking=none", "launch.debug=true",
                       "launch.retain_freed_memory=false", "model.compile=true", "strategy.reshard_after_forward=false")
    breaking, harmless = compare(old, new, 2, 2)
    assert breaking == []
    assert harmless == [
        "launch.debug: False -> True",
        "launch.retain_freed_memory: True -> False",
        "launch.timeout_minutes: 30.0 -> 90.0",
        "model.compile: False -> True",
        "strategy.reshard_after_forward: True -> False",
        "tracking: 'tensorboard' -> 'none'",
    ]


def test_bookkeeping_is_neither_refused_nor_printed(compose_spec, tmp_path):
    """A resume into a new folder changes run_dir by design: not an 'accepted change'."""
    old = compose_spec()
    old.run_dir = str(tmp_path / "first")
    new = compose_spec("name=second", "overwrite=true", f"resume={tmp_path / 'first' / 'checkpoints' / 'step_4'}")
    new.run_dir = str(tmp_path / "second")
    assert compare(old, new, 1, 1) == ([], [])


def test_what_changes_the_math_is_still_refused(compose_spec):
    old = compose_spec()
    new = compose_spec("optim.lr=1e-3", "optim.fused=false", "precision=bf16", "train.seed=7")
    breaking, harmless = compare(old, new, 1, 1)
    assert breaking == ["optim.fused: True -> False", "optim.lr: 5e-05 -> 0.001", "precision.kind: 'fp32' -> 'bf16'",
                        "train.seed: 42 -> 7"]
    assert harmless == []


def test_every_setting_that_feeds_the_schedule_is_decided(compose_spec):
    """The horizon (max_steps; num_epochs, which sets it while max_steps is null) is
    accepted and re-plans the schedule; its shape and peak (kind, warmup, lr and its batch
    scaling) are refused. There is no minimum-lr setting: the schedules decay to 0."""
    feeds = {k for k in flat_spec_dict(RunSpec()) if k.startswith("schedule.")} | {
        "optim.lr", "optim.scale_lr", "optim.reference_global_batch", "train.max_steps", "train.num_epochs"}
    assert {k for k in feeds if k in HORIZON} == {"train.max_steps", "train.num_epochs"}
    assert feeds - HORIZON <= MATH
    old = compose_spec("schedule=cosine", "train.max_steps=4")
    assert compare(old, compose_spec("schedule=cosine", "train.max_steps=8"), 1, 1) == ([], ["train.max_steps: 4 -> 8"])
    breaking, _ = compare(old, compose_spec("schedule=linear", "schedule.warmup_ratio=0.25", "train.max_steps=8"), 1, 1)
    assert breaking == ["schedule.kind: 'cosine' -> 'linear'", "schedule.warmup_ratio: 0.0 -> 0.25"]


def test_a_new_horizon_says_how_the_rate_moves(compose_spec):
    """Cosine at lr 1e-3 over 4 steps, raised to 8 at step 4: the old plan's next rate was
    0; the new plan's is 1e-3 x (1 + cos(pi x 4/8)) / 2 at step 5, falling to
    1e-3 x (1 + cos(pi x 7/8)) / 2 at step 8 (transformers' cosine, step k trains at k-1)."""
    spec = compose_spec("schedule=cosine", "optim.lr=1e-3", "schedule.warmup_steps=0", "train.max_steps=8")
    note = schedule_note(spec, 4, 8, 4, batch=8)
    first, last = 1e-3 * (1 + math.cos(math.pi * 4 / 8)) / 2, 1e-3 * (1 + math.cos(math.pi * 7 / 8)) / 2
    assert note == ("resume: the cosine schedule is planned again over 8 steps (was 4; 0 warmup steps): step 5 trains "
                    f"at lr {first:.4g}, where the old plan had 0, and the rate follows the new plan to {last:.4g} at step 8")
    ratio = compose_spec("schedule=linear", "optim.lr=1e-3", "schedule.warmup_ratio=0.5", "train.max_steps=8")
    # linear, its warmup 2 -> 4 steps: step 3 would train at the peak 1e-3; re-planned, 2 of its 4 warmup steps up
    assert schedule_note(ratio, 4, 8, 2, batch=8).startswith(
        "resume: the linear schedule is planned again over 8 steps (was 4; 4 warmup steps (were 2)): step 3 trains at "
        "lr 0.0005, where the old plan had 0.001,")
    constant = compose_spec("schedule=constant", "schedule.warmup_steps=2", "train.max_steps=8")
    assert schedule_note(constant, 4, 8, 4, batch=8) is None  # no rate moves
    assert schedule_note(spec, 4, 4, 4, batch=8) is None and schedule_note(spec, 8, 4, 4, batch=8) is None  # no step left


@pytest.mark.e2e
def test_a_resume_into_a_new_folder_with_a_longer_timeout_prints_that_change_only(tmp_path):
    """Through the CLI: the timeout is accepted and said, the new folder is not."""
    from runs import cmd

    first, second = tmp_path / "first", tmp_path / "second"
    done = subprocess.run(cmd(first, "train.max_steps=4"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = subprocess.run(cmd(second, "train.max_steps=6", "launch.timeout_minutes=60", "tracking=none",
                                 f"resume={first / 'checkpoints' / 'step_4'}"),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    accepted = sorted(line for line in resumed.stderr.splitlines() if "accepted change" in line)
    assert accepted == ["runner: resume: accepted change launch.timeout_minutes: 30.0 -> 60.0",
                        "runner: resume: accepted change tracking: 'tensorboard' -> 'none'",
                        "runner: resume: accepted change train.max_steps: 4 -> 6"]
    assert (second / "all_results.json").is_file()


def test_resume_of_a_run_folder_names_its_newest_checkpoint_and_resume_auto(compose_spec, tmp_path):
    """resume= a run folder (or its checkpoints/) is not a checkpoint: say which to pass."""
    import json

    from runner.config.errors import UserError
    from runner.train.checkpoint import COMPLETE_MARKER
    from runner.train.resume import resolve

    run_dir = tmp_path / "run"
    for step in (4, 8):
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step}" / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
    for given in (run_dir, run_dir / "checkpoints"):
        with pytest.raises(UserError) as err:
            resolve(compose_spec(f"resume={given}"), tmp_path / "new")
        assert str(err.value) == (f"resume={given} is a run folder, not a checkpoint: pass resume={run_dir}/checkpoints/"
                                  f"step_8 (its newest), or continue the run with resume=auto hydra.run.dir={run_dir}.")
    (run_dir / "checkpoints" / ".tmp_step_12").mkdir()
    with pytest.raises(UserError, match="not a complete checkpoint .no COMPLETE.json in it: an interrupted save"):
        resolve(compose_spec(f"resume={run_dir / 'checkpoints' / '.tmp_step_12'}"), tmp_path / "new")
