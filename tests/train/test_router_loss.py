"""A mixture of experts' router (load-balancing) loss under token weighting (instruction
data): only the cross-entropy is weighted by its share of the step's trained tokens; the
router term a model adds to it stays a mean per micro-batch, averaged over the step's
micro-batches (as the text format and transformers' Trainer have it). So one process at
8 rows and 4 rows x 2 accumulation train the same step, but for the router term's own
dependence on which rows share a micro-batch (its expert load is a product of means),
with the plain loss and with the chunked loss.

In-process, one Trainer.train_step per micro-batch on a tiny Mixtral (1 process, the
ddp path): no training run."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from runner.components.chunked_loss import install
from runner.components.data.labels import IGNORE_INDEX
from runner.components.objectives.base import ObjectiveSetup
from runner.components.objectives.causal_lm import CausalLM
from runner.config.spec import PrecisionSpec, StrategySpec
from runner.distributed.accelerator import build_accelerator, reset_accelerate_state
from runner.distributed.strategies import build_strategy
from runner.train.parts import Engine, LoopSettings, TrainData
from runner.train.trainer import Trainer

VOCAB = 128


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def mixtral(coefficient: float) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=32,
        router_jitter_noise=0.0, output_router_logits=True, router_aux_loss_coef=coefficient))


def prepared_mixtral(coefficient: float, accum: int, chunked: bool) -> tuple[Engine, object]:
    """The tiny mixture of experts prepared on one process under ddp, AdamW at a constant
    rate, and its chunked head (None when `chunked` is false): what a step is run on."""
    strategy = build_strategy(StrategySpec(), PrecisionSpec())
    accelerator = build_accelerator(strategy, grad_accum_steps=accum, max_grad_norm=0.0)
    model = mixtral(coefficient)
    head = install(model)[0] if chunked else None
    assert (head is not None) == chunked
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Engine(accelerator, model, optimizer, scheduler, strategy), head


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 12 tokens, answers of different lengths (prompts not trained)."""
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    for row in range(8):
        labels[row, : 2 + row] = IGNORE_INDEX
    return ids, labels


def trained(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def one_step(tmp_path: Path, coefficient: float, micro_batch: int, accum: int, chunked: bool,
             window: int | None = None, fillers: int = 0) -> tuple[float, float]:
    """One optimizer step of `window` (default: all `accum`) micro-batches of the rows, the
    last `fillers` of them fillers only (runner/components/data/epoch_batches.py: an epoch's end
    on another rank's layout); (the loss it logs, its gradient norm)."""
    window = window or accum
    engine, chunked_loss = prepared_mixtral(coefficient, accum, chunked)
    accelerator = engine.accelerator
    objective = CausalLM(ObjectiveSetup(accelerator.unwrap_model(engine.model), processes=1, grad_accum_steps=accum,
                                        chunked=chunked_loss))
    trainer = Trainer(engine, TrainData([], [], counts_real_tokens=True), SimpleNamespace(grad_accum_steps=accum),  # type: ignore[arg-type]
                      objective, LoopSettings(tmp_path))
    # A window cut short (an epoch's end): Accelerate's counter already stands where it ends.
    accelerator.step = accum - window
    ids, labels = rows()
    micro_batches = []
    for i in range(window):
        part = slice(i * micro_batch, (i + 1) * micro_batch)
        if i < window - fillers:
            micro_batches.append({"input_ids": ids[part], "labels": labels[part]})
        else:  # other rows' content (the epoch's first, in a run), trained on nowhere (masking_fillers)
            micro_batches.append({"input_ids": ids[-micro_batch:], "labels": torch.full_like(labels[:micro_batch], IGNORE_INDEX),
                                  "real_tokens": torch.zeros(micro_batch, dtype=torch.int64)})
    # The step's window as the trainer's loop opens it (runner/train/windows.py), on one process.
    opened = objective.open_window(micro_batches, torch.device("cpu"), all_ranks=False)
    for i, batch in enumerate(opened.batches):
        stepped = trainer.train_step(batch)
        assert stepped == (i == window - 1)
    assert trainer.state.loss_sum is not None and trainer.grad_norm is not None
    return float(trainer.state.loss_sum / trainer.state.loss_count), float(trainer.grad_norm)


def oracle(coefficient: float, micro_batch: int, micro_batches: int) -> tuple[float, float]:
    """The step as defined, by hand on the plain model: every micro-batch's summed
    cross-entropy over the step's trained tokens, plus the coefficient x the mean of the
    micro-batches' router losses; (its value, its gradient norm)."""
    model = mixtral(coefficient)
    ids, labels = rows()
    ids, labels = ids[: micro_batches * micro_batch], labels[: micro_batches * micro_batch]
    items = trained(labels)
    total = torch.zeros(())
    for i in range(micro_batches):
        part = slice(i * micro_batch, (i + 1) * micro_batch)
        out = model(input_ids=ids[part], labels=labels[part], num_items_in_batch=items)
        router = coefficient * out.aux_loss
        total = total + (out.loss - router) + router / micro_batches
    total.backward()
    return total.item(), math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


@pytest.mark.parametrize("chunked", [False, True], ids=["plain_loss", "chunked_loss"])
def test_accumulation_weights_the_cross_entropy_alone(tmp_path, chunked):
    """1 x 8 x 1 against 1 x 4 x 2 at Mixtral's own coefficient (0.001): the router term
    weighted twice gave a step-1 loss 2.0e-3 higher; now the gap is the router term's own
    (about 1e-6), as in the text format."""
    whole, halves = one_step(tmp_path, 1e-3, 8, 1, chunked), one_step(tmp_path, 1e-3, 4, 2, chunked)
    assert halves[0] == pytest.approx(whole[0], abs=1e-5)
    assert halves[1] == pytest.approx(whole[1], rel=1e-5)


@pytest.mark.parametrize("chunked", [False, True], ids=["plain_loss", "chunked_loss"])
@pytest.mark.parametrize("micro_batch, accum, window", [(8, 1, 1), (4, 2, 2), (4, 2, 1)],
                         ids=["8x1", "4x2", "4x2_cut_to_1"])
def test_the_step_is_the_cross_entropy_over_its_tokens_plus_the_mean_router_loss(tmp_path, chunked, micro_batch,
                                                                                   accum, window):
    """A large coefficient (0.5), so a misweighted router term moves the gradient too. A
    window cut short at an epoch's end averages the router loss over its own micro-batches."""
    loss, norm = one_step(tmp_path, 0.5, micro_batch, accum, chunked, window)
    expected_loss, expected_norm = oracle(0.5, micro_batch, window)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    assert norm == pytest.approx(expected_norm, rel=1e-5)


@pytest.mark.parametrize("chunked", [False, True], ids=["plain_loss", "chunked_loss"])
def test_a_micro_batch_of_fillers_adds_no_router_loss(tmp_path, chunked):
    """An epoch's end where the step's second micro-batch is fillers only (on two ranks,
    the second rank's last batch): the step is that of its one real micro-batch, router
    term included, as one process trains it. Counting the fillers' router loss in the
    mean halved the real one's and added the fillers' (the certify row
    mixtral_router_sft, 2 ranks against 1, was 1.8% apart in gradient norm at an epoch's end)."""
    loss, norm = one_step(tmp_path, 0.5, 4, 2, chunked, window=2, fillers=1)
    expected_loss, expected_norm = oracle(0.5, 4, 1)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    assert norm == pytest.approx(expected_norm, rel=1e-5)
