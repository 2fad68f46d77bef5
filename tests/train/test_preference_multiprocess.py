"""Preference optimisation in other layouts: a step's loss is the mean over its pairs on
every rank and micro-batch, counted before the step, so accumulation trains the same
numbers as one process (loss within 1e-4, gradient norm within 0.1%, at every step),
where the micro-batches hold different numbers of pairs and past an epoch boundary; and
a zero3 checkpoint of 2 processes resumes on one. preference.reference=frozen at 2
processes under zero3 and fsdp (one launch) trains the numbers of one process with the
reference precomputed, no rank holding the copy whole. Every strategy at 2 processes against
one process is the certify matrix's (`runner certify --objective dpo`,
tests/certify/test_certify_runs.py), which holds rewards/* and logps/* to the loss's
allowance too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from in_turn import run_in_turn
from runner.certify.architectures import TINY
from runner.report.parity import parity_problems, step_records

pytestmark = pytest.mark.multiprocess

# 13 pairs at 8 a step: the epoch's second step holds 5 (2 x 4: rank 1's batch one pair
# and three fillers; 1 x 4 x 2: micro-batches of 4 and 1), so steps 3-4 are the second epoch.
COMMON = ["recipe=gpt2_dpo_tiny", "train.max_steps=4", "train.eval_every=0", "train.log_every=1", "schedule=constant",
          "schedule.warmup_steps=0",
          "data.max_train_samples=13", "data.max_eval_samples=4", "data.block_size=128",
          "model.model_type=gpt2", "model.config_overrides='" + TINY["gpt2"].replace("n_positions=64", "n_positions=128") + "'", "optim.lr=1e-3"]
ONE = ["train.per_device_batch_size=8"]
TWO = ["train.per_device_batch_size=4", "launch.nproc_per_node=2"]
LAYOUTS = [
    ["train.per_device_batch_size=4", "train.grad_accum_steps=2"],
    # packed pairs (a micro-batch's sequences first-fit into rows) at 2 processes: rank 1's
    # second-step batch packs its one pair's sequences with three fillers'
    ["train.per_device_batch_size=4", "launch.nproc_per_node=2", "data.packing=true"],
]


def run(run_dir: Path, layout: list[str]) -> Path:
    done = subprocess.run([sys.executable, "-m", "runner", *COMMON, *layout, "tracking=none", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir / "metrics.jsonl"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return run(tmp_path_factory.mktemp("dpo_reference") / "one", ONE)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[" ".join(layout) for layout in LAYOUTS])
def test_every_layout_trains_the_pairs_of_one_process(reference, tmp_path, layout):
    assert_trains_as_one_process(run(tmp_path / "run", layout), reference)


def assert_trains_as_one_process(metrics: Path, reference: Path) -> None:
    ours, theirs = step_records(metrics), step_records(reference)
    assert sorted(ours) == list(range(1, 5))
    assert parity_problems(theirs, ours) == []
    lines, again = ([record for record in map(json.loads, path.read_text().splitlines()) if "rewards/margins" in record
                     and "loss" in record] for path in (metrics, reference))
    for a, b in zip(lines, again):  # the pair means of rewards and log-probs too
        # Step 1 trains the starting weights: every reward is 0 up to the rounding of a
        # forward of another shape, and which side of 0 it falls decides its accuracy.
        names = ("rewards/margins", "logps/chosen", "logps/rejected") + (("rewards/accuracies",) if a["step"] > 1 else ())
        for name in names:
            assert abs(a[name] - b[name]) <= 1e-4 * max(1.0, abs(b[name])), (a["step"], name, a[name], b[name])
    assert lines[-1]["loss"] != lines[0]["loss"]  # steps were taken


# preference.reference=frozen at 2 processes, one launch for both sharding strategies: the
# copy scores what one process's precomputed table holds, and no rank holds it whole
# (run.log: what each rank holds of it). ddp's whole copy is tests/train/test_frozen_reference.py's.
FROZEN = ("zero3", "fsdp")
HELD = re.compile(r"reference: a frozen copy .* prepared by strategy=(\w+): the ranks hold \[([\d, ]+)\] of its "
                  r"([\d,]+) parameter elements")


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> dict[str, Path]:
    runs = {strategy: [*COMMON, *TWO, f"strategy={strategy}", "preference.reference=frozen", "tracking=none"]
            for strategy in FROZEN}
    return run_in_turn(tmp_path_factory.mktemp("dpo_frozen"), runs, timeout=1800)


@pytest.mark.parametrize("strategy", FROZEN)
def test_a_frozen_reference_sharded_like_the_policy_trains_as_precomputed_on_one_process(reference, frozen, strategy):
    assert_trains_as_one_process(frozen[strategy] / "metrics.jsonl", reference)
    found = HELD.search((frozen[strategy] / "run.log").read_text())
    assert found and found.group(1) == strategy, strategy
    held, whole = [int(n) for n in found.group(2).split(",")], int(found.group(3).replace(",", ""))
    lines = [[r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r and "rewards/margins" in r]
             for path in (frozen[strategy] / "metrics.jsonl", reference)]
    largest = {name: max(abs(a[name] - b[name]) for a, b in zip(*lines)) for name in ("loss", "logps/chosen")}
    print(f"{strategy}: largest difference from one process with precomputed {largest}; the ranks hold {held} of "
          f"the frozen copy's {whole} parameter elements")
    assert len(held) == 2 and max(held) < whole <= sum(held), (held, whole)  # sharded, all of it held
    # the final evaluation scores the validation pairs against the copy too
    evaluated = [[r for r in map(json.loads, path.read_text().splitlines()) if "eval_loss" in r][-1]
                 for path in (frozen[strategy] / "metrics.jsonl", reference)]
    for name in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"):
        a, b = evaluated[0][name], evaluated[1][name]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (name, a, b)


def test_a_zero3_run_resumed_under_ddp_on_one_process_continues_as_one_process(reference, tmp_path):
    """Elastic: a 2-process zero3 run's step-2 checkpoint, read into one process under ddp
    (1 x 4 x 2, the same global batch) into a new run folder, which scores the reference
    again with the starting weights (the checkpoint is loaded after): steps 3-4 equal the
    uninterrupted one-process run."""
    run(tmp_path / "zero3", [*TWO, "strategy=zero3", "train.save_every=2"])
    resumed = run(tmp_path / "ddp", ["train.per_device_batch_size=4", "train.grad_accum_steps=2",
                                     f"resume={tmp_path / 'zero3' / 'checkpoints' / 'step_2'}"])
    ours, theirs = step_records(resumed), step_records(reference)
    assert sorted(ours) == [3, 4]
    assert parity_problems({step: theirs[step] for step in (3, 4)}, ours) == []
