"""The goodput ledger's arithmetic (runner/train/ledger.py): a restart in the same launch
carries the parts recorded at its checkpoint (or, before the first, at the dead attempt's
loop start) and counts the time since as lost; a resume in a new launch starts afresh;
Young/Daly's interval. A worker killed under launch.max_restarts, end to end:
tests/launch/test_launcher.py and tests/train/test_checkpoint_multiprocess.py."""

from __future__ import annotations

import math

import pytest

from runner.train import ledger as ledger_module
from runner.train.ledger import RESTART_COUNT_ENV, Ledger, report, resumed, suggested_interval, write_snapshot


def test_a_first_attempt_counts_the_time_before_its_loop_as_startup():
    ledger = Ledger(launch=100.0)
    assert ledger.begin(112.5, step=0) == "startup" and ledger.parts["startup"] == 12.5


def test_a_restart_in_the_same_launch_carries_the_parts_and_counts_the_rest_as_lost(tmp_path):
    before = Ledger(launch=100.0)
    before.begin(110.0, step=0)
    before.add("steps", 30.0)
    before.add_save(2.0)
    write_snapshot(tmp_path, before, step=8)
    saved_at = resumed(tmp_path, 100.0, 8).resumed_at
    assert saved_at is not None

    after = resumed(tmp_path, 100.0, 8)
    assert after.parts["steps"] == 30.0 and after.parts["startup"] == 10.0 and after.saves == 1
    assert after.begin(saved_at + 7.0, step=8) == "lost_to_restarts" and after.first_step == 0
    assert after.parts["lost_to_restarts"] == pytest.approx(7.0)
    assert after.parts["startup"] == 10.0  # the restart's own start-up is part of what it lost

    assert resumed(tmp_path, 999.0, 8).parts["steps"] == 0.0  # another launch: a ledger of its own
    assert resumed(tmp_path, 100.0, 4).parts["steps"] == 0.0  # not the checkpoint recorded
    assert resumed(tmp_path / "none", 100.0, 8).resumed_at is None


def test_a_restart_before_the_first_checkpoint_counts_the_time_since_the_dead_loop_began_as_lost(tmp_path,
                                                                                                   monkeypatch):
    """The first attempt records its ledger when its loop begins (step 0); it dies before
    any checkpoint. The restarted attempt starts from step 0 again: the first attempt's
    start-up is kept, and everything since its loop began is lost (booked as start-up,
    lost_to_restarts 0, before)."""
    first = Ledger(launch=100.0)
    assert first.begin(110.0, step=0) == "startup"
    write_snapshot(tmp_path, first, step=0)
    began = resumed(tmp_path, 100.0, 0).resumed_at
    assert began is not None and first.restarts == 0

    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    monkeypatch.setattr(ledger_module, "process_started", lambda: began + 20.0)
    after = resumed(tmp_path, 100.0, 0)
    assert after.restarts == 1 and after.parts["startup"] == 10.0
    assert after.begin(began + 30.0, step=0) == "lost_to_restarts" and after.first_step == 0
    assert after.parts["lost_to_restarts"] == pytest.approx(30.0) and after.parts["startup"] == 10.0
    assert report(after, wall=began + 30.0 - 100.0, last_step=0, save_every=0, mtbf_hours=None)["restarts"] == 1


def test_a_restart_after_an_attempt_that_never_reached_its_loop_loses_that_attempt(tmp_path, monkeypatch):
    """Nothing recorded in this launch (the dead attempt failed while setting up): the
    time before this attempt's process started is lost, its own start-up is start-up."""
    monkeypatch.setenv(RESTART_COUNT_ENV, "2")
    monkeypatch.setattr(ledger_module, "process_started", lambda: 130.0)
    ledger = resumed(tmp_path, 100.0, 0)
    assert ledger.restarts == 2 and ledger.resumed_at is None
    assert ledger.begin(142.0, step=0) == "startup"
    assert ledger.parts["lost_to_restarts"] == 30.0 and ledger.parts["startup"] == 12.0
    monkeypatch.setenv(RESTART_COUNT_ENV, "0")  # a first attempt: all of it is start-up
    first = resumed(tmp_path, 100.0, 0)
    assert first.restarts == 0 and first.begin(142.0, step=0) == "startup" and first.parts["startup"] == 42.0
    assert first.parts["lost_to_restarts"] == 0


def test_the_loops_steps_are_its_time_less_the_other_parts(tmp_path, monkeypatch):
    """The ledger keeps the loop's clock: what the loop spent waiting for data, evaluating or
    saving is booked to those parts, the rest of its time to steps, in a snapshot taken
    mid-loop as at its end; what is added after the loop is not taken from its steps."""
    clock = [50.0]
    monkeypatch.setattr(ledger_module.time, "perf_counter", lambda: clock[0])
    ledger = Ledger(launch=100.0)
    ledger.begin(110.0, step=0)
    assert ledger.start_loop() == 50.0
    clock[0] = 60.0
    ledger.add("data_wait", 1.5)
    ledger.add_save(2.5)
    write_snapshot(tmp_path, ledger, step=4)  # after the save: the steps so far recorded with it
    carried = resumed(tmp_path, 100.0, 4)
    assert carried.parts["steps"] == 6.0 and carried.parts["checkpoint_saves"] == 2.5 and carried.saves == 1
    assert ledger.parts["steps"] == 0.0  # the running ledger books its steps when the loop ends
    clock[0] = 70.0
    ledger.add("evaluation", 4.0)
    ledger.end_loop()
    assert ledger.parts["steps"] == 20.0 - 1.5 - 2.5 - 4.0
    ledger.add("checkpoint_saves", 3.0)  # model/ at the end, after the loop
    clock[0] = 90.0
    assert ledger.so_far().parts["steps"] == 12.0 and ledger.parts["checkpoint_saves"] == 5.5
    monkeypatch.setattr(ledger_module.time, "time", lambda: 130.0)
    out = ledger.results(last_step=8, save_every=4, mtbf_hours=None)  # the wall time: the launch's until now
    assert out["wall_seconds"] == 30.0 and out["parts_sum_seconds"] == 10.0 + 12.0 + 1.5 + 4.0 + 5.5
    assert out["goodput"] == round(12.0 / 30.0, 4)


def test_the_report_sums_the_parts_and_suggests_young_daly():
    ledger = Ledger(launch=0.0)
    ledger.parts.update(startup=5.0, steps=80.0, data_wait=1.0, evaluation=4.0, checkpoint_saves=10.0)
    ledger.saves, ledger.save_seconds = 5, 10.0
    out = report(ledger, wall=100.0, last_step=160, save_every=100, mtbf_hours=1.0)  # 80 s / 160 steps
    assert out["goodput"] == 0.8 and out["parts_sum_seconds"] == 100.0 and out["mean_save_seconds"] == 2.0
    interval = math.sqrt(2 * 2.0 * 3600)  # 120 s
    assert suggested_interval(2.0, 1.0) == pytest.approx(interval)
    assert out["suggested_save_every"] == 240 and "train.save_every=100 is 0.42x that" in out["suggestion"]
    assert "suggestion" not in report(ledger, 100.0, 160, 100, mtbf_hours=None)


def test_rays_start_up_is_a_part_of_its_own_in_ray_launches_only(tmp_path, monkeypatch):
    """launch.engine=ray hands the first attempt its start-up (runner/launch/ray_engine.py):
    booked apart, out of startup; a restart's is lost time; other launches have no such part."""
    monkeypatch.delenv(ledger_module.ENGINE_STARTUP_ENV, raising=False)
    monkeypatch.delenv(ledger_module.ATTEMPT_ENV, raising=False)
    monkeypatch.delenv(RESTART_COUNT_ENV, raising=False)
    assert "ray_startup" not in resumed(tmp_path, 100.0, 0).parts
    monkeypatch.setenv(ledger_module.ENGINE_STARTUP_ENV, "7.5")
    first = resumed(tmp_path, 100.0, 0)
    first.begin(120.0, step=0)
    assert first.parts["ray_startup"] == 7.5 and first.parts["startup"] == 12.5  # 20 s in all
    write_snapshot(tmp_path, first, step=0)
    monkeypatch.setenv(ledger_module.ATTEMPT_ENV, "1")  # Ray restarted the group
    monkeypatch.setattr(ledger_module, "process_started", lambda: 130.0)
    again = resumed(tmp_path, 100.0, 0)
    assert again.restarts == 1 and again.parts["ray_startup"] == 7.5  # carried over, not booked twice
    assert sum(report(first, 20.0, 0, 0, None)["parts_seconds"].values()) == pytest.approx(20.0)
