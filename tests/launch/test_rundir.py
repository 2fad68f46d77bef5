"""The run folder: results are never overwritten unless overwrite=true, or continued in place."""

import pytest

from runner.config.errors import UserError
from runner.launch.rundir import continues_in_place, prepare_run_dir


def finished_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_4").mkdir(parents=True)
    (run_dir / "all_results.json").write_text('{"train_loss": 3.2}')
    (run_dir / "notes.txt").write_text("mine")
    return run_dir


def test_a_folder_with_results_is_refused_naming_both_ways_out(tmp_path):
    run_dir = finished_run(tmp_path)
    with pytest.raises(UserError, match=r"already holds results \(all_results.json, checkpoints\); resume=auto found.*"
                                        r"hydra.run.dir=PATH.*overwrite=true"):
        prepare_run_dir(run_dir, overwrite=False, why="; resume=auto found no checkpoint in it to continue from")
    assert (run_dir / "all_results.json").read_text() == '{"train_loss": 3.2}'


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    run_dir = finished_run(tmp_path)
    prepare_run_dir(run_dir, overwrite=True)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_continuing_in_place_keeps_everything(tmp_path):
    run_dir = finished_run(tmp_path)
    prepare_run_dir(run_dir, overwrite=False, continuing=True)
    assert (run_dir / "all_results.json").exists() and (run_dir / "checkpoints" / "step_4").is_dir()


def test_only_a_checkpoint_of_this_folder_continues_in_place(tmp_path):
    run_dir = finished_run(tmp_path)
    assert continues_in_place(run_dir, run_dir / "checkpoints" / "step_4")
    assert not continues_in_place(run_dir, tmp_path / "other" / "checkpoints" / "step_4")
    assert not continues_in_place(run_dir, None)
