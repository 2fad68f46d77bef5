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
    results = json.loads((tmp_path / "run" / "all_results.json").read_text())
    mixture = results["mixture"]
    assert [m["source"] for m in mixture] == ["novels", "instructions"]
    # data.max_eval_samples=8 is shared between the sources: each has a loss of its own
    assert {"eval_loss/novels", "eval_loss/instructions"} <= results.keys()
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


def test_each_source_is_evaluated_on_its_own(tmp_path):
    """The novels (weight 1) and a small text of weight 0: the mixture trains the novels'
    blocks alone, so the run is the novels-only run, and the novels' own validation loss
    is that run's eval_loss bit for bit; the total is the sources' token-weighted mean
    (text blocks: equal tokens a row)."""
    small = tmp_path / "small.txt"
    small.write_text("".join(f"Line {n} of a small text that is evaluated but never sampled.\n" for n in range(400)))
    held_out = small.with_name("small_valid.txt")
    held_out.write_text("".join(f"Line {n} of its held-out part.\n" for n in range(200)))
    novels = asset_path("austen.txt.gz")
    common = ["recipe=gpt2_clm_tiny", *[o for o in QUICK if not o.startswith("data.max_eval_samples")],
              "data.validation_split_percentage=1"]
    single = run_cli([*common, f"hydra.run.dir={tmp_path / 'single'}"])
    mixed = run_cli([*common, "data.train_file=null",
                     f"data.mixture=[{{name:novels,train_file:'{novels}',weight:1}},{{name:small,train_file:'{small}',"
                     f"validation_file:'{held_out}',weight:0}}]", f"hydra.run.dir={tmp_path / 'mixed'}"])
    assert single.returncode == 0 and mixed.returncode == 0, (single.stderr[-2000:], mixed.stderr[-2000:])
    alone, ours = (json.loads((tmp_path / name / "all_results.json").read_text()) for name in ("single", "mixed"))
    assert ours["eval_loss/novels"] == alone["eval_loss"]
    sources = {m["source"]: m for m in ours["mixture"]}
    assert sources["small"]["mixture_examples"] == 0 and sources["small"]["trained_examples_share"] == 0.0
    rows = {name: sources[name]["validation_examples"] for name in sources}
    assert rows["small"] > 0 and ours["eval_samples"] == sum(rows.values())
    weighted = sum(rows[name] * ours[f"eval_loss/{name}"] for name in rows) / sum(rows.values())
    assert abs(weighted - ours["eval_loss"]) < 1e-6 * ours["eval_loss"], (weighted, ours["eval_loss"])
    assert abs(ours["eval_loss/small"] - ours["eval_loss/novels"]) > 1e-3  # two sources, two losses
    assert "eval loss, small" in mixed.stderr  # the summary table's row
