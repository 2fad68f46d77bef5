"""peft=lora end to end, as users run it (the model's and the adapters' dropout on): the
outputs load with peft and transformers and give the trained model's logits; a kill -9
resumes bit for bit; a resume refuses another adapter; the auto micro-batch plans a
frozen base. Every strategy against one process: `runner certify --peft lora`
(tests/certify/test_certify_runs.py). Runs go through the CLI in this process
(runs.run_cli); the killed one gets a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runs import cmd, losses, run_cli
from test_checkpoint import kill_9_after_checkpoint, resumed_here

pytestmark = [pytest.mark.e2e]

# GPT-2 with its dropout on (0.1), as the runs' own config_overrides build it
BASE_CONFIG = dict(n_embd=32, n_layer=1, n_head=2, n_positions=64)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A pretrained model to fine-tune: random weights saved with save_pretrained."""
    from transformers import AutoModelForCausalLM, GPT2Config

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(**BASE_CONFIG)).save_pretrained(folder)
    return folder


def lora(base: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={base}", "peft=lora", *extra]


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_the_adapter_and_the_merged_model_give_the_trained_models_logits(base, tmp_path):
    from peft import PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from runner.components.adapters import lora_config
    from runner.config.spec import PeftKind, PeftSpec

    run_dir = tmp_path / "run"
    done = run_cli(cmd(run_dir, *lora(base, "peft.save_merged=true", "train.max_steps=8", "train.save_every=8")))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "all_results.json").read_text())
    total, trainable = results["total_parameters"], results["trainable_parameters"]
    assert trainable == 8 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))  # rank 8 on the one block's 4 layers
    assert results["trainable_ratio"] == round(trainable / total, 6) and total > 50 * trainable
    assert f"{trainable:,} trainable" in done.stderr and f"{trainable:,} of {total:,}" in done.stderr

    # The trained model: the final checkpoint's weights in a fresh PeftModel.
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora_config(PeftSpec(kind=PeftKind.lora)))
    state = load_file(run_dir / "checkpoints" / "step_8" / "model.safetensors")
    missing, unexpected = trained.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied to wte
    frozen = {k: v for k, v in state.items() if ".lora_" not in k}
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    for key, value in frozen.items():  # the base did not move
        assert torch.equal(value, original[key.replace("base_model.model.", "").replace(".base_layer", "")]), key
    expected = logits(trained)
    assert (expected - logits(AutoModelForCausalLM.from_pretrained(base))).abs().max() > 1e-3  # it trained

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")
    torch.testing.assert_close(logits(adapter), expected, rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert not any(".lora_" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-5)


def test_kill_9_then_resume_continues_bit_for_bit_with_dropout_on(base, tmp_path):
    """The adapters' dropout (0.05) and the model's (0.1) both on."""
    full = tmp_path / "full"
    done = run_cli(cmd(full, *lora(base)))
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    kill_9_after_checkpoint(cmd(run_dir, *lora(base)), run_dir, step=12)
    resumed_here(run_dir)
    assert losses(run_dir) == losses(full)  # every step, bit for bit


def test_a_resume_refuses_another_rank_alpha_or_target_list_naming_each(base, tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(cmd(run_dir, *lora(base, "train.max_steps=4")))
    assert first.returncode == 0, first.stderr[-3000:]
    changed = lora(base, "train.max_steps=8", "resume=auto", "peft.rank=4", "peft.alpha=8",
                   "peft.target_modules=[c_attn]")
    bad = run_cli(cmd(run_dir, *changed))
    assert bad.returncode == 2, bad.stderr[-3000:]
    for change in ("peft.rank: 8 -> 4", "peft.alpha: 16.0 -> 8.0", "peft.target_modules: None -> ['c_attn']"):
        assert change in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr


def test_the_auto_micro_batch_plans_and_probes_a_frozen_base(base, tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(cmd(run_dir, *lora(base, "train.per_device_batch_size=auto", "train.global_batch_size=8",
                                      "train.max_steps=2")))
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = [line for line in (run_dir / "run_spec.yaml").read_text().splitlines()
              if line.strip().startswith("per_device_batch_size:")][0]
    assert int(chosen.split(":")[1]) in (1, 2, 4, 8)
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()


def test_a_layout_change_with_the_adapters_dropout_on_says_it_cannot_be_exact(base, tmp_path):
    """The model's dropout off, the adapters' (0.05) on: the note names peft.dropout."""
    run_dir = tmp_path / "run"
    no_model_dropout = "model.config_overrides='resid_pdrop=0,embd_pdrop=0,attn_pdrop=0'"
    first = run_cli(cmd(run_dir, *lora(base, no_model_dropout, "train.max_steps=3", "train.save_every=3")))
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_cli(cmd(run_dir, *lora(base, no_model_dropout, "train.max_steps=4", "train.per_device_batch_size=2",
                                       "train.grad_accum_steps=2", "resume=auto")))
    assert other.returncode == 0, other.stderr[-3000:]
    assert "accepted change layout 1x4x1 -> 1x2x2" in other.stderr
    assert "with dropout on (peft.dropout=0.05)" in other.stderr and "not exact" in other.stderr
