"""A mixture end to end, in this process: recipe=gpt2_mix_tiny reports each source (the
banner, all_results.json), a mixture of one source trains the single-source run's numbers
bit for bit, and a weight that is not a number is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runs import run_cli
from runner.config.paths import asset_path

pytestmark = pytest.mark.e2e

QUICK = ["model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64'", "data.block_size=64",
         "data.max_eval_samples=8", "train.max_steps=6", "train.log_every=1", "train.eval_every=0", "tracking=none"]


def test_the_offline_mixture_reports_each_source(tmp_path):
    done = run_cli(["recipe=gpt2_mix_tiny", *QUICK, f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    for name, asked in (("novels", "70.0%"), ("instructions", "30.0%")):
        assert f"data: mixture: {name}: " in done.stderr and f"{asked} asked" in done.stderr
    mixture = json.loads((tmp_path / "run" / "all_results.json").read_text())["mixture"]
    assert [m["source"] for m in mixture] == ["novels", "instructions"]
    assert [m["share_asked"] for m in mixture] == [0.7, 0.3]
    assert abs(sum(m["trained_examples_share"] for m in mixture) - 1) < 1e-5
    assert all(m["prepared_examples"] > 0 and m["mixture_tokens"] > 0 and m["validation_examples"] > 0 for m in mixture)
    # 6 steps x 8 rows of the mixture: the novels' share of the trained examples is near what was asked
    assert 0.4 < mixture[0]["trained_examples_share"] < 0.95


def test_a_mixture_of_one_source_trains_the_single_source_numbers(tmp_path):
    sft = asset_path("austen_sft.jsonl.gz")
    single = run_cli(["recipe=gpt2_sft_tiny", *QUICK, f"hydra.run.dir={tmp_path / 'single'}"])
    mixed = run_cli(["recipe=gpt2_sft_tiny", *QUICK, "data.train_file=null",
                     f"data.mixture=[{{train_file:'{sft}',format:prompt_completion,weight:2.5}}]",
                     f"hydra.run.dir={tmp_path / 'mixed'}"])
    assert single.returncode == 0 and mixed.returncode == 0, (single.stderr[-2000:], mixed.stderr[-2000:])

    def steps(run_dir: Path) -> list[tuple]:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]

    assert len(steps(tmp_path / "single")) == 6
    assert steps(tmp_path / "mixed") == steps(tmp_path / "single")  # bit for bit, dropout on
    results = [json.loads((tmp_path / name / "all_results.json").read_text()) for name in ("single", "mixed")]
    assert results[1]["eval_loss"] == results[0]["eval_loss"]


def test_a_weight_that_is_not_a_number_is_one_line(tmp_path):
    done = run_cli(["recipe=gpt2_mix_tiny", "data.mixture.0.weight=heavy", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "data.mixture.0.weight" in done.stderr and "could not be converted to Float" in done.stderr
