"""A preference run end to end (recipe=gpt2_dpo_tiny, its dropout kept on with
preference.disable_dropout=false, so the resume must continue each random stream):
kill -9 between checkpoints and resume=auto continues bit for bit, reading the reference's
log-probs back from the run folder instead of scoring the data again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runs import resume_cmd
from test_checkpoint import kill_9_at_step

pytestmark = [pytest.mark.e2e]

# 13 pairs at 4 a step: the epoch ends inside step 4 (one pair and three fillers); logged
# every 3 steps, saved every 4: the step-4 checkpoint falls inside the 4-6 log window, and
# the kill lands after step 6 is logged, two steps past it.
QUICK = ["recipe=gpt2_dpo_tiny", "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=128'",
         "data.block_size=128", "data.max_train_samples=13", "data.max_eval_samples=4", "train.per_device_batch_size=4",
         "train.max_steps=7", "train.log_every=3", "train.eval_every=0", "train.save_every=4", "tracking=none",
         "preference.disable_dropout=false"]


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "runner", *QUICK, f"hydra.run.dir={run_dir}"]


def steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_kill_9_and_resume_continue_a_preference_run_bit_for_bit(tmp_path):
    full = tmp_path / "full"
    done = subprocess.run(command(full), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reference: scored 17 pairs with the starting weights" in done.stderr
    assert "reward accuracy" in done.stderr and "reward margin" in done.stderr  # the summary table's rows
    run_dir = tmp_path / "run"
    kill_9_at_step(command(run_dir), run_dir, step=6)
    resumed = subprocess.run(resume_cmd(run_dir), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "reference: scored" not in resumed.stderr  # read back from the run folder
    names = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
    ours, reference = steps(run_dir), steps(full)
    assert [r["step"] for r in ours] == [r["step"] for r in reference] == [3, 6]
    for a, b in zip(ours, reference):
        assert {n: a[n] for n in names} == {n: b[n] for n in names}, a["step"]
    results = [json.loads((d / "all_results.json").read_text()) for d in (run_dir, full)]
    for key in ("train_loss", "eval_loss", "rewards/accuracies", "rewards/margins"):
        assert results[0][key] == results[1][key], key
    assert results[1]["goodput"]["parts_seconds"]["reference"] > 0  # its own part of the ledger, not start-up


def test_packing_pairs_on_a_model_that_lets_them_attend_across_is_refused(tmp_path):
    """data.packing=true packs a micro-batch's pairs (runner/components/data/preference_batch.py);
    OPT reads its positions from the attention mask, so packed sequences would see each
    other: the run is refused in one line, before any step (the probe of packed SFT)."""
    from runs import run_cli

    from runner.certify.architectures import TINY

    opt = TINY["opt"].replace("max_position_embeddings=64", "max_position_embeddings=128")
    done = run_cli([*command(tmp_path / "opt"), "model.model_type=opt", f"model.config_overrides='{opt}'",
                    "data.packing=true"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "packed examples attend to each other" in done.stderr and "Set data.packing=false" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "opt" / "metrics.jsonl").exists()
