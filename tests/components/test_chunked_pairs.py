"""The preference loss over chunks of pairs (runner/components/chunked_pairs.py) against the
plain one from the whole logits: through DirectPreference, each sequence's log-probs,
the loss, the logged figures and every gradient, for a reference loss and a
reference-free one, chunks that do not divide the pairs, and an epoch's filler pair."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from runner.certify.architectures import TINY
from runner.components import chunked_pairs
from runner.components.chunked_loss import install
from runner.components.chunked_pairs import chunked_pair_loss, pairs_per_chunk
from runner.components.data.preference_batch import pad_pairs
from runner.components.model import build_config
from runner.components.objectives.base import ObjectiveSetup
from runner.components.objectives.dpo import DirectPreference
from runner.components.objectives.reference import Precomputed, sequence_logps
from runner.config.spec import ModelSpec, PreferenceLoss, PreferenceSpec

PAIRS = 5


def tiny_model(model_type: str) -> torch.nn.Module:
    config = build_config(ModelSpec(model_type=model_type, config_overrides=TINY[model_type]))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()  # eval: no dropout, so both see the same forward


def pairs(count: int, vocab: int) -> list[dict]:
    """Pairs of other prompt and answer lengths (so the batch pads)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(count):
        prompt = torch.randint(0, vocab, (2 + index % 3,), generator=generator).tolist()
        chosen = torch.randint(0, vocab, (1 + index % 4,), generator=generator).tolist()
        rejected = torch.randint(0, vocab, (3 + index % 2,), generator=generator).tolist()
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected,
                     "pair_index": index})
    return rows


def scored(model: torch.nn.Module, chunked, loss_type: str, batch: dict, table: torch.Tensor):
    """One micro-batch's loss through DirectPreference (a step of these pairs alone), its
    backward, and what it logged."""
    setup = ObjectiveSetup(model=model, processes=1, grad_accum_steps=1, chunked=chunked,
                           preference=PreferenceSpec(loss_type=PreferenceLoss(loss_type), beta=0.5),
                           reference=Precomputed({"train": table}, scored=True))
    objective = DirectPreference(setup)
    window = objective.open_window([dict(batch)], torch.device("cpu"), all_ranks=False)
    out = objective.loss(model, window.batches[0])
    out.backward.backward()
    return out


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_loss_figures_and_every_gradient_equal_the_whole_logits(model_type, loss_type, monkeypatch):
    plain = tiny_model(model_type)
    chunked_model = copy.deepcopy(plain)
    chunked, reason = install(chunked_model)
    assert reason is None, reason
    rows = pairs(PAIRS, vocab=plain.config.vocab_size)
    rows[3] = {**rows[3], "chosen_labels": [-100] * len(rows[3]["chosen_labels"]),
               "rejected_labels": [-100] * len(rows[3]["rejected_labels"])}  # an epoch's filler
    batch = pad_pairs(rows, pad_id=0)
    with torch.no_grad():
        logps, tokens = sequence_logps(plain, batch)
        table = torch.stack([logps[:PAIRS], logps[PAIRS:]], 1) + 0.3 * torch.randn(PAIRS, 2)  # a reference apart
    chunked_logps, chunked_tokens = sequence_logps(chunked_model, batch, chunked=chunked)
    torch.testing.assert_close(chunked_logps, logps, rtol=0, atol=1e-5)
    assert torch.equal(chunked_tokens, tokens)

    ours = None
    for chunk in (2, 1):  # 5 pairs: two chunks and a partial one; one pair a chunk
        chunked_model.zero_grad()
        # the chunk the head uses: fixed here, whatever the logit budget would give
        monkeypatch.setattr(chunked_pairs, "pairs_per_chunk", lambda *args, **kwargs: chunk)
        ours = scored(chunked_model, chunked, loss_type, batch, table)
        theirs = scored(plain, None, loss_type, batch, table)
        torch.testing.assert_close(ours.logged, theirs.logged, rtol=0, atol=1e-6)
        assert set(ours.metrics) == set(theirs.metrics)
        for name in theirs.metrics:
            torch.testing.assert_close(ours.metrics[name], theirs.metrics[name], rtol=0, atol=1e-5, msg=name)
        for (name, mine), (_, other) in zip(chunked_model.named_parameters(), plain.named_parameters()):
            assert mine.grad is not None and other.grad is not None, name
            torch.testing.assert_close(mine.grad, other.grad, rtol=1e-4, atol=1e-6, msg=name)
        plain.zero_grad()
    assert ours is not None and torch.isfinite(ours.logged) and abs(ours.logged.item()) > 1e-3


def test_a_head_with_a_bias_gets_its_gradients_and_no_grad_scores_only():
    """The head's bias gets its gradient like the weight; under no gradient the loss is
    zero and nothing is kept for backward."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    hidden = torch.randn(4, 6, 8, requires_grad=True)  # 2 pairs of 6 tokens
    labels = torch.randint(0, 11, (4, 6))
    labels[:, :2] = -100

    def pair_loss(chosen, rejected, chosen_tokens, rejected_tokens, among):
        return -torch.nn.functional.logsigmoid(chosen - rejected).sum()

    total, logps, tokens = chunked_pair_loss(hidden, head.weight, head.bias, labels, pair_loss, chunk=1)
    total.backward()
    mine = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None

    log_probs = torch.log_softmax(head(hidden)[:, :-1].float(), -1)
    target = labels[:, 1:]
    picked = log_probs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (target != -100)
    sums = picked.sum(-1)
    expected = -torch.nn.functional.logsigmoid(sums[:2] - sums[2:]).sum()
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(logps, sums.detach(), rtol=0, atol=1e-6)
    assert tokens.tolist() == [(target != -100).sum(-1)[i].item() for i in range(4)]
    for got, want in zip(mine, [hidden.grad, head.weight.grad, head.bias.grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        total, logps_again, _ = chunked_pair_loss(hidden, head.weight, head.bias, labels, None, chunk=2)
    assert total.item() == 0.0 and torch.equal(logps_again, logps)


def test_pairs_per_chunk_follows_the_logit_budget():
    assert pairs_per_chunk(50257, 1024) == 1  # a pair of GPT-2's 1,024-token sequences is 411 MB of logits
    # the certify matrix's 32-token pairs: 12.9 MB each; the budget alone would chunk 5,
    # the chunk's least tokens (MIN_CHUNK_TOKENS) hold 16
    assert pairs_per_chunk(50257, 32) == 16
    assert pairs_per_chunk(50257, 600) == 1  # two sequences of 600 tokens are over both
    assert pairs_per_chunk(100, 8) > 1000
