"""The warm RL model (runner/assets/gpt2_arith_warm/, recipe gpt2_grpo_tiny's start): it
answers sums a model from scratch never does, and recipe gpt2_arith_sft builds one as warm.

Greedy answers on the held-out prompts (the first 100 records: data.validation_split_percentage=5)
and on the next 200 (trained): the shipped model 12/100 and 30%; a from-scratch one 0 and 0."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from runner.config.paths import asset_path
from runs import run_cli

HELD_OUT, TRAINED = slice(0, 100), slice(100, 300)
# Measured (held out, trained): the recipe cut to 100 steps 0.04 and 0.02 (the commonest
# sums), 500 steps 0.08 and 0.18, 1,000 on 2 threads 0.10 and 0.25, the shipped model (1,000
# on 1 thread) 0.12 and 0.30. The trained share tells a warm model from a cold one; both
# bounds leave room for another CPU's last bits, which change the weights, not the skill.
MIN_HELD_OUT, MIN_TRAINED = 0.05, 0.15


def exact_match(model: torch.nn.Module, rows: list[dict[str, str]]) -> float:
    """Greedy answers' share equal to `answer`: one batch, every prompt being as many tokens
    ("What is ab + cd? Answer:", each number one GPT-2 piece), so no padding."""
    tokenizer = AutoTokenizer.from_pretrained(str(asset_path("arith_tokenizer")))
    ids = torch.tensor([tokenizer(r["prompt"])["input_ids"] for r in rows])
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)
    answers = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return sum(a.strip() == r["answer"] for a, r in zip(answers, rows)) / len(rows)


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    with gzip.open(asset_path("arith.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def scores(model_dir: Path, rows: list[dict[str, str]]) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    return exact_match(model, rows[HELD_OUT]), exact_match(model, rows[TRAINED])


def test_the_shipped_warm_model_answers_sums_a_model_from_scratch_never_does(rows):
    held_out, trained = scores(asset_path("gpt2_arith_warm"), rows)
    assert held_out >= MIN_HELD_OUT and trained >= MIN_TRAINED, (held_out, trained)
    torch.manual_seed(0)
    config = GPT2Config.from_pretrained(str(asset_path("gpt2_arith_warm")))
    scratch = GPT2LMHeadModel(config)
    assert (exact_match(scratch, rows[HELD_OUT]), exact_match(scratch, rows[TRAINED])) == (0.0, 0.0)


def test_the_model_and_its_config_group_speak_the_arithmetic_tokenizer(compose_spec):
    tokenizer = AutoTokenizer.from_pretrained(str(asset_path("arith_tokenizer")))
    shipped = json.loads((asset_path("gpt2_arith_warm") / "config.json").read_text())
    group = compose_spec("recipe=gpt2_arith_sft").model  # conf/model/gpt2_arith.yaml: from scratch
    overrides = dict(item.split("=") for item in group.config_overrides.split(","))
    for config in (shipped, {k: int(v) for k, v in overrides.items()}):
        assert config["vocab_size"] == len(tokenizer)
        assert config["eos_token_id"] == config["bos_token_id"] == tokenizer.eos_token_id


@pytest.mark.e2e
def test_the_sft_recipe_builds_a_model_as_warm(rows, tmp_path):
    run_dir = tmp_path / "sft"
    done = run_cli(["recipe=gpt2_arith_sft", "tracking=none", f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    held_out, trained = scores(run_dir / "model", rows)
    assert held_out >= MIN_HELD_OUT and trained >= MIN_TRAINED, (held_out, trained)
