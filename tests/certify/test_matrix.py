"""runner certify's verdicts, from run folders made here (no training): what makes a
cell exact, and each way it is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.certify.matrix import STEPS, STRATEGIES, Cell, judge, render


def _run_folder(path: Path, model: GPT2LMHeadModel, losses: dict[int, float], norms: dict[int, float]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": losses[s], "grad_norm": norms[s]}) + "\n" for s in sorted(losses)))
    model.save_pretrained(path / "model")
    return path


@pytest.fixture
def reference(tmp_path: Path) -> tuple[Path, GPT2LMHeadModel, dict, dict]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32, vocab_size=100))
    losses = {s: 4.0 - 0.1 * s for s in range(1, STEPS + 1)}
    norms = {s: 2.0 + 0.01 * s for s in range(1, STEPS + 1)}
    return _run_folder(tmp_path / "reference", model, losses, norms), model, losses, norms


def _cell(tmp_path: Path) -> Cell:
    return Cell("gpt2", "fp32", "zero2", tmp_path / "zero2", tmp_path / "initial_model")


def test_equal_steps_and_an_equal_saved_model_are_exact(tmp_path, reference):
    ref, model, losses, norms = reference
    cell = _cell(tmp_path)
    _run_folder(cell.run_dir, model, {s: v + 5e-5 for s, v in losses.items()}, norms)
    judge(cell, ref)
    assert cell.verdict == "exact", cell.detail


def test_a_gradient_norm_one_percent_off_is_not_exact_and_names_the_step(tmp_path, reference):
    ref, model, losses, norms = reference
    cell = _cell(tmp_path)
    _run_folder(cell.run_dir, model, losses, {s: v * (1.01 if s == 8 else 1) for s, v in norms.items()})
    judge(cell, ref)
    assert cell.verdict == "not exact" and "step 8" in " ".join(cell.detail), cell.detail


def test_a_step_the_resume_lost_is_not_exact(tmp_path, reference):
    ref, model, losses, norms = reference
    cell = _cell(tmp_path)
    _run_folder(cell.run_dir, model, {s: v for s, v in losses.items() if s != 8}, norms)
    judge(cell, ref)
    assert cell.verdict == "not exact" and any("not 1-12 once each" in d for d in cell.detail), cell.detail


def test_a_saved_model_with_other_weights_is_not_exact(tmp_path, reference):
    ref, model, losses, norms = reference
    cell = _cell(tmp_path)
    other = GPT2LMHeadModel(model.config)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.lm_head.weight.mul_(1.1)  # tied to the embedding: every logit moves
    _run_folder(cell.run_dir, other, losses, norms)
    judge(cell, ref)
    assert cell.verdict == "not exact" and any("logits differ" in d for d in cell.detail), cell.detail


def test_a_model_that_does_not_load_is_not_exact(tmp_path, reference):
    ref, model, losses, norms = reference
    cell = _cell(tmp_path)
    _run_folder(cell.run_dir, model, losses, norms)
    (cell.run_dir / "model" / "model.safetensors").write_bytes(b"truncated")
    judge(cell, ref)
    assert cell.verdict == "not exact" and any("does not load with from_pretrained" in d for d in cell.detail)


def test_the_matrix_has_a_row_per_architecture_and_says_why_a_cell_is_not_exact(tmp_path):
    cells = [Cell("llama", "fp32", s, tmp_path, tmp_path, "exact") for s in STRATEGIES]
    cells[3].verdict, cells[3].detail = "refused", ["LlamaForCausalLM names no layer class to wrap"]
    text = render({"llama": cells}, ["fp32"], "runner certify llama")
    assert "| llama | exact | exact | exact | refused |" in text
    assert "- llama fsdp fp32: refused: LlamaForCausalLM names no layer class to wrap" in text
    assert text.startswith("Made by `runner certify llama`.")


def test_an_unknown_architecture_is_one_line_naming_those_it_knows(capsys):
    from runner.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["certify", "bert"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "no tiny config for model type(s) bert" in err and "llama" in err


def _adapter_folder(path: Path, base: GPT2LMHeadModel, scale: float) -> Path:
    """A run folder's adapter/: rank-4 LoRA on the base, lora_B set to `scale` (0: untrained)."""
    from peft import get_peft_model

    from runner.components.adapters import lora_config
    from runner.config.spec import PeftKind, PeftSpec

    copy = GPT2LMHeadModel(base.config)
    copy.load_state_dict(base.state_dict())
    torch.manual_seed(1)  # lora_A's random init: the same in every folder
    wrapped = get_peft_model(copy, lora_config(PeftSpec(kind=PeftKind.lora, rank=4)))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.fill_(scale)
    wrapped.save_pretrained(path / "adapter")
    return path


def _lora_cell(tmp_path: Path, reference) -> tuple[Cell, Path]:
    ref, model, losses, norms = reference
    model.save_pretrained(tmp_path / "initial_model")
    _adapter_folder(ref, model, 0.01)
    cell = Cell("gpt2", "fp32", "zero3", tmp_path / "zero3", tmp_path / "initial_model", peft="lora")
    _run_folder(cell.run_dir, model, losses, norms)
    return cell, ref


def test_an_adapter_with_the_references_weights_is_exact_and_other_weights_are_not(tmp_path, reference):
    cell, ref = _lora_cell(tmp_path, reference)
    _adapter_folder(cell.run_dir, reference[1], 0.01)
    judge(cell, ref)
    assert cell.verdict == "exact", cell.detail
    _adapter_folder(cell.run_dir, reference[1], 0.02)  # another adapter, the same base
    judge(cell, ref)
    assert cell.verdict == "not exact" and any("adapter/'s logits differ" in d for d in cell.detail), cell.detail
    assert "gpt2 zero3 fp32 lora" == cell.name


def test_an_untrained_reference_adapter_or_one_that_does_not_load_is_not_exact(tmp_path, reference):
    cell, ref = _lora_cell(tmp_path, reference)
    _adapter_folder(cell.run_dir, reference[1], 0.0)
    _adapter_folder(ref, reference[1], 0.0)  # empty adapters match each other: that proves nothing
    judge(cell, ref)
    assert cell.verdict == "not exact" and any("did not train" in d for d in cell.detail), cell.detail
    (cell.run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"truncated")
    judge(cell, ref)
    assert cell.verdict == "not exact" and any("does not load with PeftModel" in d for d in cell.detail), cell.detail


def test_the_router_loss_row_trains_instruction_data_with_the_router_loss_on(tmp_path):
    """The mixture-of-experts row with its router loss on: its model type's tiny config
    with output_router_logits, instruction data in every run, and a reference at the
    cells' micro-batch of 4 (the router loss is a mean per micro-batch); --reshard
    resumes there too. Other rows are as they were."""
    from transformers import AutoConfig

    from runner.certify.matrix import Cell, compose, leg_spec, overrides, save_initial_model
    from runner.config.spec import DataFormat

    save_initial_model("mixtral_router_sft", tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "mixtral" and config.output_router_logits and config.router_aux_loss_coef == 0.01

    reference = compose(overrides(tmp_path, "fp32", None, row="mixtral_router_sft"))
    cell = Cell("mixtral_router_sft", "fp32", "zero3", tmp_path / "zero3", tmp_path, reshard=True)
    first, resumed = leg_spec(cell, resume=False), leg_spec(cell, resume=True)
    for spec in (reference, first, resumed):
        assert spec.data.format is DataFormat.prompt_completion and spec.data.packing
    assert (reference.train.per_device_batch_size, reference.train.grad_accum_steps) == (4, 2)
    def layout(spec):
        return spec.train.per_device_batch_size, spec.train.grad_accum_steps, str(spec.launch.nproc_per_node)

    assert layout(first) == (4, 1, "2") and layout(resumed) == (4, 2, "1")
    plain = compose(overrides(tmp_path, "fp32", None, row="mixtral"))
    assert plain.data.format is DataFormat.text and plain.train.per_device_batch_size == 8
    assert plain.train.grad_accum_steps == 1


def _with_figures(run_dir: Path, margins: dict[int, float]) -> None:
    """A DPO run's training lines: its rewards and log-probs beside the loss."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.update({"rewards/margins": margins[row["step"]], "rewards/chosen": 0.1 * row["step"],
                    "logps/chosen": -200.0 - row["step"], "logps/rejected": -190.0 - row["step"]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_dpo_cell_whose_rewards_part_from_the_references_is_not_exact_and_names_the_step(tmp_path, reference):
    ref, model, losses, norms = reference
    margins = {s: 0.05 * s for s in losses}
    _with_figures(ref, margins)
    for step, verdict in ((None, "exact"), (9, "not exact")):
        cell = Cell("gpt2", "fp32", "zero2", tmp_path / f"zero2_{step}", tmp_path / "initial_model", objective="dpo")
        _run_folder(cell.run_dir, model, losses, norms)
        _with_figures(cell.run_dir, {s: m + (2e-3 if s == step else 1e-5) for s, m in margins.items()})
        judge(cell, ref)
        assert cell.verdict == verdict, cell.detail
    assert any("step 9: rewards/margins" in d for d in cell.detail), cell.detail


def test_a_list_of_pefts_makes_a_column_each():
    cells = [Cell("gpt2", "fp32", s, Path("x"), Path("y"), "exact", peft=p, objective="dpo")
             for p in ("none", "lora") for s in STRATEGIES]
    text = render({"gpt2": cells}, ["fp32"], "runner certify gpt2 --objective dpo --peft none,lora", ["none", "lora"],
                  objective="dpo")
    assert "| architecture | ddp fp32 dpo | zero2 fp32 dpo | zero3 fp32 dpo | fsdp fp32 dpo | ddp fp32 dpo lora |" in text
    assert "| gpt2 | exact | exact | exact | exact | exact | exact | exact | exact |" in text
