"""Instruction data in every layout (2 CPU processes, gloo): a step's loss is the sum
over its answer tokens on every rank and micro-batch over their number, so 2 processes
under ddp, zero3 and fsdp, and accumulation, train the same numbers as one process
(loss within 1e-4, gradient norm within 0.1%, at every step, past an epoch boundary),
packed and padded, for an absolute-position, a grouped-query and a QK-norm model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from in_turn import run_in_turn

from runner.certify.architectures import TINY
from runner.report.parity import parity_problems, step_records

pytestmark = pytest.mark.multiprocess

# 37 rows at 8 a step: 5 steps an epoch, the last of 5 rows (2 x 4: rank 1's batch one
# row and three fillers), so step 6 is in the second epoch.
COMMON = ["recipe=gpt2_sft_tiny", "train.max_steps=6", "train.eval_every=0", "train.log_every=1", "schedule=constant",
          "data.max_train_samples=37", "data.block_size=64", "data.too_long=truncate"]
MODELS = {  # dropout off: only equal math can match
    "gpt2": ["model.model_type=gpt2", "model.config_overrides='" + TINY["gpt2"] + "'"],
    "llama": ["model.model_type=llama", "model.config_overrides='" + TINY["llama"] + "'"],
    "qwen3": ["model.model_type=qwen3", "model.config_overrides='" + TINY["qwen3"] + "'"],
}
ONE = ["train.per_device_batch_size=8"]
TWO = ["train.per_device_batch_size=4", "launch.nproc_per_node=2"]
CASES = [  # (architecture, packing, layout of the compared run)
    ("gpt2", "true", ["train.per_device_batch_size=4", "train.grad_accum_steps=2"]),
    ("gpt2", "true", [*TWO, "strategy=ddp"]),
    ("gpt2", "true", [*TWO, "strategy=zero3"]),
    ("gpt2", "true", [*TWO, "strategy=fsdp"]),
    ("gpt2", "false", ["train.per_device_batch_size=2", "train.grad_accum_steps=2", "launch.nproc_per_node=2"]),
    ("llama", "true", [*TWO, "strategy=fsdp"]),
    ("qwen3", "true", [*TWO, "strategy=zero3"]),
]


def overrides(arch: str, packing: str, layout: list[str]) -> list[str]:
    return [*COMMON, *MODELS[arch], f"data.packing={packing}", *layout]


def processes(layout: list[str]) -> int:
    return 2 if "launch.nproc_per_node=2" in layout else 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every reference (one process x 8) and every case, in turn on one launch of workers
    per number of processes (tests/in_turn.py): the workers import once for all of them."""
    root = tmp_path_factory.mktemp("sft_layouts")
    wanted = {f"reference-{arch}-{packing}": overrides(arch, packing, ONE)
              for arch, packing in sorted({(a, p) for a, p, _ in CASES})}
    wanted.update({f"case{i}": overrides(arch, packing, layout) for i, (arch, packing, layout) in enumerate(CASES)})
    folders: dict[str, Path] = {}
    for nproc in (1, 2):
        group = {name: o for name, o in wanted.items() if processes(o) == nproc}
        folders.update(run_in_turn(root / f"nproc{nproc}", group, timeout=1800))
    return folders


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{a}-packing_{p}-{' '.join(l)}" for a, p, l in CASES])
def test_every_layout_trains_the_numbers_of_one_process(runs, case):
    arch, packing, _ = CASES[case]
    metrics, reference_metrics = (runs[name] / "metrics.jsonl" for name in (f"case{case}", f"reference-{arch}-{packing}"))
    ours, reference = step_records(metrics), step_records(reference_metrics)
    assert sorted(ours) == list(range(1, 7))
    assert parity_problems(reference, ours) == []
    # the real (non-padding) tokens, counted on every rank and summed, are the same rows'
    tokens = [json.loads((m.parent / "all_results.json").read_text())["train_tokens"] for m in (metrics, reference_metrics)]
    assert tokens[0] == tokens[1] < 6 * 8 * 64
