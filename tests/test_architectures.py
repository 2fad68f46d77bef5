"""Any causal LM, certified: a grouped-query-attention, gated-MLP model (Qwen3-style,
head_dim apart from the width) under ddp, zero2, zero3 and fsdp at 2 CPU processes does
the same math as one process, step for step over epoch boundaries (dropout off).
GPT-2 has the same matrix in tests/test_multiprocess.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO
from runner.report.parity import parity_problems, step_records

pytestmark = [pytest.mark.multiprocess]

# 32 blocks at a global batch of 8: 4 steps an epoch, 10 steps cross two epoch boundaries.
# The GPT-2 tokenizer's 50,257 tokens; 4 query heads over 2 key-value heads of 16.
QWEN3 = ("model.config_overrides='hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
         "num_key_value_heads=2,head_dim=16,max_position_embeddings=64,vocab_size=50257'")
BASE = [o for o in MICRO if not o.startswith(("model.config_overrides", "train.per_device_batch_size", "train.eval_every",
                                             "data.max_train_samples", "train.max_steps"))] + [
    "model.model_type=qwen3", QWEN3, "train.eval_every=0", "data.max_train_samples=32", "train.max_steps=10",
]


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *BASE, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("qwen3") / "single_8"
    done = run(run_dir, "train.per_device_batch_size=8")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_a_gqa_gated_model_matches_one_process_under_every_strategy(one_process, tmp_path, strategy):
    done = run(tmp_path / strategy, "launch.nproc_per_node=2", "train.per_device_batch_size=4", f"strategy={strategy}")
    assert done.returncode == 0, done.stderr[-3000:]
    # The engagement check ran (fsdp: every Qwen3DecoderLayer its own FSDP unit, or the run had stopped).
    assert "strategy not engaged" not in done.stderr
    problems = parity_problems(step_records(one_process / "metrics.jsonl"), step_records(tmp_path / strategy / "metrics.jsonl"))
    assert problems == [], problems
