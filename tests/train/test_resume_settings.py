"""What a resume may change: every setting of the spec decided, operational ones accepted
and printed, bookkeeping neither refused nor printed, the math refused; and what
resume=PATH must name."""

from __future__ import annotations

import itertools
import subprocess

import pytest

from runner.config.spec import RunSpec, flat_spec_dict
from runner.train.resume import BOOKKEEPING, HARMLESS, LAYOUT_KEYS, MATH, compare

CLASSES = {"MATH": MATH, "HARMLESS": HARMLESS, "BOOKKEEPING": BOOKKEEPING, "LAYOUT_KEYS": LAYOUT_KEYS}


def test_every_setting_of_the_spec_is_decided_exactly_once():
    """A field added to the spec fails here until it is put in one of the sets."""
    keys = set(flat_spec_dict(RunSpec()))
    decided = set().union(*CLASSES.values())
    assert sorted(keys - decided) == [], "undecided: add each to MATH, HARMLESS or BOOKKEEPING in runner/train/resume.py"
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
