"""Sampling (runner/components/generation.py): each completion drawn by its own generator,
so it depends on its seed alone; its tokens drawn from the temperature's distribution; and
its recorded sampling log-probs equal the training pass's exact ones (whole logits,
log_softmax, runner/components/objectives/completion_scores.py) within 1e-5 in fp32."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.components.generation import _draw, sample_group, sample_seed
from runner.components.objectives.completion_scores import completion_logps, completion_rows

EOS = 7


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=2, n_head=2, eos_token_id=EOS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def test_a_draw_follows_the_distribution_and_never_takes_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3]])
    counts = torch.zeros(5)
    for seed in range(4000):
        counts[_draw(probs, [torch.Generator().manual_seed(seed)])] += 1
    share = counts / counts.sum()
    assert share[0] == 0 and share[2] == 0
    torch.testing.assert_close(share, probs[0], atol=0.03, rtol=0)  # 4,000 draws: ~4 standard deviations


def test_a_completion_depends_on_its_seed_alone():
    model, prompt = tiny_model(), [1, 2, 3]
    seeds = [sample_seed(0, 5, 11, i) for i in range(4)]
    group = sample_group(model, prompt, seeds, 6, 1.0, [EOS], 0)
    turned = sample_group(model, prompt, list(reversed(seeds)), 6, 1.0, [EOS], 0)
    assert torch.equal(group.completion_ids, turned.completion_ids.flip(0))
    assert torch.equal(group.logps, turned.logps.flip(0))
    other = sample_group(model, prompt, [sample_seed(0, 6, 11, i) for i in range(4)], 6, 1.0, [EOS], 0)
    assert not torch.equal(group.completion_ids, other.completion_ids)  # another generation, other draws
    assert sample_seed(0, 5, 11, 0) != sample_seed(0, 5, 12, 0) != sample_seed(1, 5, 11, 0)


def test_the_sampling_log_probs_are_the_training_passes_within_1e_5():
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5]]
    for temperature in (1.0, 0.7):
        for prompt in prompts:
            group = sample_group(model, prompt, [sample_seed(3, 0, 0, i) for i in range(4)], 8, temperature, [EOS], 0)
            assert bool((group.lengths >= 1).all())
            ended = group.ended
            # an ended completion's last token is the end-of-sequence, and it is counted
            assert all(int(group.completion_ids[i, int(group.lengths[i]) - 1]) == EOS for i in range(4) if ended[i])
            rows = completion_rows([prompt] * 4, group.completion_ids, group.lengths, 0)
            with torch.no_grad():
                exact, _ = completion_logps(model, rows, temperature)
            mask = rows.mask.bool()
            gap = (exact[mask] - group.logps[mask]).abs().max().item()
            assert gap < 1e-5, (temperature, prompt, gap)
            assert torch.equal(group.logps[~mask], torch.zeros_like(group.logps[~mask]))
