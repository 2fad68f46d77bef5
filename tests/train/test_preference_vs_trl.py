"""train.objective=dpo against TRL's DPOTrainer, the maintained implementation it must equal.

The same saved tiny model, the same pairs in the same order (runner's epoch order, fed
to TRL sequentially), the same batch, AdamW, linear schedule and clipping, fp32 with
dropout off: every step's loss, gradient norm and rewards/* agree within 1e-5."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # trl_dpo: the TRL side, one copy with the bench

from trl_dpo import runner_order  # noqa: E402

pytestmark = [pytest.mark.e2e]

STEPS, BATCH, LR, SEED = 6, 4, 1e-3, 7
FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def write_pairs(path: Path, count: int, offset: int) -> None:
    """Pairs from the embedded novels: a line, its next line (chosen), a line from far away (rejected)."""
    from runner.config.paths import asset_path

    with gzip.open(asset_path("austen.txt.gz"), "rt") as handle:
        lines = [line.strip() for line in handle if len(line.strip()) > 40][offset:offset + 3 * count + 500]
    with path.open("w") as out:
        for i in range(count):
            out.write(json.dumps({"prompt": lines[3 * i] + "\n", "chosen": " " + lines[3 * i + 1],
                                  "rejected": " " + lines[-1 - i]}) + "\n")


def save_model(folder: Path, arch: str) -> Path:
    """A tiny model, dropout off, saved with the vendored GPT-2 tokenizer: both trainers start from it.
    llama: grouped-query attention (4 heads, 2 key/value heads) and rotary positions."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from runner.config.paths import asset_path

    tokenizer = AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id,
                                             eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def runner_steps(run_dir: Path, model: Path, train: Path, validation: Path, *extra: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "model=gpt2", f"model.name_or_path={model}", f"model.tokenizer_name={model}",
         "objective=dpo", "data=austen_sft", f"data.train_file={train}", f"data.validation_file={validation}", "data.block_size=128",
         f"train.per_device_batch_size={BATCH}", f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=0",
         f"train.seed={SEED}", f"optim.lr={LR}", "optim.weight_decay=0", "schedule=linear", "schedule.warmup_steps=0",
         "tracking=none", f"hydra.run.dir={run_dir}", *extra],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"eval_loss"' not in line]


def trl_steps(out: Path, model_dir: Path, train: Path, order: list[int], **dpo: object) -> list[dict]:
    """TRL's DPOTrainer on the same pairs, in runner's order (one epoch's, fed sequentially)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM

    from trl_dpo import dpo_trainer

    dataset = load_dataset("json", data_files=str(train), split="train")
    trainer = dpo_trainer(AutoModelForCausalLM.from_pretrained(model_dir), str(model_dir), dataset, order,
                          str(out), per_device_train_batch_size=BATCH, learning_rate=LR, lr_scheduler_type="linear",
                          warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, max_steps=STEPS,
                          seed=SEED, optim="adamw_torch", max_length=None, **dpo)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("arch, loss_type", [("gpt2", "sigmoid"), ("llama", "sigmoid")])
def test_every_step_equals_trls_dpo_trainer(tmp_path, arch, loss_type):
    saved_model = save_model(tmp_path / f"tiny_{arch}", arch)
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    write_pairs(train, BATCH * STEPS, 0)
    write_pairs(validation, 8, 2000)
    ours = runner_steps(tmp_path / "runner", saved_model, train, validation, f"preference.loss_type={loss_type}")
    theirs = trl_steps(tmp_path / "trl", saved_model, train, runner_order(BATCH * STEPS, SEED), loss_type=[loss_type],
                       beta=0.1)
    assert len(ours) == len(theirs) == STEPS
    worst: dict[str, float] = {}
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for name in FIGURES:
            gap = abs(a[name] - b[name])
            worst[name] = max(worst.get(name, 0.0), gap)
            assert gap <= 1e-5 * max(1.0, abs(b[name])), (step, name, a[name], b[name])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (step, a["grad_norm"], b["grad_norm"])
    print("largest differences:", worst)
    assert ours[-1]["loss"] < ours[0]["loss"]  # it learned something: not two untrained copies agreeing
