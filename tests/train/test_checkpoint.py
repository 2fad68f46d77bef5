"""Checkpoints that survive anything: kill -9, SIGTERM, a crash mid-save, NaNs, edits.

Runs go through the CLI in this process (runs.run_cli: what `python -m runner` prints and
exits with, without a fresh interpreter's imports); a run that is killed or signalled
gets a process of its own."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runs import Ran, cmd, logged_steps, losses, resume_cmd, run_cli
from runner.train.checkpoint import COMPLETE_MARKER, complete_checkpoints

def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared:\n{proc.stderr.read() if proc.stderr else ''}"
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


def kill_9_after_checkpoint(command: list[str], run_dir: Path, step: int = 8) -> None:
    """Start a run and SIGKILL it, with any workers it spawned, once checkpoint `step` is complete."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(run_dir / "checkpoints" / f"step_{step}" / COMPLETE_MARKER, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to save anything
    proc.wait()


def kill_9_at_step(command: list[str], run_dir: Path, step: int, timeout: float = 300) -> None:
    """Start a run and SIGKILL it once it has logged `step`: between checkpoints, not at one."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + timeout
    while not any(s >= step for s in logged_steps(run_dir)):
        assert proc.poll() is None, f"the run ended before step {step}:\n{proc.stderr.read() if proc.stderr else ''}"
        assert time.time() < deadline, f"timed out waiting for step {step}"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def sigterm_after_first_log(command: list[str], run_dir: Path, timeout: int) -> tuple[int, str]:
    """Start a run, SIGTERM it once it has logged a step; (exit code, stderr)."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(run_dir / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def resume_ok(run_dir: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`--resume auto` in a process of its own: a launch of several processes (the
    launcher's forkserver would otherwise outlive the test in pytest's process)."""
    done = subprocess.run(resume_cmd(run_dir), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def resumed_here(run_dir: Path) -> Ran:
    """`--resume auto` of a 1-process run, in this process (runs.run_cli)."""
    done = run_cli(resume_cmd(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("full") / "run"
    done = run_cli(cmd(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_20", "step_24"]  # keep_checkpoints=2
    return losses(run_dir)


@pytest.fixture(scope="module")
def finished_4(tmp_path_factory) -> Path:
    """A finished 4-step run, trained once: each test that refuses or continues it takes a copy."""
    run_dir = tmp_path_factory.mktemp("finished_4") / "run"
    done = run_cli(cmd(run_dir, "train.max_steps=4"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    """The run in a folder of this test's own; nothing in it names its folder (run_spec.yaml's
    run_dir is bookkeeping a resume ignores), and copy2 keeps every file's bytes and times."""
    return Path(shutil.copytree(run_dir, tmp_path / "run", symlinks=True))


@pytest.mark.e2e
def test_kill_9_then_resume_auto_is_bit_exact(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    kill_9_after_checkpoint(cmd(run_dir), run_dir)
    done = resumed_here(run_dir)
    assert "resuming from" in done.stderr
    assert losses(run_dir) == uninterrupted  # every step, bit for bit, dropout on


@pytest.mark.e2e
def test_kill_9_between_checkpoints_inside_a_log_window_is_bit_exact(tmp_path):
    """Logged every 3 steps, saved every 4: the step-8 checkpoint falls inside the 7-9
    window, and the kill lands after step 10, two steps past the checkpoint."""
    full = tmp_path / "full"
    done = run_cli(cmd(full, "train.log_every=3"))
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    kill_9_at_step(cmd(run_dir, "train.log_every=3"), run_dir, step=9)  # logged 9, checkpoint 8 complete
    resumed_here(run_dir)
    assert losses(run_dir) == losses(full)
    assert sorted(losses(run_dir)) == list(range(3, 25, 3))
    resumed, reference = (json.loads((d / "all_results.json").read_text()) for d in (run_dir, full))
    for key in ("train_loss", "eval_loss", "perplexity", "eval_accuracy"):
        assert resumed[key] == reference[key], key


@pytest.mark.e2e
def test_numbers_do_not_depend_on_what_setup_drew(tmp_path, monkeypatch):
    """Setup before training (the peak FLOP/s probe, libraries) may draw from the global
    RNG or not: dropout's stream must not change. One run's probe draws 1,000 numbers
    from torch's global generator first, the other's draws none."""
    import runner.report.flops as flops

    seen = []
    for name, draws in (("quiet", 0), ("drawing", 1000)):
        def probe(*args, draws=draws, **kwargs):
            torch.randn(draws)
            return 1e9

        monkeypatch.setattr(flops, "_probe", probe)
        monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / name / "cache"))
        done = run_cli(cmd(tmp_path / name, "train.max_steps=8", "train.save_every=0"))
        assert done.returncode == 0, done.stderr[-3000:]
        seen.append(json.loads((tmp_path / name / "cache" / "peak_flops.json").read_text()))
    assert [list(s.values()) for s in seen] == [[1e9], [1e9]]  # both injected probes ran
    assert losses(tmp_path / "drawing") == losses(tmp_path / "quiet")


# The trainer reads a clock that advances exactly one second per optimizer step and not
# otherwise: every rate the run reports is then a number known in advance (a step per
# second), never a timing.
ONE_SECOND_PER_STEP = (
    "import time, types\n"
    "import runner.train.trainer as trainer\n"
    "clock = [0.0]\n"
    "trainer.time = types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time)\n"
    "original = trainer.Trainer.train_step\n"
    "def patched(self, batch):\n"
    "    stepped = original(self, batch)\n"
    "    clock[0] += 1.0 if stepped else 0.0\n"
    "    return stepped\n"
    "trainer.Trainer.train_step = patched\n"
)


def one_second_per_step(tmp_path: Path) -> dict[str, str]:
    """Environment whose started workers run with ONE_SECOND_PER_STEP (a sitecustomize.py)."""
    inject = tmp_path / "clock"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(ONE_SECOND_PER_STEP)
    return {**os.environ, "PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def one_second_per_step_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONE_SECOND_PER_STEP in this process, undone after the test."""
    import runner.train.trainer as trainer

    monkeypatch.setattr(trainer, "time", trainer.time)
    monkeypatch.setattr(trainer.Trainer, "train_step", trainer.Trainer.train_step)
    exec(ONE_SECOND_PER_STEP, {})


@pytest.mark.e2e
def test_rates_after_a_resume_count_only_this_process(tmp_path, monkeypatch):
    """Killed after the step-10 checkpoint, inside the 9-12 logging window: the resumed
    process ran 14 steps in 14 (clock) seconds, and its first window 2 steps in 2."""
    env, cadence = one_second_per_step(tmp_path), ["train.save_every=5", "train.log_every=4"]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(cmd(run_dir, *cadence), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    wait_for(run_dir / "checkpoints" / "step_10" / COMPLETE_MARKER, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    one_second_per_step_here(monkeypatch)
    done = run_cli(resume_cmd(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "all_results.json").read_text())
    batch, block = 4, 32
    assert results["resumed_from_step"] == 10 and results["train_steps"] == 24 and results["train_runtime"] == 14.0
    assert results["train_steps_per_second"] == 1.0
    assert results["train_samples_per_second"] == batch
    assert results["train_tokens_per_second"] == batch * block
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = {r["step"]: r["tokens_per_s"] for r in rows if "loss" in r and r["step"] > 10}
    assert after == {12: batch * block, 16: batch * block, 20: batch * block, 24: batch * block}


@pytest.mark.e2e
def test_resume_auto_on_a_finished_run_changes_nothing_and_more_steps_continue_it(finished_4, tmp_path):
    """A Slurm script that always passes resume=auto, requeued after the run ended."""
    run_dir = copy_of(finished_4, tmp_path)

    def contents() -> dict[str, bytes]:
        return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}

    before = contents()
    again = run_cli(cmd(run_dir, "train.max_steps=4", "resume=auto"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is finished: step 4" in again.stderr and "Traceback" not in again.stderr
    assert contents() == before  # every file, byte for byte
    longer = run_cli(cmd(run_dir, "train.max_steps=6", "resume=auto"))
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "accepted change train.max_steps: 4 -> 6" in longer.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    results = json.loads((run_dir / "all_results.json").read_text())
    assert results["train_steps"] == 6 and results["resumed_from_step"] == 4 and results["train_steps_per_second"] > 0
    # The recipe's cosine (lr 2e-3, 2 warmup steps) planned again over 6 steps: step k
    # trains at the plan's rate after k - 1 steps, the resumed ones from the first.
    def plan(done: int, total: int, lr: float = 2e-3, warmup: int = 2) -> float:
        return lr * done / warmup if done < warmup else lr * (1 + math.cos(math.pi * (done - warmup) / (total - warmup))) / 2

    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = {row["step"]: row["lr"] for row in logged if "loss" in row}
    assert rates == pytest.approx({k: plan(k - 1, 4 if k <= 4 else 6) for k in range(1, 7)}, rel=1e-12, abs=0)
    assert (f"resume: the cosine schedule is planned again over 6 steps (was 4; 2 warmup steps): step 5 trains at lr "
            f"{plan(4, 6):.4g}, where the old plan had 0, and the rate follows the new plan to {plan(5, 6):.4g} at step 6"
            ) in longer.stderr


@pytest.mark.e2e
def test_a_resume_at_the_last_step_without_results_reports_no_rate(finished_4, tmp_path):
    """Killed after the final checkpoint, before the results: the resume writes them,
    doing nothing twice (no checkpoint saved or set aside, the logged final evaluation
    reused); it ran no step, so it measured no rate (not a rate of 0)."""
    run_dir = copy_of(finished_4, tmp_path)
    first = json.loads((run_dir / "all_results.json").read_text())
    for name in ("all_results.json", "train_results.json", "eval_results.json"):
        (run_dir / name).unlink()
    def files(where: Path) -> dict[str, int]:
        return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in sorted(where.rglob("*")) if p.is_file()}

    checkpoint, metrics = files(run_dir / "checkpoints"), (run_dir / "metrics.jsonl").read_text()
    done = resumed_here(run_dir)
    results = json.loads((run_dir / "all_results.json").read_text())
    assert results["resumed_from_step"] == 4 and results["train_steps"] == 4
    assert [results[k] for k in ("train_steps_per_second", "train_samples_per_second", "train_tokens_per_second",
                                 "train_mfu")] == [None] * 4
    assert results["eval_loss"] == first["eval_loss"] and results["train_loss"] == first["train_loss"]
    # Nothing done twice: the final checkpoint is neither saved again nor set aside, and
    # the final evaluation logged before the kill is reused (it ran no evaluation: no runtime).
    assert files(run_dir / "checkpoints") == checkpoint and not (run_dir / "abandoned").exists()
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (f"resume: step 4's final evaluation is recorded in metrics.jsonl (eval_loss {first['eval_loss']:.4f}): "
            "reused, not run again") in done.stderr
    assert results["eval_runtime"] is None and results["eval_samples"] == first["eval_samples"]
    evals = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert evals == [4]  # the final evaluation once

    # Results written but the model removed: the model is written again, and only it.
    from transformers import AutoModelForCausalLM

    shutil.rmtree(run_dir / "model")
    recorded = {name: (run_dir / name).read_bytes() for name in ("all_results.json", "eval_results.json")}
    again = resumed_here(run_dir)
    assert "results and model are written" not in again.stderr and "recorded in eval_results.json" in again.stderr
    assert AutoModelForCausalLM.from_pretrained(run_dir / "model") is not None
    assert {name: (run_dir / name).read_bytes() for name in recorded} == recorded
    assert files(run_dir / "checkpoints") == checkpoint and not (run_dir / "abandoned").exists()


@pytest.mark.e2e
def test_a_resume_from_an_older_checkpoint_keeps_the_newer_branch_aside(tmp_path):
    """Steps 4, 8 and 12 on disk; a new branch from step 4 (keeping 2) is killed after its
    step-6 save. Pruning used to delete step 6 as it was written, and resume=auto then
    carried on the abandoned branch from step 12."""
    run_dir = tmp_path / "run"
    done = run_cli(cmd(run_dir, "train.max_steps=12", "train.keep_checkpoints=3"))
    assert done.returncode == 0, done.stderr[-3000:]
    first = losses(run_dir)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_4", "step_8", "step_12"]
    branch = ["train.max_steps=12", "train.keep_checkpoints=2", "train.save_every=2"]
    kill_9_after_checkpoint(cmd(run_dir, *branch, f"resume={run_dir / 'checkpoints' / 'step_4'}"), run_dir, step=6)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_4", "step_6"]
    [aside] = (run_dir / "abandoned").iterdir()
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_12", "step_8"]
    assert json.loads((aside / "all_results.json").read_text())["train_steps"] == 12 and (aside / "model").is_dir()
    again = run_cli(cmd(run_dir, *branch, "resume=auto"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and "step_6" in again.stderr
    assert losses(run_dir) == first  # one line per step (losses() checks), the same steps from step 4 on
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_10", "step_12"]


@pytest.mark.e2e
def test_going_back_to_a_set_aside_branch_sets_the_current_one_aside(tmp_path):
    """8 steps (A), a branch from step 4 to 10 (B; A's 6 and 8 set aside), then back to
    A's step 6: B is set aside whole, A's step 6 and its metrics come back, and nothing of
    either branch is written over or lost."""
    run_dir = tmp_path / "run"
    keep = ["train.save_every=2", "train.keep_checkpoints=10"]
    done = run_cli(cmd(run_dir, "train.max_steps=8", *keep))
    assert done.returncode == 0, done.stderr[-3000:]
    a = losses(run_dir)
    b = run_cli(cmd(run_dir, "train.max_steps=10", *keep, f"resume={run_dir / 'checkpoints' / 'step_4'}"))
    assert b.returncode == 0, b.stderr[-3000:]
    b_losses = losses(run_dir)
    [a_aside] = (run_dir / "abandoned").iterdir()
    markers = {str(p.parent.relative_to(run_dir)): p.read_text() for p in run_dir.rglob(COMPLETE_MARKER)}
    back = run_cli(cmd(run_dir, "train.max_steps=10", *keep, f"resume={a_aside / 'checkpoints' / 'step_6'}"))
    assert back.returncode == 0, back.stderr[-3000:]
    assert "step_6 back into checkpoints/" in back.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step_6'} at step 6" in (run_dir / "run.log").read_text()
    [b_aside] = [p for p in (run_dir / "abandoned").iterdir() if p != a_aside]
    assert str(b_aside) in back.stderr
    assert sorted(p.name for p in (b_aside / "checkpoints").iterdir()) == [f"step_{n}" for n in (10, 2, 4, 6, 8)]
    assert json.loads((b_aside / "all_results.json").read_text())["train_steps"] == 10 and (b_aside / "model").is_dir()
    assert losses(b_aside) == b_losses  # B's metrics, whole
    after = losses(run_dir)  # one line per step: A's up to step 6, then the new branch's
    assert sorted(after) == list(range(1, 11)) and {s: after[s] for s in range(1, 7)} == {s: a[s] for s in range(1, 7)}
    assert after[7] != b_losses[7]  # continued from A's weights, not B's
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_6", "step_8", "step_10"]
    for where, text in markers.items():  # every checkpoint of both branches is still somewhere, unchanged
        moved = [p for p in run_dir.rglob(COMPLETE_MARKER) if p.read_text() == text]
        assert moved, f"{where} was lost"


@pytest.mark.e2e
def test_sigterm_checkpoints_and_exits_nonzero_with_the_resume_command(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    code, err = sigterm_after_first_log(cmd(run_dir, "train.save_every=0"), run_dir, timeout=120)
    assert code == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and "--resume auto" in err
    [checkpoint] = complete_checkpoints(run_dir)
    resumed_here(run_dir)
    assert losses(run_dir) == uninterrupted
    assert json.loads((run_dir / "all_results.json").read_text())["train_steps"] == 24


@pytest.mark.e2e
def test_a_crash_mid_save_leaves_the_previous_checkpoint_in_use(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(cmd(run_dir, "train.max_steps=8"))
    assert done.returncode == 0, done.stderr[-3000:]
    # As a crash would leave them: no results, a temporary folder, and a renamed one without its marker.
    (run_dir / "all_results.json").unlink()
    (run_dir / "checkpoints" / ".tmp_step_12").mkdir()
    (run_dir / "checkpoints" / "step_12").mkdir()
    (run_dir / "checkpoints" / "step_12" / "model.safetensors").write_bytes(b"partial")
    assert complete_checkpoints(run_dir)[-1].name == "step_8"
    done = run_cli(resume_cmd(run_dir))
    assert done.returncode == 0 and "resuming from" in done.stderr and "step_8" in done.stderr


@pytest.mark.e2e
def test_corrupted_checkpoint_is_a_clear_error(finished_4, tmp_path):
    run_dir = copy_of(finished_4, tmp_path)
    newest = complete_checkpoints(run_dir)[-1]
    longer = cmd(run_dir, "train.max_steps=8", "resume=auto")  # a finished run is not even loaded
    weights = next(newest.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated on disk
    done = run_cli(longer)
    assert done.returncode == 2
    assert "unreadable" in done.stderr and "Traceback" not in done.stderr
    (newest / COMPLETE_MARKER).write_text('{"step": 4, "epo')  # a marker torn mid-write
    done = run_cli(longer)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{COMPLETE_MARKER} is damaged" in done.stderr and "resume=PATH" in done.stderr
    assert "Traceback" not in done.stderr
    (newest / COMPLETE_MARKER).write_text('{"step": 4, "epoch": 0}')
    (newest / "random_states_0.pkl").unlink()  # Accelerate's load_state would only log "Could not load random states"
    done = run_cli(longer)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "random state random_states_0.pkl cannot be restored" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.e2e
def test_resume_refuses_math_changes_and_reports_harmless_ones(finished_4, tmp_path):
    run_dir = copy_of(finished_4, tmp_path)
    bad = run_cli(cmd(run_dir, "train.max_steps=8", "resume=auto", "optim.lr=0.5", "train.per_device_batch_size=2"))
    assert bad.returncode == 2
    assert "optim.lr" in bad.stderr and "global batch: 4 -> 2" in bad.stderr
    good = run_cli(cmd(run_dir, "train.max_steps=8", "resume=auto"))
    assert good.returncode == 0, good.stderr[-3000:]
    assert "accepted change train.max_steps: 4 -> 8" in good.stderr
    assert max(losses(run_dir)) == 8


@pytest.mark.e2e
def test_resume_auto_without_a_checkpoint_says_so(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(cmd(run_dir, "train.max_steps=2", "resume=auto"))
    assert done.returncode == 0 and "no checkpoint" in done.stderr and "starting fresh" in done.stderr


@pytest.mark.e2e
def test_resume_path_that_is_not_a_checkpoint(tmp_path):
    done = run_cli(cmd(tmp_path / "run", f"resume={tmp_path}"))
    assert done.returncode == 2 and "not a complete checkpoint" in done.stderr


def model_and_adam_state(trainer) -> dict[str, torch.Tensor]:
    """A copy of every weight and every AdamW state tensor (exp_avg, exp_avg_sq, step)."""
    inner = trainer.optimizer.optimizer  # under Accelerate's wrapper
    params = [p for group in inner.param_groups for p in group["params"]]
    out = {f"weight {name}": p.detach().clone() for name, p in trainer.model.named_parameters()}
    out.update({f"param {i} {key}": value.detach().clone() for i, p in enumerate(params)
                for key, value in inner.state[p].items()})
    return out


@pytest.mark.e2e
def test_nan_loss_stops_before_the_step_and_names_it(tmp_path, monkeypatch, capfd):
    """In this process, so the trainer's state can be seen: the weights and AdamW state the
    run stops with are exactly those from before the step it names."""
    from runner.cli import main
    from runner.train.trainer import NonFiniteLoss, Trainer

    before_step: dict[int, dict[str, torch.Tensor]] = {}  # the last few steps only
    at_stop: dict[str, dict[str, torch.Tensor]] = {}
    train_step, fit = Trainer.train_step, Trainer.fit

    def snapshotting_step(self, batch):
        before_step.setdefault(self.state.step + 1, model_and_adam_state(self))
        before_step.pop(self.state.step - 2, None)
        return train_step(self, batch)

    def fit_until_stopped(self):
        try:
            return fit(self)
        except NonFiniteLoss:
            at_stop["state"] = model_and_adam_state(self)
            raise

    monkeypatch.setattr(Trainer, "train_step", snapshotting_step)
    monkeypatch.setattr(Trainer, "fit", fit_until_stopped)
    run_dir = tmp_path / "run"
    # An absurd learning rate blows the weights up within a couple of steps.
    with pytest.raises(SystemExit) as stopped:
        main([*cmd(run_dir, "optim.lr=1e30", "schedule.warmup_steps=0", "optim.max_grad_norm=0")[3:]])
    err = capfd.readouterr().err
    assert stopped.value.code == 3, err[-3000:]
    # The reason the run logged, as the exception carries it (a sweep records it from
    # there): read from it, not from this process's console, whose logging an earlier
    # in-process test under xdist once left writing elsewhere (tests/sweep/test_sweep_resume.py
    # checks the console line, in a subprocess).
    reason = stopped.value.reason
    named = re.search(r"non-finite loss or gradient norm at step (\d+)", reason)
    assert named, reason
    assert "last good checkpoint" in reason or "no checkpoint yet" in reason
    assert not (run_dir / "all_results.json").exists()
    before, after = before_step[int(named.group(1))], at_stop["state"]
    assert sorted(after) == sorted(before) and any(k.endswith("exp_avg_sq") for k in after)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


@pytest.mark.e2e
def test_an_accumulation_change_at_an_odd_step_continues_exactly(tmp_path):
    """The issue's case: 1x8x1 for 3 steps, then 1x4x2. Accelerate's restored micro-batch
    counter (3) once made step 4 take one micro-batch (grad norm 47% off)."""
    resumed_across_layouts(tmp_path, ["train.max_steps=8"], ("train.per_device_batch_size=8",),
                           ("train.per_device_batch_size=4", "train.grad_accum_steps=2"), cut_at=3, layouts="1x8x1 -> 1x4x2")


@pytest.mark.e2e
def test_a_layout_change_across_short_last_steps_continues_exactly(tmp_path):
    """14 samples at a global batch of 4: each epoch ends in a step of 2 samples, which
    1x4x1 trains as one short batch and 1x2x2 as a window of one micro-batch. Resumed on
    the other layout at step 3, two epoch ends on, the run is the uninterrupted one (once
    refused: "samples do not divide into global batches")."""
    resumed_across_layouts(tmp_path, ["train.max_steps=9", "data.max_train_samples=14"], (),
                           ("train.per_device_batch_size=2", "train.grad_accum_steps=2"), cut_at=3,
                           layouts="1x4x1 -> 1x2x2")


def resumed_across_layouts(tmp_path: Path, common: list[str], before: tuple[str, ...], after: tuple[str, ...],
                           cut_at: int, layouts: str) -> None:
    """An uninterrupted run on the `before` layout against one cut at step `cut_at` and
    resumed on the `after` layout, dropout off and a constant rate: every step's loss and
    gradient norm match."""
    from runner.report.parity import parity_problems, step_records

    from conftest import MICRO

    dropout_off = next(o for o in MICRO if o.startswith("model.config_overrides"))
    base = [*(o for o in cmd(tmp_path, *common) if not o.startswith("model.config_overrides")
              and not o.startswith("hydra.run.dir")), dropout_off, "schedule=constant"]
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    done = run_cli([*base, *before, f"hydra.run.dir={reference}"])
    assert done.returncode == 0, done.stderr[-3000:]
    first = run_cli([*base, *before, f"train.max_steps={cut_at}", f"train.save_every={cut_at}", f"hydra.run.dir={cut}"])
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli([*base, *after, f"train.save_every={cut_at}", "resume=auto", f"hydra.run.dir={cut}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"accepted change layout {layouts}" in resumed.stderr and "not exact" not in resumed.stderr  # dropout off
    assert parity_problems(step_records(reference / "metrics.jsonl"), step_records(cut / "metrics.jsonl")) == []


@pytest.mark.e2e
def test_a_layout_change_with_dropout_on_says_it_cannot_be_exact(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(cmd(run_dir, "train.max_steps=3", "train.save_every=3"))
    assert done.returncode == 0, done.stderr[-3000:]
    other = run_cli(cmd(run_dir, "train.max_steps=4", "train.per_device_batch_size=2", "train.grad_accum_steps=2",
                        "resume=auto"))
    assert other.returncode == 0, other.stderr[-3000:]
    assert "accepted change layout 1x4x1 -> 1x2x2" in other.stderr
    assert "with dropout on (attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1" in other.stderr and "not exact" in other.stderr


@pytest.mark.e2e
def test_a_resume_on_changed_training_data_is_refused(tmp_path):
    """The position is a sample of the tokenized blocks: a file edited between save and
    resume gives other blocks (other cache key), so the resume would train other samples."""
    import gzip

    from runner.config.paths import asset_path

    with gzip.open(asset_path("austen.txt.gz"), "rt", encoding="utf-8") as handle:
        text = "".join(line for _, line in zip(range(3000), handle))
    train = tmp_path / "train.txt"
    train.write_text(text)
    run_dir = tmp_path / "run"
    data = [f"data.train_file={train}", "train.max_steps=4", "train.save_every=2"]
    done = run_cli(cmd(run_dir, *data))
    assert done.returncode == 0, done.stderr[-3000:]
    train.write_text(text.replace("Elinor", "Eleanor"))
    refused = run_cli(cmd(run_dir, *data, "train.max_steps=6", "resume=auto"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "the training data: its tokenized blocks differ from the checkpoint's" in refused.stderr
    assert "Traceback" not in refused.stderr
    train.write_text(text)  # restored: the same blocks, resumed
    again = run_cli(cmd(run_dir, *data, "train.max_steps=6", "resume=auto"))
    assert again.returncode == 0, again.stderr[-3000:]
