"""The objective seam (runner/components/objectives/): the trainer asks its objective for a
micro-batch's loss and for what evaluation reports, and knows nothing of how the loss is
made. A second objective is a class registered in OBJECTIVES; the loop runs it unchanged."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import runner.train
from runner.components.objectives import OBJECTIVES, build_objective
from runner.components.objectives.base import MicroBatchLoss, Objective, ObjectiveSetup
from runner.components.objectives.causal_lm import CausalLM
from runner.config.spec import ObjectiveKind, PrecisionSpec, StrategySpec
from runner.distributed.accelerator import build_accelerator, reset_accelerate_state
from runner.distributed.strategies import build_strategy
from runner.train.parts import Engine, LoopSettings, TrainData
from runner.train.trainer import Trainer

TRAIN = Path(runner.train.__file__).parent
# The loop's modules: the trainer and what it delegates to (the worker builds the objective).
LOOP_MODULES = ("trainer.py", "windows.py", "results.py", "loop_state.py", "parts.py")
LOSS_MODULES = ("runner.components.chunked_loss", "runner.components.liger_loss", "runner.components.data.labels",
                "runner.components.data.instruct")


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", LOOP_MODULES)
def test_the_loop_imports_only_the_objective_interface(module):
    names = imported(TRAIN / module)
    objectives = {n for n in names if n.startswith("runner.components.objectives")}
    assert objectives <= {"runner.components.objectives.base"}, objectives
    assert not names & set(LOSS_MODULES), names & set(LOSS_MODULES)


def test_the_trainer_names_nothing_of_the_loss():
    text = (TRAIN / "trainer.py").read_text().lower()
    for word in ("cross_entropy", "cross-entropy", "labels", "ignore_index", "chunked", "token_losses", "perplexity"):
        assert word not in text, word


class Doubled(CausalLM):
    """A second objective, as a new module would hold it: the causal-LM loss times 2, and
    an evaluation figure of its own."""

    figures = ("doubled_eval_loss",)
    describe = Objective.describe  # the interface's line: its figures by name

    def __init__(self, setup: ObjectiveSetup) -> None:
        super().__init__(setup)
        self.seen: list[Any] = []

    def loss(self, model: Any, batch: dict[str, Any]) -> MicroBatchLoss:
        self.seen.append(model)
        inner = super().loss(model, batch)
        return MicroBatchLoss(inner.backward * 2, inner.logged * 2)

    def eval_figures(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"doubled_eval_loss": 2 * super().eval_figures(rows)["eval_loss"]}


def trainer_with(kind: Any, tmp_path: Path, accum: int) -> tuple[Trainer, list[dict[str, torch.Tensor]]]:
    """A one-process trainer whose objective the registry builds from `kind`, as the worker does."""
    tmp_path.mkdir()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    strategy = build_strategy(StrategySpec(), PrecisionSpec())
    accelerator = build_accelerator(strategy, grad_accum_steps=accum, max_grad_norm=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    objective = build_objective(kind, ObjectiveSetup(accelerator.unwrap_model(model), 1, accum))
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(accum):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    trainer = Trainer(Engine(accelerator, model, optimizer, scheduler, strategy), TrainData([], data), None,  # type: ignore[arg-type]
                      objective, LoopSettings(tmp_path))
    return trainer, data


def test_a_registered_objective_trains_and_evaluates_through_the_unchanged_loop(tmp_path, monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "doubled", Doubled)  # a new ObjectiveKind member and this line, in a real one
    accum = 2
    reference, data = trainer_with(ObjectiveKind.causal_lm, tmp_path / "causal_lm", accum)
    doubled, _ = trainer_with("doubled", tmp_path / "doubled", accum)
    assert type(reference.objective) is CausalLM and type(doubled.objective) is Doubled
    # its own figures, reported under its own names (the two models are equal before a step)
    expected = 2 * reference.evaluate()["eval_loss"]
    results = doubled._evaluate_and_log(None)
    assert results["doubled_eval_loss"] == expected and "eval_loss" not in results
    assert results["eval_samples"] == 2 * accum
    line = (tmp_path / "doubled" / "metrics.jsonl").read_text().strip()
    assert line.startswith('{"step": 0, "eval_doubled_eval_loss": ')  # the Trainer's eval_ prefix
    for trainer in (reference, doubled):
        # a token-weighted step's window, opened by the objective as the loop's windows are
        opened = trainer.objective.open_window(data, torch.device("cpu"), all_ranks=False)
        assert [trainer.train_step(batch) for batch in opened.batches] == [False, True]
        assert trainer.state.step == 1
    assert doubled.objective.seen == [doubled.model] * accum  # asked once a micro-batch, with the prepared model
    # the loss it returned is what was backwarded and logged: twice the causal LM's (a power of 2: exact)
    assert float(doubled.state.loss_sum) == 2 * float(reference.state.loss_sum) != 0
    assert float(doubled.grad_norm) == 2 * float(reference.grad_norm) != 0


def test_a_resume_at_the_last_step_finds_the_objectives_own_logged_figures(tmp_path, monkeypatch, compose_spec):
    """A resume that runs no step reuses the final evaluation metrics.jsonl logged, found
    by the names the run's objective reports (runner/train/resume.py: recorded_at_end)."""
    from dataclasses import replace

    from runner.train.resume import recorded_at_end

    monkeypatch.setitem(OBJECTIVES, "doubled", Doubled)
    spec = compose_spec("recipe=gpt2_clm_tiny")
    spec = replace(spec, train=replace(spec.train, objective="doubled"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 4, "loss": 3.0}\n{"step": 4, "eval_doubled_eval_loss": 5.5}\n')
    found = recorded_at_end(tmp_path, 4, spec, spec, eval_samples=16)
    assert found.source == "metrics.jsonl" and found.evaluation is not None
    assert found.evaluation["doubled_eval_loss"] == 5.5 and found.evaluation["eval_samples"] == 16
    causal = compose_spec("recipe=gpt2_clm_tiny")  # the same line holds none of the causal LM's figures
    assert recorded_at_end(tmp_path, 4, causal, causal, eval_samples=16).evaluation is None
