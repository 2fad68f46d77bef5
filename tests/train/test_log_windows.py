"""A log window's figures are the mean of its steps (issue 61, 7): an epoch's short last step
(fewer micro-batches) weighs as much as a whole one, so train_loss and rewards/* do not
depend on train.log_every."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MICRO
from runs import run_cli

pytestmark = [pytest.mark.e2e]

# 10 blocks, 2 a device x 2 accumulation: steps of 4, 4 and 2 blocks (2, 2 and 1 micro-batches).
CAUSAL = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "data.max_train_samples",
                                                "train.per_device_batch_size", "train.log_every"))] + [
    "data.max_train_samples=10", "train.per_device_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=3",
    "train.eval_every=0", "tracking=none"]
# 10 pairs likewise; dropout off.
PREFERENCE = ["recipe=gpt2_dpo_tiny",
              "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=128,resid_pdrop=0,embd_pdrop=0,"
              "attn_pdrop=0'", "data.block_size=128", "data.max_train_samples=10", "data.max_eval_samples=4",
              "train.per_device_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=3", "train.eval_every=0",
              "tracking=none"]


def rows(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("settings, figures", [(CAUSAL, ("loss",)),
                                               (PREFERENCE, ("loss", "rewards/margins", "logps/chosen"))],
                         ids=["causal_lm", "dpo"])
def test_a_window_holding_a_short_last_step_is_the_mean_of_its_steps(tmp_path, settings, figures):
    runs = {}
    for every in (1, 3):
        run_dir = tmp_path / f"every{every}"
        done = run_cli([*settings, f"train.log_every={every}", f"hydra.run.dir={run_dir}",
                        f"data.cache_dir={tmp_path / 'cache'}"])
        assert done.returncode == 0, done.stderr[-3000:]
        runs[every] = run_dir
    each, window = rows(runs[1]), rows(runs[3])
    assert [r["step"] for r in each] == [1, 2, 3] and [r["step"] for r in window] == [3]
    for name in figures:
        mean = sum(r[name] for r in each) / 3
        assert window[0][name] == pytest.approx(mean, rel=1e-6, abs=1e-7), name
    results = [json.loads((runs[every] / "all_results.json").read_text()) for every in (1, 3)]
    assert results[0]["train_loss"] == pytest.approx(results[1]["train_loss"], rel=1e-6)
    assert results[0]["train_loss"] == pytest.approx(sum(r["loss"] for r in each) / 3, rel=1e-6)
