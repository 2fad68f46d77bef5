"""Checkpoints resumed on another number of processes or under another strategy (CPU
processes, gloo: ddp, zero2, zero3 and fsdp, each as source and as destination): each continues within 1e-4 on the loss and 0.1% on the gradient norm
of an uninterrupted run, at every step, past the epoch boundary (step 8).

Cheap by construction: each source run is a whole 12-step run that keeps its
checkpoints, so it is also an uninterrupted run; the resumes read its checkpoints into
new folders. All are compared with one reference, 1 process x 8 under ddp (strategies
agree within these tolerances in fp32: `runner certify`). The sources, then the resumes,
run in turn on one launch of workers per number of processes (tests/in_turn.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO
from in_turn import run_in_turn
from runner.report.parity import parity_problems, step_records
from test_checkpoint import kill_9_after_checkpoint

pytestmark = pytest.mark.multiprocess

# Dropout off (MICRO): only equal math can match. 64 samples at a global batch of 8: 8 steps an epoch.
RUN = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "data.max_train_samples",
                                             "train.per_device_batch_size"))] + [
    "train.max_steps=12", "train.eval_every=0", "train.log_every=1", "data.max_train_samples=64", "schedule=cosine",
    "train.keep_checkpoints=10"]


def layout(strategy: str, processes: int, per_device: int, accumulation: int = 1) -> list[str]:
    return [f"strategy={strategy}", f"launch.nproc_per_node={processes}", f"train.per_device_batch_size={per_device}",
            f"train.grad_accum_steps={accumulation}"]


def runner(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *RUN, *extra, f"hydra.run.dir={run_dir}"]


def run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(runner(run_dir, *extra), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


SOURCES = {  # name: (layout, save_every)
    "ddp-1": (layout("ddp", 1, 8), 3),
    "zero3-2": (layout("zero3", 2, 4), 3),
    "zero2-2": (layout("zero2", 2, 4), 5),
    "zero2-1": (layout("zero2", 1, 8), 3),
    "zero3-1": (layout("zero3", 1, 8), 3),
}


def in_turn_by_processes(root: Path, runs: dict[str, list[str]]) -> dict[str, Path]:
    """`runs` (name: overrides after RUN), one launch for each number of processes."""
    folders: dict[str, Path] = {}
    for nproc in sorted({_processes(o) for o in runs.values()}):
        group = {n: [*RUN, *o] for n, o in runs.items() if _processes(o) == nproc}
        folders.update(run_in_turn(root / f"nproc{nproc}", group, timeout=1800))
    return folders


def _processes(overrides: list[str]) -> str:
    return next(o for o in overrides if o.startswith("launch.nproc_per_node=")).split("=", 1)[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return in_turn_by_processes(tmp_path_factory.mktemp("reshard_sources"),
                                {name: [*settings, f"train.save_every={every}"] for name, (settings, every) in SOURCES.items()})


CASES = [  # (source, checkpoint step, layout resumed in)
    ("zero3-2", 3, layout("ddp", 1, 8)),  # zero3 on 2 -> ddp on 1, at an odd step
    ("zero3-2", 9, layout("fsdp", 2, 2, 2)),  # -> fsdp with accumulation, past the epoch boundary
    ("zero3-2", 3, layout("zero3", 1, 8)),  # 2 -> 1 under its own strategy
    ("zero2-2", 5, layout("fsdp", 2, 4)),  # zero2 -> fsdp
    ("zero2-2", 5, layout("zero2", 1, 4, 2)),  # 2 -> 1 under its own strategy, with accumulation
    ("ddp-1", 3, layout("fsdp", 2, 4)),  # 1 -> 2, ddp -> fsdp
    ("ddp-1", 3, layout("zero3", 2, 4)),  # 1 -> 2, ddp -> zero3
    ("zero2-1", 3, layout("zero2", 2, 2, 2)),  # 1 -> 2 under its own strategy, with accumulation
    ("zero3-1", 3, layout("zero3", 2, 4)),  # 1 -> 2 under its own strategy
]


CASE_IDS = [f"{s}@{k}->{' '.join(l[:2])}" for s, k, l in CASES]


@pytest.fixture(scope="module")
def resumes(sources, tmp_path_factory) -> dict[str, Path]:
    """Every case's resume, in turn."""
    return in_turn_by_processes(tmp_path_factory.mktemp("reshard_resumes"), {
        f"case{i}": [*resumed_in, f"resume={sources[source] / 'checkpoints' / f'step_{step}'}"]
        for i, (source, step, resumed_in) in enumerate(CASES)})


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_a_checkpoint_continues_in_another_layout_or_strategy(sources, resumes, case):
    source, step, resumed_in = CASES[case]
    log = (resumes[f"case{case}"] / "run.log").read_text()
    assert "reshard.py" in log  # read across, not by Accelerate's load_state
    changed = resumed_in[0] != f"strategy={source.split('-')[0]}"
    assert ("note: the strategy changed" in log) is changed  # within rounding, not bit for bit
    reference = step_records(sources["ddp-1"] / "metrics.jsonl")
    resumed = step_records(resumes[f"case{case}"] / "metrics.jsonl")
    assert sorted(resumed) == list(range(step + 1, 13))
    assert parity_problems({s: reference[s] for s in resumed}, resumed) == []
    assert parity_problems(reference, step_records(sources[source] / "metrics.jsonl")) == []  # the source itself


def test_fsdp_killed_after_step_5_continues_on_one_process_with_accumulation(sources, tmp_path):
    """The issue's case: fsdp on 2 processes, kill -9 once step 5 is saved, then resume=auto
    in the same folder on 1 process x 4 x 2 under ddp. Then the fsdp checkpoint of step 5
    under fsdp on 4 processes (DCP reshards it as it loads: no read-across) and under
    zero2 on 1 (fsdp -> zero2)."""
    run_dir = tmp_path / "fsdp"
    kill_9_after_checkpoint(runner(run_dir, *layout("fsdp", 2, 4), "train.save_every=5"), run_dir, step=5)
    run(run_dir, *layout("ddp", 1, 4, 2), "train.save_every=5", "resume=auto")
    reference = step_records(sources["ddp-1"] / "metrics.jsonl")
    assert parity_problems(reference, step_records(run_dir / "metrics.jsonl")) == []
    for name, settings, across in (("fsdp4", layout("fsdp", 4, 2), False), ("zero2", layout("zero2", 1, 8), True)):
        done = run(tmp_path / name, *settings, f"resume={run_dir / 'checkpoints' / 'step_5'}")
        assert ("reshard.py" in done.stderr) is across, name
        resumed = step_records(tmp_path / name / "metrics.jsonl")
        assert sorted(resumed) == list(range(6, 13)), name
        assert parity_problems({s: reference[s] for s in resumed}, resumed) == [], name


def test_a_bf16_checkpoint_continues_under_zero3_from_its_fp32_master(tmp_path):
    """bf16 keeps fp32 master weights beside bf16 working ones under ZeRO: both are set
    from the checkpoint's fp32 master (one process under ddp -> 2 under zero3), within
    bf16's allowance of the uninterrupted run."""
    from runner.report.parity import BF16_GRAD_NORM_RTOL, BF16_LOSS_ATOL

    source = tmp_path / "bf16"
    run(source, *layout("ddp", 1, 8), "precision=bf16", "train.save_every=3")
    run(tmp_path / "zero3", *layout("zero3", 2, 4), "precision=bf16", f"resume={source / 'checkpoints' / 'step_3'}")
    reference, resumed = step_records(source / "metrics.jsonl"), step_records(tmp_path / "zero3" / "metrics.jsonl")
    assert sorted(resumed) == list(range(4, 13))
    assert parity_problems({s: reference[s] for s in resumed}, resumed, BF16_LOSS_ATOL, BF16_GRAD_NORM_RTOL) == []
