"""DPO and dropout (issue 61, 5): TRL's DPOConfig.disable_dropout (True by default) turns
dropout off in the policy and the reference, LoRA's included; runner follows it
(preference.disable_dropout), and every reference mode scores alike. With the adapters at
zero, step 1's policy is the reference: the loss is log 2 and the margins are zero, with
the reference scored through the adapters switched off or precomputed alike."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runs import run_cli

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A pretrained GPT-2 with its dropout on (0.1), as hub checkpoints have it."""
    from transformers import AutoModelForCausalLM, GPT2Config

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=128)).save_pretrained(folder)
    return folder


def first_step(base: Path, run_dir: Path, *extra: str) -> dict:
    done = run_cli(["recipe=gpt2_dpo_tiny", f"model.name_or_path={base}", "model.config_overrides=null", "peft=lora",
                    "data.block_size=128", "data.max_train_samples=8", "data.max_eval_samples=4",
                    "train.per_device_batch_size=4", "train.max_steps=1", "train.log_every=1", "train.eval_every=0",
                    "tracking=none", f"data.cache_dir={run_dir.parent / 'cache'}", f"hydra.run.dir={run_dir}", *extra])
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r][0]


@pytest.mark.parametrize("reference", ["adapter_off", "precomputed"])
def test_with_dropout_off_as_trl_a_fresh_preference_run_starts_at_log_2(base, tmp_path, reference):
    step = first_step(base, tmp_path / reference, f"preference.reference={reference}")
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert step["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert step["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)


def test_with_dropout_kept_every_reference_mode_scores_alike(base, tmp_path):
    """preference.disable_dropout=false keeps the policy's dropout; the reference scores
    without it under every mode (the adapters switched off scored in eval mode, as the
    precomputed table is), so the two runs are the same numbers."""
    steps = [first_step(base, tmp_path / reference, f"preference.reference={reference}",
                        "preference.disable_dropout=false") for reference in ("adapter_off", "precomputed")]
    for name in ("loss", "rewards/margins", "rewards/chosen", "logps/chosen"):
        assert steps[0][name] == pytest.approx(steps[1][name], rel=1e-6, abs=1e-7), name
    assert abs(steps[0]["loss"] - math.log(2)) > 1e-6  # the policy's dropout is on
