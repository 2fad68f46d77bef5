"""Instruction data end to end, offline (recipe=gpt2_sft_tiny): it trains packed and
unpacked, reports its examples, rows and trained tokens, and runner's own evaluation
gives the same eval loss for the same examples packed and padded. Runs go through the
CLI in this process (runs.run_cli)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from runs import Ran, run_cli

pytestmark = [pytest.mark.e2e]

QUICK = ["recipe=gpt2_sft_tiny", "train.max_steps=4", "train.eval_every=0", "train.log_every=1",
         "data.max_train_samples=32"]


def run(run_dir: Path, *extra: str) -> Ran:
    return run_cli([*QUICK, *extra, f"hydra.run.dir={run_dir}"])


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory) -> tuple[Path, Ran]:
    run_dir = tmp_path_factory.mktemp("sft") / "packed"
    done = run(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done


def test_the_offline_sft_example_trains_packed_and_reports_its_rows(packed_run):
    run_dir, done = packed_run
    counts = json.loads((run_dir / "all_results.json").read_text())["instruction_data"]
    train = counts["train"]
    assert train["examples"] == 1900 and train["dropped"] == 0  # 95% of 2,000; none longer than 256 tokens
    assert train["rows"] < train["examples"] / 2 and 0.8 < train["packing_efficiency"] <= 1.0
    assert 0.1 < train["trained_share"] < 0.5  # the completions (a sentence) and EOS, not the passages
    assert train["trained_tokens"] == round(train["trained_share"] * train["tokens"]) or \
        abs(train["trained_tokens"] / train["tokens"] - train["trained_share"]) < 1e-4
    assert f"{train['examples']:,} examples (0 truncated, 0 dropped" in done.stderr
    assert "packed into" in done.stderr and "packing efficiency" in done.stderr


def real_tokens_of_first_rows(compose_spec, packing: bool, rows: int) -> int:
    """The non-padding tokens of the recipe's first training rows, read off the cache."""
    from transformers import AutoTokenizer

    from runner.components.data.prepare import prepare
    from runner.config.paths import asset_path

    spec = compose_spec("recipe=gpt2_sft_tiny", f"data.packing={str(packing).lower()}")
    data = prepare(spec.data, AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer"))), 256)
    first = data.train.select(range(rows))
    return int(sum(first["real_tokens"])) if packing else sum(len(ids) for ids in first["input_ids"])


def test_tokens_and_rates_count_real_tokens_not_padding(packed_run, compose_spec):
    """4 steps of 8 rows are the 32 rows of the epoch: trained tokens are theirs less padding."""
    results = json.loads((packed_run[0] / "all_results.json").read_text())
    expected = real_tokens_of_first_rows(compose_spec, packing=True, rows=32)
    assert expected < 32 * 256 and results["train_tokens"] == expected
    assert results["train_tokens_per_second"] == pytest.approx(expected / results["train_runtime"], rel=1e-3)
    lines = [json.loads(line) for line in (packed_run[0] / "metrics.jsonl").read_text().splitlines()]
    logged = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m]
    assert len(logged) == 4 and all(0 < rate < 32 * 256 / results["train_runtime"] * 4 for rate in logged)


def test_unpacked_it_trains_one_example_a_row(tmp_path, compose_spec):
    done = run(tmp_path / "padded", "data.packing=false")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "padded" / "all_results.json").read_text())
    train = results["instruction_data"]["train"]
    assert train["rows"] == train["examples"] == 1900 and train["packing_efficiency"] == 1.0
    # padded to the longest of each batch; the padding is not counted
    assert results["train_tokens"] == real_tokens_of_first_rows(compose_spec, packing=False, rows=32)


def evaluation(model, packing: bool, compose_spec) -> dict[str, float]:
    """runner's Trainer.evaluate on the recipe's validation examples, packed or padded."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from runner.components.chunked_loss import install
    from runner.components.data.prepare import collate_for, prepare
    from runner.components.objectives.base import ObjectiveSetup
    from runner.components.objectives.causal_lm import CausalLM
    from runner.config.paths import asset_path
    from runner.train.trainer import Trainer

    spec = compose_spec("recipe=gpt2_sft_tiny", f"data.packing={str(packing).lower()}")
    tokenizer = AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))
    data = prepare(spec.data, tokenizer, 256)
    loader = DataLoader(data.validation, batch_size=4, collate_fn=collate_for(spec.data, data.pad_id))
    chunked, _ = install(model, probe=False)  # as runs evaluate: through the chunked head
    objective = CausalLM(ObjectiveSetup(model, processes=1, grad_accum_steps=1, chunked=chunked))
    holder = SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, eval_loader=loader, objective=objective,
                             strategy=SimpleNamespace(after_evaluation=lambda model: None), data=SimpleNamespace(sources=()))
    try:
        return Trainer.evaluate(holder)  # type: ignore[arg-type]
    finally:
        chunked.remove()


def test_packed_and_padded_evaluation_of_the_same_examples_agree(packed_run, compose_spec):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(packed_run[0] / "model")
    packed, padded = evaluation(model, True, compose_spec), evaluation(model, False, compose_spec)
    assert packed["eval_samples"] < padded["eval_samples"] == 100  # rows: several examples a row, or one
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], abs=1e-5)
    assert packed["eval_accuracy"] == pytest.approx(padded["eval_accuracy"], abs=1e-6)
    assert torch.isfinite(torch.tensor(packed["eval_loss"]))


def test_packing_is_refused_on_a_model_that_lets_examples_attend_across(tmp_path):
    """OPT reads positions from the attention mask: the probe on the prepared model refuses
    it in one line, before the first step."""
    opt = ("model.config_overrides='hidden_size=64,ffn_dim=128,num_hidden_layers=2,num_attention_heads=4,"
           "max_position_embeddings=256,word_embed_proj_dim=64,vocab_size=50257'")
    done = run(tmp_path / "opt", "model.model_type=opt", opt)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "data.packing=true: on this opt model" in done.stderr and "Set data.packing=false" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "opt" / "metrics.jsonl").exists()


def test_a_resume_continues_bit_for_bit_with_dropout_on(packed_run, tmp_path):
    """The recipe's dropout on: 2 steps and a checkpoint, then a resume to step 4, equals
    the uninterrupted packed run at every step (its rows, its token weighting, its
    random state)."""
    from runs import losses

    cut = tmp_path / "cut"
    first = run(cut, "train.max_steps=2", "train.save_every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run(cut, "train.save_every=2", "resume=auto")
    assert resumed.returncode == 0 and "resum" in resumed.stderr, resumed.stderr[-3000:]
    assert losses(cut) == losses(packed_run[0])
    totals = [json.loads((d / "all_results.json").read_text())["train_tokens"] for d in (cut, packed_run[0])]
    assert totals[0] == totals[1]  # the real tokens before the checkpoint came with it
