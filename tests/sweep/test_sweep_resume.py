"""A continued sweep (resume=auto): each job's folder says what the job does next.

Sweeps and runs go through the CLI in this process (runs.run_cli), as `runner -m` runs
its jobs in its own; the sweep stopped by SIGTERM and the one whose workers are patched
(a sitecustomize.py) get a process of their own."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import MICRO
from runs import run_cli
from runner.train.checkpoint import COMPLETE_MARKER, checkpoint_dir
from runner.config.errors import UserError
from runner.config.spec import SPEC_FILENAME, save_spec
from runner.sweep.status import write_job_status
from runner.sweep.summary import collect
from runner.sweep.resume import (
    Action,
    begin_sweep,
    continue_command,
    plan_job,
    read_records,
    result_changes,
    write_record,
)


@pytest.fixture
def spec(compose_spec):
    made = compose_spec(*MICRO, "resume=auto")
    assert made.resume == "auto"
    return made


def finished(job_dir: Path, spec, status: str = "ok") -> None:
    job_dir.mkdir(parents=True)
    save_spec(spec, job_dir / SPEC_FILENAME)
    (job_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n')
    write_job_status(job_dir, status, 1.0, ["train.seed=1"])


def checkpointed(job_dir: Path, step: int) -> None:
    path = checkpoint_dir(job_dir, step)
    path.mkdir(parents=True)
    (path / COMPLETE_MARKER).write_text(json.dumps({"step": step, "world_size": 1}))


def test_an_empty_folder_is_a_new_job(tmp_path, spec):
    assert plan_job(tmp_path / "job", spec, 1) is Action.new
    assert spec.resume is None  # a fresh start: nothing to resume, nothing to look for


def test_a_finished_job_is_kept(tmp_path, spec):
    finished(tmp_path / "job", spec)
    assert plan_job(tmp_path / "job", spec, 1) is Action.kept


def test_a_finished_job_whose_spec_changed_the_math_is_refused_with_the_change_named(tmp_path, spec):
    finished(tmp_path / "job", spec)
    spec.train.seed += 1
    spec.train.max_steps += 4  # harmless: not named
    with pytest.raises(UserError) as err:
        plan_job(tmp_path / "job", spec, 1)
    message = str(err.value)
    assert "train.seed: 42 -> 43" in message and "max_steps" not in message
    assert "hydra.sweep.dir" in message


def test_a_finished_job_with_more_steps_asked_resumes_and_one_with_other_results_runs_again(tmp_path, compose_spec):
    """max_steps is harmless to a resume, not to whether finished results still answer the sweep."""
    old = compose_spec(*MICRO)  # max_steps 8
    finished(tmp_path / "job", old)
    checkpointed(tmp_path / "job", 8)
    more = compose_spec(*MICRO, "resume=auto", "train.max_steps=12")
    assert plan_job(tmp_path / "job", more, 1) is Action.resumed and more.resume == "auto" and not more.overwrite
    assert result_changes(tmp_path / "job", more, 1) == ["train.max_steps: 8 -> 12"]
    fewer = compose_spec(*MICRO, "resume=auto", "train.max_steps=6")
    assert plan_job(tmp_path / "job", fewer, 1) is Action.rerun and fewer.overwrite  # 8 steps' results answer 6 wrongly
    other_eval = compose_spec(*MICRO, "resume=auto", "data.max_eval_samples=8")
    assert plan_job(tmp_path / "job", other_eval, 1) is Action.rerun and other_eval.overwrite
    cosmetic = compose_spec(*MICRO, "resume=auto", "train.log_every=5", "train.keep_checkpoints=9",
                            "launch.timeout_minutes=90", "tracking=none")
    assert plan_job(tmp_path / "job", cosmetic, 1) is Action.kept


def test_a_finished_job_is_run_again_under_settings_its_speed_and_memory_columns_measure(tmp_path, compose_spec):
    """A resume accepts them (the same math); a finished job's tokens/s and peak memory
    were measured without them, so the sweep does not keep its row."""
    finished(tmp_path / "job", compose_spec(*MICRO))
    for change in ("model.gradient_checkpointing=true", "model.compile=true", "model.attn_implementation=eager",
                   "launch.retain_freed_memory=false"):
        changed = compose_spec(*MICRO, "resume=auto", change)
        assert plan_job(tmp_path / "job", changed, 1) is Action.rerun and changed.overwrite, change


def test_an_interrupted_job_with_a_checkpoint_resumes(tmp_path, spec):
    job = tmp_path / "job"
    job.mkdir()
    (job / "metrics.jsonl").write_text('{"step": 5, "loss": 10.0}\n')
    checkpointed(job, 4)
    assert plan_job(job, spec, 1) is Action.resumed
    assert spec.resume == "auto" and not spec.overwrite


def test_a_job_stopped_by_a_signal_resumes(tmp_path, spec):
    finished(tmp_path / "job", spec, status="stopped")
    checkpointed(tmp_path / "job", 4)
    assert plan_job(tmp_path / "job", spec, 1) is Action.resumed


def test_an_interrupted_job_without_a_checkpoint_runs_again_from_the_start(tmp_path, spec):
    job = tmp_path / "job"
    job.mkdir()
    (job / "metrics.jsonl").write_text('{"step": 2, "loss": 10.0}\n')
    assert plan_job(job, spec, 1) is Action.rerun
    assert spec.resume is None and spec.overwrite  # its partial results are replaced


def test_a_failed_job_is_not_retried_unless_asked(tmp_path, spec):
    """A deterministic failure (a divergence) would only repeat; its checkpoints stay."""
    finished(tmp_path / "job", spec, status="failed")
    checkpointed(tmp_path / "job", 4)
    assert plan_job(tmp_path / "job", spec, 1) is Action.not_retried
    assert spec.resume == "auto" and not spec.overwrite


def test_a_retried_failed_job_resumes_from_its_checkpoint_and_starts_over_only_with_overwrite(tmp_path, compose_spec):
    finished(tmp_path / "job", compose_spec(*MICRO), status="failed")
    checkpointed(tmp_path / "job", 4)
    retried = compose_spec(*MICRO, "resume=auto", "sweep.retry_failed=true")
    assert plan_job(tmp_path / "job", retried, 1) is Action.resumed and retried.resume == "auto"
    over = compose_spec(*MICRO, "resume=auto", "sweep.retry_failed=true", "overwrite=true")
    assert plan_job(tmp_path / "job", over, 1) is Action.rerun and over.resume is None and over.overwrite
    (tmp_path / "job" / "checkpoints").rename(tmp_path / "elsewhere")  # failed before its first checkpoint
    again = compose_spec(*MICRO, "resume=auto", "sweep.retry_failed=true")
    assert plan_job(tmp_path / "job", again, 1) is Action.rerun and again.overwrite


def test_a_sweep_folder_with_results_is_refused_without_resume_or_overwrite(tmp_path, spec):
    finished(tmp_path / "abc123", spec)
    with pytest.raises(UserError) as err:
        begin_sweep(tmp_path, resume=None, overwrite=False)
    message = str(err.value)
    assert "resume=auto" in message and "overwrite=true" in message and "abc123" in message
    begin_sweep(tmp_path, resume="auto", overwrite=False)
    begin_sweep(tmp_path, resume=None, overwrite=True)
    begin_sweep(tmp_path / "fresh", resume=None, overwrite=False)  # no folder yet: nothing to refuse


def test_a_new_invocation_forgets_the_last_ones_records(tmp_path):
    write_record(tmp_path, tmp_path / "abc123", 0, Action.new)
    assert set(read_records(tmp_path)) == {"abc123"}
    begin_sweep(tmp_path, resume="auto", overwrite=False)
    assert read_records(tmp_path) == {}


def test_the_summary_says_what_each_job_did_in_job_list_order(tmp_path, spec):
    for name, num, action in (("zz9999", 0, Action.kept), ("aa0000", 1, Action.resumed)):
        finished(tmp_path / name, spec)
        write_record(tmp_path, tmp_path / name, num, action)
    (tmp_path / "bb1111").mkdir()  # refused before it wrote anything: only the record speaks for it
    write_record(tmp_path, tmp_path / "bb1111", 2, Action.kept, "refused", "train.seed: 42 -> 43")
    rows = collect(tmp_path)
    assert [(r.job, r.run, r.status) for r in rows] == [
        ("zz9999", "kept", "ok"), ("aa0000", "resumed", "ok"), ("bb1111", "kept", "refused")]
    assert rows[2].reason == "train.seed: 42 -> 43"


def test_the_continue_command_is_the_sweep_command_with_resume_and_its_folder(tmp_path):
    argv = ["-m", "recipe=gpt2_clm_tiny", "model.config_overrides='n_embd=32,n_layer=1'", "train.seed=1,2,3",
            "resume=auto", "hydra.sweep.dir=elsewhere"]
    words = shlex.split(continue_command(argv, tmp_path))
    assert words == ["runner", "-m", "recipe=gpt2_clm_tiny", "model.config_overrides='n_embd=32,n_layer=1'",
                     "train.seed=1,2,3", "resume=auto", f"hydra.sweep.dir={tmp_path.resolve()}"]


# ---------------------------------------------------------------- a real sweep, stopped and continued
# Three jobs (seeds 1, 2, 3) of 12 steps, a checkpoint every 4. GPT-2's dropout stays on,
# as in every shipped recipe: job 2 must continue its random stream, not only its weights.
DROPOUT_ON = "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64'"
RESUMABLE = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "data.max_train_samples",
                                                   "model.config_overrides"))] + [
    DROPOUT_ON, "train.max_steps=12", "train.eval_every=0", "train.save_every=4", "data.max_train_samples=64",
]
SEEDS = "train.seed=1,2,3"


def runner_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "runner", *args]


def job_of(sweep_dir: Path, seed: int) -> Optional[Path]:
    """The folder of the job with this seed, found by its recorded overrides."""
    for path in sweep_dir.glob("*/.hydra/overrides.yaml"):
        if f"train.seed={seed}" in path.read_text().split():
            return path.parent.parent
    return None


def step_losses(job_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def last_logged_step(job_dir: Path) -> int:
    """While the job writes: a line may be half written."""
    path = job_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}") and '"loss"' in line), default=0)


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped_sweep(tmp_path_factory):
    """The sweep, sent SIGTERM once job 2 has logged a step past its first checkpoint."""
    root = tmp_path_factory.mktemp("resumable")
    sweep_dir, log = root / "sweep", root / "first.log"
    with log.open("w") as err:
        proc = subprocess.Popen(runner_cmd("-m", *RESUMABLE, SEEDS, f"hydra.sweep.dir={sweep_dir}"),
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline, polls = time.time() + 480, 0
        while True:
            job2 = job_of(sweep_dir, 2)
            if job2 is not None and last_logged_step(job2) >= 6:
                break
            assert proc.poll() is None, f"the sweep ended before job 2 reached step 6:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline and polls < 20_000, "timed out waiting for job 2's step 6"
            polls += 1
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    job1 = job_of(sweep_dir, 1)
    return sweep_dir, proc.returncode, log.read_text(), file_hashes(job1)


@pytest.fixture(scope="module")
def uninterrupted_job2(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli([*RESUMABLE, "train.seed=2", f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    return step_losses(run_dir)


@pytest.mark.e2e
def test_sigterm_checkpoints_the_running_job_and_prints_the_continue_command(stopped_sweep):
    sweep_dir, code, stderr, _ = stopped_sweep
    assert code == 143, stderr[-3000:]
    job2 = job_of(sweep_dir, 2)
    assert json.loads((job2 / "job_status.json").read_text())["status"] == "stopped"
    assert max(int(p.name[5:]) for p in (job2 / "checkpoints").glob("step_*")) >= 6  # saved where it stopped
    assert job_of(sweep_dir, 3) is None  # never started
    printed = stderr.split("Continue it with:\n", 1)[1].splitlines()[0].strip()
    assert printed == continue_command(["-m", *RESUMABLE, SEEDS], sweep_dir)
    assert "Traceback" not in stderr


@pytest.mark.e2e
def test_rerunning_without_resume_auto_is_refused_and_touches_nothing(stopped_sweep):
    sweep_dir, _, _, job1_before = stopped_sweep
    job2_before = file_hashes(job_of(sweep_dir, 2))
    done = run_cli(["-m", *RESUMABLE, SEEDS, f"hydra.sweep.dir={sweep_dir}"])
    assert done.returncode == 2
    assert "resume=auto" in done.stderr and "overwrite=true" in done.stderr and "Traceback" not in done.stderr
    assert file_hashes(job_of(sweep_dir, 1)) == job1_before and file_hashes(job_of(sweep_dir, 2)) == job2_before


@pytest.fixture(scope="module")
def continued_sweep(stopped_sweep):
    """The printed command, with a value added at the front of the sweep: every job's
    place in the job list shifts, its folder must not."""
    sweep_dir, _, stderr, _ = stopped_sweep
    printed = shlex.split(stderr.split("Continue it with:\n", 1)[1].splitlines()[0])
    assert printed[0] == "runner" and SEEDS in printed
    args = ["train.seed=0,1,2,3" if a == SEEDS else a for a in printed[1:]]
    done = run_cli(args)
    return sweep_dir, done


@pytest.mark.e2e
def test_a_continued_sweep_keeps_resumes_and_runs(stopped_sweep, continued_sweep, uninterrupted_job2):
    _, _, _, job1_before = stopped_sweep
    sweep_dir, done = continued_sweep
    assert done.returncode == 0, done.stderr[-3000:]
    # Job 1 finished before the signal: kept, byte for byte.
    assert file_hashes(job_of(sweep_dir, 1)) == job1_before
    # Job 2 continued from its checkpoint: every step once, each loss as if never stopped.
    job2 = job_of(sweep_dir, 2)
    assert "resumed from" in (job2 / "run.log").read_text()  # not a re-run, which would give the same losses
    resumed = step_losses(job2)
    assert sorted(resumed) == list(range(1, 13))
    print("job 2 max |loss - uninterrupted|:", max(abs(resumed[s] - uninterrupted_job2[s]) for s in resumed))
    assert resumed == uninterrupted_job2
    # Job 3 (never started) and job 0 (added) ran.
    for seed in (0, 3):
        assert sorted(step_losses(job_of(sweep_dir, seed))) == list(range(1, 13))
    rows = {next(o for o in r["overrides"].split() if o.startswith("train.seed=")): r
            for r in csv.DictReader((sweep_dir / "summary.csv").open())}
    assert {seed: (r["status"], r["run"]) for seed, r in rows.items()} == {
        "train.seed=0": ("ok", "new"), "train.seed=1": ("ok", "kept"),
        "train.seed=2": ("ok", "resumed"), "train.seed=3": ("ok", "new"),
    }
    assert "| kept |" in (sweep_dir / "summary.md").read_text()


@pytest.mark.e2e
def test_a_failed_job_is_kept_as_it_is_until_retried_and_a_changed_finished_job_is_refused_alone(tmp_path):
    """Seeds 1 and 2, 4 steps, a checkpoint every 2. The first job to reach step 3 crashes
    (after its step-2 checkpoint); the other finishes. Job 2's frozen spec is then edited
    (as a recipe changed since) and the sweep continued: job 1 is not retried (a
    deterministic failure would repeat) and keeps its checkpoint, job 2 is refused with
    the change named; both are left as they are. With sweep.retry_failed=true job 1
    resumes from its step-2 checkpoint."""
    from conftest import patch_train_step

    args = [*[o for o in RESUMABLE if not o.startswith(("train.max_steps", "train.save_every"))],
            "train.max_steps=4", "train.save_every=2", "train.seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    flag = tmp_path / "crashed"
    env = {**os.environ, **patch_train_step(
        tmp_path, f"self.state.step == 2 and not os.path.exists({str(flag)!r})",
        f"open({str(flag)!r}, 'w').close(); raise RuntimeError('injected crash')")}
    first = subprocess.run(runner_cmd("-m", *args), capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 1, first.stderr[-3000:]
    assert "sweep.retry_failed=true" in first.stderr  # how to retry, printed with the failures
    sweep_dir = tmp_path / "sweep"
    job1, job2 = job_of(sweep_dir, 1), job_of(sweep_dir, 2)
    assert json.loads((job1 / "job_status.json").read_text())["status"] == "failed"
    assert (job1 / "checkpoints" / "step_2").is_dir()
    crashed = step_losses(job1)
    assert sorted(crashed) == [1, 2]
    spec_text = (job2 / "run_spec.yaml").read_text()
    assert "  seed: 2\n" in spec_text
    (job2 / "run_spec.yaml").write_text(spec_text.replace("  seed: 2\n", "  seed: 7\n"))
    job1_before, job2_before = file_hashes(job1), file_hashes(job2)

    done = run_cli(["-m", *args, "resume=auto"])
    assert done.returncode == 1, done.stderr[-3000:]  # one job failed, one refused
    assert file_hashes(job1) == job1_before and file_hashes(job2) == job2_before
    assert "not retried: RuntimeError: injected crash" in done.stderr
    assert "train.seed: 7 -> 2" in done.stderr and "Traceback" not in done.stderr
    rows = {next(o for o in r["overrides"].split() if o.startswith("train.seed=")): r
            for r in csv.DictReader((sweep_dir / "summary.csv").open())}
    assert (rows["train.seed=1"]["status"], rows["train.seed=1"]["run"]) == ("failed", "not retried")
    assert "injected crash" in rows["train.seed=1"]["reason"]
    assert (rows["train.seed=2"]["status"], rows["train.seed=2"]["run"]) == ("refused", "kept")
    assert "train.seed: 7 -> 2" in rows["train.seed=2"]["reason"]

    (job2 / "run_spec.yaml").write_text(spec_text)  # the recipe put back
    retried = run_cli(["-m", *args, "resume=auto", "sweep.retry_failed=true"])
    assert retried.returncode == 0, retried.stderr[-3000:]
    resumed = step_losses(job1)
    assert sorted(resumed) == [1, 2, 3, 4] and {s: resumed[s] for s in (1, 2)} == crashed
    assert "resumed from" in (job1 / "run.log").read_text() and "step_2" in (job1 / "run.log").read_text()
    rows = {next(o for o in r["overrides"].split() if o.startswith("train.seed=")): r
            for r in csv.DictReader((sweep_dir / "summary.csv").open())}
    assert (rows["train.seed=1"]["status"], rows["train.seed=1"]["run"]) == ("ok", "resumed")
    assert (rows["train.seed=2"]["status"], rows["train.seed=2"]["run"]) == ("ok", "kept")


def by_lr(sweep_dir: Path) -> dict[float, dict[str, str]]:
    """summary.csv's rows by learning rate (Hydra prints 1e-3 as 0.001)."""
    return {float(next(o for o in r["overrides"].split() if o.startswith("optim.lr="))[9:]): r
            for r in csv.DictReader((sweep_dir / "summary.csv").open())}


@pytest.mark.e2e
def test_a_diverging_middle_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    """optim.lr=1e-3,1e30,2e-3 in one process: the middle job's loss goes non-finite.
    The third job still runs, the summary lists all three, the exit code says a job
    failed; resume=auto then keeps every folder byte for byte and re-runs nothing."""
    sweep_dir = tmp_path / "sweep"
    args = [*[o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every"))], "train.max_steps=6",
            "train.eval_every=0", "schedule.warmup_steps=0", "optim.max_grad_norm=0", "optim.lr=1e-3,1e30,2e-3",
            f"hydra.sweep.dir={sweep_dir}"]
    first = run_cli(["-m", *args])
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    # The console line, as the user sees it.
    assert re.search(r"runner: non-finite loss or gradient norm at step \d+ .*Lower optim.lr", first.stderr)
    rows = by_lr(sweep_dir)
    assert {lr: r["status"] for lr, r in rows.items()} == {1e-3: "ok", 1e30: "failed", 2e-3: "ok"}
    assert "non-finite loss or gradient norm at step" in rows[1e30]["reason"]
    assert float(rows[2e-3]["train_loss"]) < 11  # the job after the failure trained
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    before = {p.name: file_hashes(p) for p in jobs}
    # Continued with overrides that cannot change a result: the jobs stay in their folders.
    again = run_cli(["-m", *args, "resume=auto", "train.log_every=2", f"data.cache_dir={tmp_path / 'c'}"])
    assert again.returncode == 1, again.stderr[-3000:]
    assert {p.name: file_hashes(p) for p in jobs} == before
    assert {lr: r["run"] for lr, r in by_lr(sweep_dir).items()} == {1e-3: "kept", 1e30: "not retried", 2e-3: "kept"}


@pytest.mark.e2e
def test_each_jobs_peak_memory_is_its_own_in_a_one_process_sweep(tmp_path):
    """A large batch, then a small one, in one process: the small job's peak is its own,
    not the process's lifetime peak (the logits alone are 32 x 32 x 50257 floats at batch 32)."""
    sweep_dir = tmp_path / "sweep"
    args = [*[o for o in MICRO if not o.startswith(("train.max_steps", "train.per_device_batch_size"))],
            "train.max_steps=2", "train.eval_every=0", "train.per_device_batch_size=32,1", f"hydra.sweep.dir={sweep_dir}"]
    done = run_cli(["-m", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = {next(o for o in r["overrides"].split() if o.startswith("train.per_device_batch_size=")): float(r["peak_memory_mb"])
             for r in csv.DictReader((sweep_dir / "summary.csv").open())}
    logits_mb = 32 * 32 * 50257 * 4 / 2**20  # 196 MB, and its gradient as much again
    print("peak MB by batch:", peaks)
    assert peaks["train.per_device_batch_size=1"] < peaks["train.per_device_batch_size=32"] - logits_mb
