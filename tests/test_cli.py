"""Bad input through the real entry point: one clear message, exit 2, nothing written."""

import os
import subprocess
import sys

import pytest

from runner.cli import main


def run_main(capsys, *args):
    with pytest.raises(SystemExit) as info:
        main(list(args))
    return info.value.code, capsys.readouterr().err


def assert_refused(capsys, tmp_path, *args, expect):
    run_dir = tmp_path / "run"
    code, err = run_main(capsys, "recipe=gpt2_clm_tiny", f"hydra.run.dir={run_dir}", *args)
    assert code == 2, err
    assert "Traceback" not in err
    for text in ([expect] if isinstance(expect, str) else expect):
        assert text in err, err
    assert not run_dir.exists()  # no worker started, nothing frozen, not even the empty folder Hydra made
    return err


def test_unknown_key(capsys, tmp_path):
    assert_refused(capsys, tmp_path, "train.batch_size=4", expect=["unknown key 'train.batch_size'", "Did you mean", "per_device_batch_size"])


def test_wrong_type(capsys, tmp_path):
    assert_refused(capsys, tmp_path, "train.grad_accum_steps=two", expect="bad value for 'train.grad_accum_steps'")


def test_unknown_recipe_lists_the_available_ones(capsys, tmp_path):
    code, err = run_main(capsys, "recipe=gpt2_typo", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "gpt2_clm_tiny" in err and "Traceback" not in err


def test_missing_data_file(capsys, tmp_path):
    assert_refused(capsys, tmp_path, f"data.train_file={tmp_path}/missing.txt", expect="no such file")


def test_empty_data_file(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert_refused(capsys, tmp_path, f"data.train_file={tmp_path}/empty.txt", expect="is empty")


def test_malformed_json_line(capsys, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    assert_refused(capsys, tmp_path, f"data.train_file={tmp_path}/d.jsonl", expect="d.jsonl:2: malformed JSON")


def test_missing_text_column(capsys, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "a"}\n')
    assert_refused(capsys, tmp_path, f"data.train_file={tmp_path}/d.jsonl", "data.text_column=text", expect="no column 'text'")


def test_block_size_too_large(capsys, tmp_path):
    assert_refused(capsys, tmp_path, "data.block_size=4096", expect=["data.block_size=4096", "128 positions"])


def test_fp16_on_cpu_names_bf16(capsys, tmp_path):
    assert_refused(capsys, tmp_path, "precision=fp16", expect="precision=bf16")


def test_zero_without_deepspeed_names_the_extra(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert_refused(capsys, tmp_path, "strategy=zero3", expect="runner[deepspeed]")


def test_every_problem_at_once(capsys, tmp_path):
    err = assert_refused(
        capsys, tmp_path, "train.per_device_batch_size=0", "optim.lr=-1", "data.block_size=4096",
        expect=["3 problems", "train.per_device_batch_size=0", "optim.lr=-1", "data.block_size=4096"],
    )
    assert err.count("\n  - ") == 3


def test_a_refused_run_removes_the_folders_it_made_and_only_those(capsys, tmp_path, monkeypatch):
    """Hydra creates hydra.run.dir before the run is checked: refused, it would leave an
    empty outputs/<name>/<time>_<hash> behind each time. A folder that was there stays."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(capsys, "recipe=gpt2_clm_tiny", "train.per_device_batch_size=0")
    assert code == 2 and "train.per_device_batch_size=0" in err
    assert not (tmp_path / "outputs").exists()  # the default folder and its parents, all made by this run
    (tmp_path / "mine" / "empty").mkdir(parents=True)
    for run_dir in ("mine/new/run", "mine/empty"):
        code, err = run_main(capsys, "recipe=gpt2_clm_tiny", "train.per_device_batch_size=0", f"hydra.run.dir={run_dir}")
        assert code == 2
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["empty"]  # there before: kept, though empty


def test_auto_micro_batch_with_an_accumulation_names_the_conflict_truly(capsys, tmp_path):
    """The accumulation was checked against the placeholder micro-batch of 1 ('needs 32')."""
    err = assert_refused(capsys, tmp_path, "train.per_device_batch_size=auto", "train.global_batch_size=32",
                         "train.grad_accum_steps=4", expect="remove train.grad_accum_steps=4")
    assert "needs" not in err


def test_an_encoder_decoder_type_is_one_short_line(capsys, tmp_path):
    err = assert_refused(capsys, tmp_path, "model.model_type=t5", "model.config_overrides=null",
                         expect="model.model_type=t5 (an encoder-decoder) is not a causal LM")
    assert len(err) < 300 and "Config" not in err  # not transformers' list of every causal-LM config class


def test_resume_from_a_folder_that_does_not_exist_says_so(capsys, tmp_path):
    assert_refused(capsys, tmp_path, f"resume={tmp_path / 'nope'}",
                   expect=["no such folder", "checkpoints/step_N", "resume=auto with hydra.run.dir"])


def test_existing_results_folder_is_not_clobbered(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "all_results.json").write_text('{"keep": "me"}')
    (run_dir / "metrics.jsonl").write_text("precious\n")
    code, err = run_main(capsys, "recipe=gpt2_clm_tiny", f"hydra.run.dir={run_dir}")
    assert code == 2 and "already holds results" in err and "overwrite=true" in err
    assert (run_dir / "all_results.json").read_text() == '{"keep": "me"}'
    assert (run_dir / "metrics.jsonl").read_text() == "precious\n"
    assert not (run_dir / ".hydra").exists()


def test_spec_rerun_of_missing_file(capsys, tmp_path):
    code, err = run_main(capsys, "--spec", str(tmp_path / "nope.yaml"))
    assert code == 2 and "no such file" in err


@pytest.mark.e2e
def test_console_script_exit_code_and_no_traceback(tmp_path):
    """The installed `runner` command itself: one line, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "runner", "recipe=gpt2_clm_tiny", "optim.lr=fast", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True,
    )
    assert done.returncode == 2
    assert "bad value for 'optim.lr'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.e2e
def test_help_lists_groups(tmp_path):
    done = subprocess.run([sys.executable, "-m", "runner", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    for group in ("recipe:", "strategy:", "precision:", "gpt2_clm_tiny", "zero3", "bf16"):
        assert group in done.stdout


@pytest.mark.e2e
def test_cfg_job_prints_the_composed_config():
    done = subprocess.run([sys.executable, "-m", "runner", "recipe=gpt2_clm", "--cfg", "job"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "name_or_path: gpt2" in done.stdout and "wikitext-2-raw-v1" in done.stdout


def test_validation_split_that_leaves_no_eval_rows(capsys, tmp_path):
    (tmp_path / "few.txt").write_text("".join(f"Line {i} of a short file with enough words in it.\n" for i in range(10)))
    assert_refused(capsys, tmp_path, f"data.train_file={tmp_path}/few.txt", "data.validation_split_percentage=5",
                   expect="leaves no eval rows")


def test_corpus_shorter_than_one_block(capsys, tmp_path):
    (tmp_path / "tiny.txt").write_text("Too short.\n" * 3)
    assert_refused(capsys, tmp_path, f"data.train_file={tmp_path}/tiny.txt", "data.validation_split_percentage=50",
                   "data.block_size=64", expect="shorter than one block of 64 tokens")


def _failure(exitcode, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    # No error file: what torch elastic records for a worker killed by a signal.
    return ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file=str(tmp_path / "none.json"))


def test_a_worker_killed_by_sigabrt_is_explained_as_a_possible_nccl_timeout(tmp_path):
    from runner.launch.start import failure_reason

    reason = failure_reason(_failure(-6, tmp_path), timeout_minutes=45)
    assert reason.startswith("Signal 6 (SIGABRT)")
    for text in ("launch.timeout_minutes=45", "NCCL_DEBUG=INFO", "TORCH_NCCL_TRACE_BUFFER_SIZE", "launch.debug=true"):
        assert text in reason
    assert "\n" not in reason  # one message


def test_other_failures_keep_their_own_reason(tmp_path):
    from runner.launch.start import failure_reason

    reason = failure_reason(_failure(-9, tmp_path), timeout_minutes=30)
    assert reason.startswith("Signal 9 (SIGKILL)") and "NCCL" not in reason


@pytest.mark.multiprocess
def test_cli_fed_a_worker_that_aborts_names_the_timeout_and_nccl_variables(tmp_path):
    """Rank 1 dies of SIGABRT (exit -6), as under NCCL's watchdog: the launcher's one line says what to do."""
    import os

    from conftest import MICRO, patch_train_step

    env = patch_train_step(tmp_path, 'os.environ.get("RANK") == "1" and self.state.step >= 1', "os.abort()")
    done = subprocess.run(
        [sys.executable, "-m", "runner", *MICRO, "launch.nproc_per_node=2", "train.per_device_batch_size=4",
         "launch.timeout_minutes=7", "tracking=none", f"hydra.run.dir={tmp_path / 'abort'}"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    line = [ln for ln in done.stderr.splitlines() if ln.startswith("runner: worker rank 1 failed")]
    assert len(line) == 1, done.stderr[-3000:]
    assert "SIGABRT" in line[0] and "launch.timeout_minutes=7" in line[0] and "NCCL_DEBUG=INFO" in line[0]
    assert "TORCH_NCCL_" in line[0]
    # faulthandler's stack from the aborted rank (runner/launch/failure_notes.py), shown once above
    assert done.stderr.count("[rank 1] Fatal Python error: Aborted") == 1, done.stderr[-3000:]
    assert "in patched" in done.stderr.split("[rank 1] Fatal Python error: Aborted")[1]


# A process's last moments, seen from inside: an atexit handler (kept) and a finaliser
# that runs only when the interpreter tears its modules down (skipped by os._exit).
LAST_MOMENTS = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("ATEXIT\\n"))
class Teardown:
    def __del__(self):
        sys.stderr.write("TEARDOWN\\n")
sys.modules["runner_test_teardown"] = Teardown()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("args, code, says", [(["--help"], 0, None), (["recipe=gpt2_clm_tiny", "optim.lr=fast"], 2,
                                                                           "bad value for 'optim.lr'")])
def test_the_command_leaves_without_the_interpreters_teardown_but_after_its_exit_handlers(tmp_path, args, code, says):
    """`runner` ends through os._exit (runner/cli.py entry: unloading torch and
    transformers costs 2.6 CPU-s a process): its exit code, its output and atexit's
    handlers are kept, the module teardown is not."""
    (tmp_path / "sitecustomize.py").write_text(LAST_MOMENTS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "runner", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == code, done.stderr
    assert "ATEXIT" in done.stderr and "TEARDOWN" not in done.stderr, done.stderr
    assert (says or "recipe:") in (done.stderr if says else done.stdout)
