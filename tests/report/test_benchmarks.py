"""eval.tasks: lm-eval's benchmarks on a run's saved model (runner/report/benchmarks.py).

The oracle is lm-evaluation-harness's own command line on the same folder: the same
per-document log-likelihoods within 1e-6 and the same scores."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO
from runner.config.paths import asset_path
from runner.config.spec import RunSpec
from runner.report import benchmarks
from runs import run_cli

TASK = asset_path("tasks") / "austen_next"
LIMIT = 40  # documents: 160 scored choices, a few seconds on the micro model
# The micro model with the positions austen_next's longest answers need (lm-eval truncates
# a question from the left, never an answer).
POSITIONS = "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=128,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0'"


def test_scores_are_flattened_by_task_and_metric_with_their_filter_and_missing_errors():
    flat = benchmarks.flat_scores({
        "austen_next": {"alias": "austen_next", "acc,none": 0.25, "acc_stderr,none": 0.03, "acc_norm,none": 0.2},
        "gsm8k": {"exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": "N/A"},
    })
    assert flat == {"benchmark/austen_next/acc": 0.25, "benchmark/austen_next/acc_stderr": 0.03,
                    "benchmark/austen_next/acc_norm": 0.2, "benchmark/gsm8k/exact_match/strict-match": 0.1,
                    "benchmark/gsm8k/exact_match_stderr/strict-match": None}


def test_a_task_file_is_run_by_its_name_from_its_own_folder(tmp_path):
    copy = tmp_path / "mine"
    shutil.copytree(TASK, copy)
    text = (copy / "austen_next.yaml").read_text().replace("task: austen_next", "task: my_austen")
    (copy / "my_austen.yaml").write_text(text)
    (copy / "austen_next.yaml").unlink()
    asked = benchmarks.request(["austen_next", str(copy / "my_austen.yaml")])
    assert asked.names == ["austen_next", "my_austen"] and asked.problems == []
    assert asked.include == [benchmarks.shipped_tasks(), copy]


def _spec(**eval_settings) -> RunSpec:
    spec = RunSpec()
    for key, value in eval_settings.items():
        setattr(spec.eval, key, value)
    return spec


def test_bad_benchmark_settings_are_refused_each_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "nameless.yaml").write_text("output_type: multiple_choice\n")
    problems = benchmarks.check(_spec(tasks=["austen_nxt", str(tmp_path / "missing.yaml"), str(tmp_path / "nameless.yaml")]))
    assert len(problems) == 3, problems
    assert any("austen_nxt is not an lm-eval task" in p and "Did you mean austen_next" in p for p in problems), problems
    assert any("missing.yaml: no such task file" in p for p in problems), problems
    assert any("nameless.yaml has no `task:` name" in p for p in problems), problems
    assert benchmarks.check(_spec(tasks=["austen_next", "hellaswag"])) == []
    assert benchmarks.check(_spec()) == []  # no tasks: nothing looked up, lm-eval not needed

    scratch = _spec(tasks=["austen_next"])
    scratch.peft.kind = type(scratch.peft.kind)("lora")
    assert any("peft.save_merged=true" in p for p in benchmarks.check(scratch))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    assert any('pip install "runner[eval]"' in p for p in benchmarks.check(_spec(tasks=["austen_next"])))


def _cli_samples(output: Path) -> dict[int, list[float]]:
    [samples] = output.rglob("samples_austen_next_*.jsonl")
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    return {d["doc_id"]: [float(s[0]) for s in d["filtered_resps"]] for d in lines}


def _runner_samples(run_dir: Path, task: str = "austen_next") -> dict[int, list[float]]:
    lines = [json.loads(line) for line in (run_dir / "benchmarks" / f"{task}.jsonl").read_text().splitlines()]
    return {d["doc_id"]: [float(s[0]) for s in d["scores"]] for d in lines}


@pytest.mark.e2e
def test_the_scores_after_training_equal_lm_evals_command_line_on_the_saved_model(tmp_path):
    """A run with eval.tasks: its scores, in all_results.json and the printed table, and
    each document's log-likelihoods equal `lm_eval --model hf` on its model/ folder. Then
    `runner eval` with the same task from a YAML file of another name gives the same."""
    run_dir = tmp_path / "run"
    ran = run_cli([*MICRO, POSITIONS, "train.eval_every=0", "eval.tasks=[austen_next]", f"eval.limit={LIMIT}",
                   f"hydra.run.dir={run_dir}"])
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads((run_dir / "all_results.json").read_text())
    assert "eval_loss" in results and "train_loss" in results  # the training's, kept
    acc = results["benchmark/austen_next/acc"]
    assert "runner: benchmarks" in ran.stderr and f"austen_next acc {acc:.4f}" in " ".join(ran.stderr.split())
    assert "runner: benchmarks" in (run_dir / "run.log").read_text()

    # lm-eval's own command line, as the results say to run it, writing its samples
    command = results["benchmark_command"].split() + ["--output_path", str(tmp_path / "cli"), "--log_samples"]
    assert command[:5] == ["lm_eval", "--model", "hf", "--model_args", f"pretrained={run_dir / 'model'},dtype=auto"]
    done = subprocess.run([sys.executable, "-m", "lm_eval", *command[1:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [cli_results] = (tmp_path / "cli").rglob("results_*.json")
    cli = json.loads(cli_results.read_text())["results"]["austen_next"]
    ours, theirs = _runner_samples(run_dir), _cli_samples(tmp_path / "cli")
    assert len(ours) == LIMIT and ours.keys() == theirs.keys()
    worst = max(abs(a - b) for doc in ours for a, b in zip(ours[doc], theirs[doc], strict=True))
    assert worst <= 1e-6, worst
    assert abs(acc - cli["acc,none"]) <= 1e-6 and abs(results["benchmark/austen_next/acc_norm"] - cli["acc_norm,none"]) <= 1e-6

    # On demand, from a task file of the user's: the same documents, the same scores.
    mine = tmp_path / "tasks"
    shutil.copytree(TASK, mine)
    (mine / "austen_mine.yaml").write_text((mine / "austen_next.yaml").read_text().replace(
        "task: austen_next", "task: austen_mine"))
    again = run_cli(["eval", str(run_dir), f"eval.tasks=[{mine / 'austen_mine.yaml'}]", f"eval.limit={LIMIT}"])
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((run_dir / "all_results.json").read_text())
    assert "benchmark/austen_next/acc" not in rerun  # a new evaluation replaces the last
    assert rerun["benchmark/austen_mine/acc"] == acc and rerun["eval_loss"] == results["eval_loss"]
    assert _runner_samples(run_dir, "austen_mine") == ours


@pytest.mark.e2e
def test_runner_eval_refuses_what_it_cannot_do_in_one_line(tmp_path):
    missing = run_cli(["eval", str(tmp_path / "nothing"), "eval.tasks=[austen_next]"])
    assert missing.returncode == 2 and "no run_spec.yaml there" in missing.stderr
    (tmp_path / "run_spec.yaml").write_text("name: x\n")  # a run that saved nothing
    other = run_cli(["eval", str(tmp_path), "train.max_steps=3"])
    assert other.returncode == 2 and "changes only eval.* settings" in other.stderr
    typo = run_cli(["eval", str(tmp_path), "eval.taks=[austen_next]"])
    assert typo.returncode == 2 and "Did you mean 'eval.tasks'" in typo.stderr
    unsaved = run_cli(["eval", str(tmp_path), "eval.tasks=[austen_next]"])
    assert unsaved.returncode == 2 and "holds no saved model" in unsaved.stderr
    for ran in (missing, other, typo, unsaved):
        assert "Traceback" not in ran.stderr and len(ran.stderr.strip().splitlines()) <= 2, ran.stderr


@pytest.mark.multiprocess
def test_a_sharded_two_process_run_is_benchmarked_once_as_one_process_evaluates_it(tmp_path):
    """zero3 at 2 processes: the launcher evaluates model/ once, after the workers; the
    same folder evaluated again in a process of its own gives every log-likelihood bit for bit."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "runner", *MICRO, POSITIONS, "strategy=zero3", "launch.nproc_per_node=2",
                           "train.per_device_batch_size=2", "train.eval_every=0", "eval.tasks=[austen_next]",
                           f"eval.limit={LIMIT}", f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("runner: benchmarks") == 1 and (run_dir / "run.log").read_text().count("runner: benchmarks") == 1
    trained = json.loads((run_dir / "all_results.json").read_text())
    during = _runner_samples(run_dir)
    assert len(during) == LIMIT
    again = run_cli(["eval", str(run_dir), "eval.tasks=[austen_next]", f"eval.limit={LIMIT}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert _runner_samples(run_dir) == during
    assert json.loads((run_dir / "all_results.json").read_text())["benchmark/austen_next/acc"] == trained["benchmark/austen_next/acc"]


@pytest.mark.e2e
def test_a_sweep_over_precisions_benchmarks_every_job(tmp_path):
    """A sweep's jobs run one after another in one process. lm-eval's model builds an
    Accelerator, which fills Accelerate's process-wide state (no mixed precision); the
    next job, in bf16, must still be free to choose its precision, and be benchmarked too."""
    sweep_dir = tmp_path / "sweep"
    short = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "model.config_overrides"))]
    done = subprocess.run([sys.executable, "-m", "runner", "-m", *short, POSITIONS, "train.max_steps=3",
                           "train.eval_every=0", "precision=fp32,bf16", "eval.tasks=[austen_next]", "eval.limit=8",
                           f"hydra.sweep.dir={sweep_dir}"], capture_output=True, text=True, timeout=600)
    jobs = sorted(p for p in sweep_dir.iterdir() if (p / "job_status.json").is_file())
    statuses = {p.name: json.loads((p / "job_status.json").read_text())["status"] for p in jobs}
    assert done.returncode == 0 and list(statuses.values()) == ["ok", "ok"], (statuses, done.stderr[-3000:])
    for job in jobs:
        assert "benchmark/austen_next/acc" in json.loads((job / "all_results.json").read_text())
