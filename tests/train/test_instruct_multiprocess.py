"""Instruction data in every layout (2 CPU processes, gloo): a step's loss is the sum
over its answer tokens on every rank and micro-batch over their number, so 2 processes
under ddp, zero3 and fsdp, and accumulation, train the same numbers as one process
(loss within 1e-4, gradient norm within 0.1%, at every step, past an epoch boundary),
packed and padded, for an absolute-position, a grouped-query and a QK-norm model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def run(run_dir: Path, arch: str, packing: str, layout: list[str]) -> Path:
    done = subprocess.run([sys.executable, "-m", "runner", *COMMON, *MODELS[arch], f"data.packing={packing}", *layout,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir / "metrics.jsonl"


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("sft_reference")
    return {(arch, packing): run(root / f"{arch}-{packing}", arch, packing, ONE)
            for arch, packing in sorted({(a, p) for a, p, _ in CASES})}


@pytest.mark.parametrize("arch, packing, layout", CASES, ids=[f"{a}-packing_{p}-{' '.join(l)}" for a, p, l in CASES])
def test_every_layout_trains_the_numbers_of_one_process(references, tmp_path, arch, packing, layout):
    metrics = run(tmp_path / "run", arch, packing, layout)
    ours, reference = step_records(metrics), step_records(references[(arch, packing)])
    assert sorted(ours) == list(range(1, 7))
    assert parity_problems(reference, ours) == []
    # the real (non-padding) tokens, counted on every rank and summed, are the same rows'
    tokens = [json.loads((m.parent / "all_results.json").read_text())["train_tokens"]
              for m in (metrics, references[(arch, packing)])]
    assert tokens[0] == tokens[1] < 6 * 8 * 64
