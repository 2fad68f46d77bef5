"""A mixture trains the same examples in every layout and strategy, and resumes on another
world size at the same example: ddp, zero2, zero3 and fsdp at 2 processes x 4, and 2 x 4
killed after step 3's checkpoint and resumed on 1 process x 8, each equal one uninterrupted
1 x 8 run at every step (dropout off: a layout change cannot continue a rank's random
stream). The smaller source (12 examples, one a row, weight 0.5, first_exhausted) ends the
mixture's epoch after 3 steps, so the runs train past it twice, and rank 1's batches hold
fillers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.config.paths import asset_path
from runner.report.parity import parity_problems, step_records
from runner.train.checkpoint import complete_checkpoints
from in_turn import run_in_turn
from test_checkpoint import kill_9_after_checkpoint

pytestmark = pytest.mark.multiprocess

TINY = "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0'"


def mixture_run(small: Path) -> list[str]:
    sources = (f"data.mixture=[{{name:novels,train_file:'{asset_path('austen.txt.gz')}',format:text,weight:0.5}},"
               f"{{name:small,train_file:'{small}',validation_file:'{small.with_name('valid.jsonl')}',"
               "format:prompt_completion,weight:0.5}]")
    return ["recipe=gpt2_mix_tiny", TINY, sources, "data.block_size=32", "data.packing=false", "data.max_eval_samples=8",
            "train.max_steps=8", "train.log_every=1", "train.eval_every=0", "train.save_every=3", "tracking=none"]


LAYOUTS = {"2x4": ["launch.nproc_per_node=2", "train.per_device_batch_size=4"], "1x8": ["train.per_device_batch_size=8"]}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    def records(counts: range) -> str:
        return "".join(json.dumps({"prompt": f"Count to {n}:", "completion": " " + " ".join(map(str, range(n)))}) + "\n"
                       for n in counts)

    path = tmp_path_factory.mktemp("small") / "small.jsonl"
    path.write_text(records(range(1, 13)))  # 12 examples
    path.with_name("valid.jsonl").write_text(records(range(13, 16)))
    return path


def run(small: Path, run_dir: Path, layout: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *mixture_run(small), *LAYOUTS[layout], *extra, f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def reference(small, tmp_path_factory) -> Path:
    """The uninterrupted run on one process, 1 x 8."""
    folder = tmp_path_factory.mktemp("reference") / "run"
    done = subprocess.run(run(small, folder, "1x8"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    mixture = json.loads((folder / "all_results.json").read_text())["mixture"]
    assert [m["source"] for m in mixture] == ["novels", "small"] and mixture[1]["mixture_examples"] == 12
    steps_per_epoch = -(-sum(m["mixture_examples"] for m in mixture) // 8)
    assert steps_per_epoch < 8 // 2  # two epoch ends inside the run
    return folder


def test_a_mixture_killed_at_2_processes_resumes_on_one_at_the_same_example(tmp_path, small, reference):
    run_dir = tmp_path / "changing"
    kill_9_after_checkpoint(run(small, run_dir, "2x4"), run_dir, step=3)
    assert complete_checkpoints(run_dir)[-1].name == "step_3"
    done = subprocess.run(run(small, run_dir, "1x8", "resume=auto"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accepted change layout 2x4x1 -> 1x8x1" in done.stderr
    ours, theirs = step_records(run_dir / "metrics.jsonl"), step_records(reference / "metrics.jsonl")
    assert sorted(ours) == list(range(1, 9))
    assert parity_problems(theirs, ours) == []


def test_every_strategy_trains_the_mixtures_examples_as_one_process_does(tmp_path, small, reference):
    """At every step the loss and gradient norm of one process (1e-4, 0.1%); the same
    realised shares (computed from the schedule) and each source's validation loss."""
    strategies = ("ddp", "zero2", "zero3", "fsdp")
    runs = run_in_turn(tmp_path, {s: [*mixture_run(small), *LAYOUTS["2x4"], f"strategy={s}"] for s in strategies},
                       timeout=1200)
    theirs = step_records(reference / "metrics.jsonl")
    expected = json.loads((reference / "all_results.json").read_text())
    for strategy, folder in runs.items():
        assert parity_problems(theirs, step_records(folder / "metrics.jsonl")) == [], strategy
        results = json.loads((folder / "all_results.json").read_text())
        assert results["mixture"] == expected["mixture"], strategy
        # each source (data.max_eval_samples=8 is shared between them), and the total
        figures = [key for key in expected if key.startswith("eval_loss")]
        assert {"eval_loss/novels", "eval_loss/small"} <= set(figures)
        for key in figures:
            assert abs(results[key] - expected[key]) <= 1e-4, (strategy, key)
