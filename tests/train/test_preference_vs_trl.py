"""train.objective=dpo against TRL, the maintained implementation it must equal.

The same saved tiny model, the same pairs in the same order (runner's epoch order, fed
to TRL sequentially), the same batch, AdamW, linear schedule and clipping, fp32 with
dropout off: every step's loss, gradient norm and rewards/* agree within 1e-5.

sigmoid runs against TRL's DPOTrainer. The reference-free simpo runs against TRL's own
SimPO, CPOTrainer with loss_type=simpo and cpo_alpha=0 (TRL 1.16's DPOTrainer has no
reference-free loss). Two things differ between CPOTrainer and DPOTrainer, and the simpo
test aligns or maps each, touching neither trainer's loss:
- Tokenization. CPOTrainer prepends the tokenizer's BOS to every prompt (GPT-2's is
  <|endoftext|>, which DPOTrainer, and so runner, never adds to plain text). CPOTrainer
  is handed a tokenizer with no BOS token, and the test asserts that the rows it then
  trains (input ids and labels, chosen and rejected) are runner's, id for id.
- logps/*. CPOTrainer logs simpo's mean token log-probs, runner logs the sums (as
  DPOTrainer does), so they are not compared; rewards/chosen and rewards/rejected are β
  times those means in both, and are compared."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    elif arch == "mixtral":  # a mixture of experts with its router loss on, at a coefficient that moves the step
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
            router_jitter_noise=0.0, output_router_logits=True, router_aux_loss_coef=0.5,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
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


def trl_trainer(out: Path, model_dir: Path, train: Path, order: list[int], trainer_class: type,
                config_class: type, tokenizer: Any = None, **options: object) -> Any:
    """TRL's `trainer_class` (DPOTrainer, CPOTrainer) on the same pairs, in runner's order
    (one epoch's, fed sequentially), with the shared settings and `options` (its loss's)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_dpo import trl_trainer as in_order

    dataset = load_dataset("json", data_files=str(train), split="train")
    return in_order(trainer_class, config_class, AutoModelForCausalLM.from_pretrained(model_dir),
                    tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir), dataset, order,
                    str(out), per_device_train_batch_size=BATCH, learning_rate=LR, lr_scheduler_type="linear",
                    warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, max_steps=STEPS, seed=SEED,
                    optim="adamw_torch", **options)


def trl_steps(trainer: Any) -> list[dict]:
    """Train it; each step's log."""
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_every_step_equal(ours: list[dict], theirs: list[dict], figures: tuple[str, ...]) -> None:
    """Each step's loss and `figures` within 1e-5 (relative past 1), its gradient norm
    within 1e-5 relative; prints the largest differences."""
    assert len(ours) == len(theirs) == STEPS
    worst: dict[str, float] = {}
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for name in ("loss", *figures):
            gap = abs(a[name] - b[name])
            worst[name] = max(worst.get(name, 0.0), gap)
            assert gap <= 1e-5 * max(1.0, abs(b[name])), (step, name, a[name], b[name])
        worst["grad_norm (relative)"] = max(worst.get("grad_norm (relative)", 0.0),
                                            abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]))
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (step, a["grad_norm"], b["grad_norm"])
    print("largest differences:", worst)
    assert ours[-1]["loss"] < ours[0]["loss"]  # it learned something: not two untrained copies agreeing


def the_pairs(tmp_path: Path) -> tuple[Path, Path]:
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    write_pairs(train, BATCH * STEPS, 0)
    write_pairs(validation, 8, 2000)
    return train, validation


@pytest.mark.parametrize("arch, loss_type", [("gpt2", "sigmoid"), ("llama", "sigmoid"), ("mixtral", "sigmoid")])
def test_every_step_equals_trls_dpo_trainer(tmp_path, arch, loss_type):
    """mixtral: TRL adds router_aux_loss_coef x aux_loss of each forward, and so does runner
    (its loss, gradient and the logged aux_loss; issue 61, 4)."""
    from trl import DPOConfig, DPOTrainer

    saved_model = save_model(tmp_path / f"tiny_{arch}", arch)
    train, validation = the_pairs(tmp_path)
    ours = runner_steps(tmp_path / "runner", saved_model, train, validation, f"preference.loss_type={loss_type}")
    order = runner_order(BATCH * STEPS, SEED)
    theirs = trl_steps(trl_trainer(tmp_path / "trl", saved_model, train, order, DPOTrainer, DPOConfig,
                                   loss_type=[loss_type], beta=0.1, max_length=None))
    assert_every_step_equal(ours, theirs, FIGURES[1:] + (("aux_loss",) if arch == "mixtral" else ()))


def test_simpo_every_step_equals_trls_cpo_trainer(tmp_path):
    """Reference-free: runner's simpo against TRL's SimPO (CPOTrainer, loss_type=simpo,
    cpo_alpha=0: no NLL term), at SimPO's own scale (β 2, γ 1: γ/β matters)."""
    from transformers import AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from runner.components.data.preference import SIDES, preference_record_row

    beta, gamma = 2.0, 1.0
    saved_model = save_model(tmp_path / "tiny_gpt2", "gpt2")
    train, validation = the_pairs(tmp_path)
    ours = runner_steps(tmp_path / "runner", saved_model, train, validation, "preference.loss_type=simpo",
                        f"preference.beta={beta}", f"preference.gamma={gamma}")
    no_bos = AutoTokenizer.from_pretrained(saved_model)
    no_bos.bos_token = None  # CPOTrainer would prepend GPT-2's <|endoftext|>: DPOTrainer and runner add none
    trainer = trl_trainer(tmp_path / "trl", saved_model, train, runner_order(BATCH * STEPS, SEED), CPOTrainer,
                          CPOConfig, tokenizer=no_bos, loss_type="simpo", cpo_alpha=0.0, beta=beta,
                          simpo_gamma=gamma, label_smoothing=0.0, max_length=128)
    # The rows CPOTrainer trains are runner's, id for id (the module's docstring).
    names = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    for index, row in enumerate(trainer.train_dataset):
        record = {name: row[name] for name in ("prompt", "chosen", "rejected")}
        runners = preference_record_row(record, index, names, tokenizer, None, str(train))
        for side in SIDES:
            assert row[f"{side}_input_ids"] == runners[f"{side}_input_ids"], (index, side)
            assert row[f"{side}_labels"] == runners[f"{side}_labels"], (index, side)
    theirs = trl_steps(trainer)
    assert all(entry["nll_loss"] == 0.0 for entry in theirs)  # pure SimPO: CPO's NLL term is off
    assert_every_step_equal(ours, theirs, ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                           "rewards/margins"))
