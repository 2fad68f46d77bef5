"""Packed preference pairs (data.packing=true: runner/components/preference_batch.pack_pairs):
the layout, each packed sequence's log-probs against the sequence alone on GPT-2, a
grouped-query Llama and Qwen3 (plain head and chunked head), and a micro-batch's loss,
figures and gradients against the padded layout, an epoch's filler pair included."""

from __future__ import annotations

import copy

import pytest
import torch
from test_chunked_pairs import scored, tiny_model

from runner.components import chunked_pairs
from runner.components.chunked_loss import install
from runner.components.data.epoch_batches import Filler, masking_fillers
from runner.components.data.preference_batch import SEQUENCE_IDS, answer_tokens, pack_pairs, pad_pairs
from runner.components.objectives.reference import sequence_logps

pytestmark = pytest.mark.unit

PAIRS = 5


def pairs(count: int, vocab: int) -> list[dict]:
    """Pairs of unequal prompt and answer lengths (one long answer sets the rows' width)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(count):
        prompt = torch.randint(0, vocab, (2 + index % 3,), generator=generator).tolist()
        chosen = torch.randint(0, vocab, (1 + index % 4 + 9 * (index == 1),), generator=generator).tolist()
        rejected = torch.randint(0, vocab, (3 + index % 2,), generator=generator).tolist()
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected,
                     "pair_index": 10 + index})
    return rows


def test_packing_puts_each_sequence_once_in_fewer_rows_no_wider_than_padding():
    rows = pairs(PAIRS, vocab=100)
    packed, padded = pack_pairs(rows, pad_id=0), pad_pairs(rows, pad_id=0)
    width = padded["input_ids"].shape[1]
    assert packed["input_ids"].shape[1] == width and packed["input_ids"].shape[0] < 2 * PAIRS
    owner, positions = packed[SEQUENCE_IDS], packed["position_ids"]
    for k, side in enumerate([(s, r) for s in ("chosen", "rejected") for r in rows]):
        ids = torch.tensor(side[1][f"{side[0]}_input_ids"])
        mask = owner == k
        assert torch.equal(packed["input_ids"][mask], ids), k  # whole, in order, in one row
        assert int(mask.any(dim=1).sum()) == 1
        assert torch.equal(positions[mask], torch.arange(len(ids)))
    assert torch.equal(packed["real_tokens"], (owner >= 0).sum(dim=1))
    assert torch.equal(packed["labels"][owner < 0], torch.full_like(packed["labels"][owner < 0], -100))
    assert torch.equal(packed["pair_index"], padded["pair_index"])
    assert torch.equal(answer_tokens(packed), answer_tokens(padded))


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "qwen3"])
def test_each_packed_sequence_scores_as_it_alone(model_type):
    model = tiny_model(model_type)
    chunked_model = copy.deepcopy(model)
    chunked, reason = install(chunked_model)
    assert reason is None, reason
    rows = pairs(PAIRS, vocab=model.config.vocab_size)
    packed = pack_pairs(rows, pad_id=0)
    assert packed["input_ids"].shape[0] < 2 * PAIRS  # some rows hold several sequences
    alone = []
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            for row in rows:
                one = {"input_ids": torch.tensor([row[f"{side}_input_ids"]]), "labels": torch.tensor([row[f"{side}_labels"]])}
                alone.append(sequence_logps(model, one)[0])
        alone_logps = torch.cat(alone)
        for chunked_head, scorer in ((None, model), (chunked, chunked_model)):
            logps, tokens = sequence_logps(scorer, packed, chunked=chunked_head)
            gap = (logps - alone_logps).abs().max().item()
            assert gap < 1e-5, (model_type, chunked_head is not None, gap)
            assert torch.equal(tokens, answer_tokens(pad_pairs(rows, pad_id=0)))
    assert alone_logps.abs().min() > 1.0  # real log-probs, not zeros


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])
@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_a_packed_micro_batch_trains_as_the_padded_one(head, loss_type, monkeypatch):
    """Loss, rewards/*, logps/* and every gradient, with pair 3 an epoch's filler (its
    sequences share rows with real ones and must train nothing)."""
    padded_model = tiny_model("llama")
    packed_model = copy.deepcopy(padded_model)
    chunked = None
    if head == "chunked":
        chunked, _ = install(packed_model)
        monkeypatch.setattr(chunked_pairs, "pairs_per_chunk", lambda *args, **kwargs: 2)  # 3 chunks of 5 pairs
    rows = pairs(PAIRS, vocab=padded_model.config.vocab_size)
    items = [Filler(row) if i == 3 else row for i, row in enumerate(rows)]
    packed = masking_fillers(lambda r: pack_pairs(r, pad_id=0))(items)
    padded = masking_fillers(lambda r: pad_pairs(r, pad_id=0))(items)
    assert int(answer_tokens(packed)[3]) == 0 and int(answer_tokens(packed)[PAIRS + 3]) == 0
    assert int(packed["real_tokens"].sum()) == int(padded["real_tokens"].sum())
    table = torch.randn(20, 2) * 0.3 - 20.0
    theirs = scored(padded_model, None, loss_type, padded, table)
    ours = scored(packed_model, chunked, loss_type, packed, table)
    torch.testing.assert_close(ours.logged, theirs.logged, rtol=0, atol=1e-5)
    for name in theirs.metrics:
        torch.testing.assert_close(ours.metrics[name], theirs.metrics[name], rtol=0, atol=1e-5, msg=name)
    for (name, mine), (_, other) in zip(packed_model.named_parameters(), padded_model.named_parameters()):
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert abs(ours.logged.item()) > 1e-3


def test_packed_pairs_through_the_chunked_head_train_under_bf16_autocast():
    """Llama's final norm hands the head fp32 hidden states while bf16 autocast makes the
    logits' gradient bf16: the packed path's hidden-state gradient, put back by position,
    must take the buffer's dtype (a DPO run with packed pairs, bf16 and Llama stopped with
    'Index put requires the source and destination dtypes match'; found by runner certify
    --joins). Its loss and gradients stay the padded batch's, to bf16's rounding."""
    padded_model, packed_model = tiny_model("llama"), tiny_model("llama")
    chunked, _ = install(packed_model)
    rows = pairs(PAIRS, vocab=padded_model.config.vocab_size)
    table = torch.randn(20, 2) * 0.3 - 20.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = scored(padded_model, None, "sigmoid", pad_pairs(rows, pad_id=0), table)
        ours = scored(packed_model, chunked, "sigmoid", pack_pairs(rows, pad_id=0), table)
    torch.testing.assert_close(ours.logged, theirs.logged, rtol=0, atol=2e-2)
    norms = [torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]).norm()
             for m in (packed_model, padded_model)]
    assert abs(norms[0] - norms[1]) <= 0.02 * norms[1]
