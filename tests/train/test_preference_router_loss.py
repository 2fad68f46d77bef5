"""DPO on a mixture of experts adds the router (load-balancing) loss (issue 61, 4), as TRL
1.16's DPOTrainer adds `router_aux_loss_coef x aux_loss` of each forward: once a
micro-batch, a mean over the step's micro-batches that hold a real pair (on all ranks),
as the causal-LM objective weights it (runner/components/objectives/token_weighting.py).

In-process, one Trainer.train_step per micro-batch on a tiny Mixtral (1 process, the ddp
path), against the step computed by hand on the plain model: no training run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_router_loss import VOCAB, mixtral, prepared_mixtral

from runner.components.data.labels import IGNORE_INDEX
from runner.components.data.preference_batch import pad_pairs
from runner.components.objectives.base import ObjectiveSetup
from runner.components.objectives.dpo import DirectPreference
from runner.components.objectives.preference_loss import pair_terms, sequence_logps
from runner.components.objectives.reference import Reference
from runner.config.preference_spec import PreferenceSpec
from runner.distributed.accelerator import reset_accelerate_state
from runner.train.parts import LoopSettings, TrainData
from runner.train.trainer import Trainer

PAIRS = 4
LAST: dict = {}  # the last one_step's loop state


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


class Fixed(Reference):
    """Reference log-probs given per pair: (chosen, rejected) of pair i = (-i, -2i)."""

    def logps(self, model, batch, split):
        index = batch["pair_index"].double()
        return torch.cat([-index, -2 * index]).float()


def pair_rows() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(PAIRS):
        prompt = torch.randint(0, VOCAB, (4 + i % 2,), generator=generator).tolist()
        chosen = torch.randint(0, VOCAB, (3 + i,), generator=generator).tolist()
        rejected = torch.randint(0, VOCAB, (5 - i % 3,), generator=generator).tolist()
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [IGNORE_INDEX] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected,
                     "rejected_labels": [IGNORE_INDEX] * len(prompt) + rejected, "pair_index": i})
    return rows


def one_step(tmp_path: Path, coefficient: float, per_micro_batch: int, chunked: bool) -> tuple[float, float]:
    accum = PAIRS // per_micro_batch
    engine, head = prepared_mixtral(coefficient, accum, chunked)
    objective = DirectPreference(ObjectiveSetup(engine.accelerator.unwrap_model(engine.model), processes=1,
                                                grad_accum_steps=accum, chunked=head, preference=PreferenceSpec(),
                                                reference=Fixed()))
    trainer = Trainer(engine, TrainData([], [], counts_real_tokens=True),
                      type("Plan", (), {"grad_accum_steps": accum})(), objective, LoopSettings(tmp_path))  # type: ignore[arg-type]
    rows = pair_rows()
    window = [pad_pairs(rows[i:i + per_micro_batch], 0) for i in range(0, PAIRS, per_micro_batch)]
    opened = objective.open_window(window, torch.device("cpu"), all_ranks=False)
    for i, batch in enumerate(opened.batches):
        assert trainer.train_step(batch) == (i == accum - 1)
    LAST["state"] = trainer.state
    return float(trainer.state.loss_sum / trainer.state.loss_count), float(trainer.grad_norm)


def oracle(coefficient: float, per_micro_batch: int) -> tuple[float, float]:
    """By hand: DPO's sigmoid loss, the mean over the step's pairs, plus the coefficient x
    the mean of the micro-batches' router losses (each micro-batch's forward over its
    2P sequences, padding masked, as TRL's concatenated forward computes it)."""
    model = mixtral(coefficient)
    rows = pair_rows()
    total = torch.zeros(())
    micro_batches = PAIRS // per_micro_batch
    for i in range(0, PAIRS, per_micro_batch):
        batch = pad_pairs(rows[i:i + per_micro_batch], 0)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logps, tokens = sequence_logps(out.logits, batch["labels"], batch)
        p = per_micro_batch
        index = batch["pair_index"].float()
        terms = pair_terms(PreferenceSpec(), logps[:p], logps[p:], tokens[:p], tokens[p:], -index, -2 * index)
        total = total + terms.loss.sum() / PAIRS + coefficient * out.aux_loss / micro_batches
    total.backward()
    return total.item(), math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


def test_the_router_coefficient_moves_the_gradient(tmp_path):
    """0.01 against 10: the same gradient norm (1.0734 in the issue) meant the router loss
    was never added."""
    small, large = one_step(tmp_path, 0.01, 4, False), one_step(tmp_path, 10.0, 4, False)
    assert abs(small[1] - large[1]) > 1e-3 * small[1]


@pytest.mark.parametrize("chunked", [False, True], ids=["plain_head", "chunked_head"])
@pytest.mark.parametrize("per_micro_batch", [4, 2], ids=["4x1", "2x2"])
def test_the_step_is_the_pair_mean_plus_the_mean_router_loss(tmp_path, chunked, per_micro_batch):
    loss, norm = one_step(tmp_path, 0.5, per_micro_batch, chunked)
    expected_loss, expected_norm = oracle(0.5, per_micro_batch)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    assert norm == pytest.approx(expected_norm, rel=1e-5)


def test_the_step_logs_its_mean_router_loss_as_trl_does(tmp_path):
    """aux_loss: the mean of the micro-batches' router losses (TRL's name); the loss holds it
    times the coefficient beside the pairs' mean."""
    loss, _ = one_step(tmp_path, 0.5, 2, False)
    # the router loss alone, by hand: each micro-batch's forward over its pairs
    model = mixtral(0.5)
    rows = pair_rows()
    auxes = [model(**{k: v for k, v in pad_pairs(rows[i:i + 2], 0).items() if k in ("input_ids", "attention_mask")})
             .aux_loss.item() for i in (0, 2)]
    state = LAST["state"]
    assert float(state.metric_sums["aux_loss"] / state.loss_count) == pytest.approx(sum(auxes) / 2, rel=1e-5)
