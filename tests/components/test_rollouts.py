"""The prompt stream and the prompts' tokens (runner/components/rollouts.py): every prompt
once an epoch, in an order from (seed, epoch) alone, a generation batch running on into
the next epoch where the prompts do not divide it; a text prompt sent as a chat message
with rl.chat_prompts."""

from __future__ import annotations

from transformers import AutoTokenizer

from runner.components.rollouts import StreamLayout, prompt_order, prompt_tokens, prompts_of_generation
from runner.config.paths import asset_path


def test_every_prompt_once_an_epoch_and_a_generation_runs_on_into_the_next():
    layout = StreamLayout(prompts=6, group=4, global_batch=16, steps_per_generation=1, iterations=1)
    assert layout.groups_per_generation == 4 and layout.steps_per_epoch == 2  # 6 prompts x 4 / 16, rounded up
    stream = [p for g in range(3) for p in prompts_of_generation(layout, 7, g)]  # 12 groups: two epochs
    assert sorted(stream[:6]) == sorted(stream[6:]) == list(range(6))
    assert stream[:6] == prompt_order(6, 7, 0) and stream[6:] == prompt_order(6, 7, 1)
    assert prompt_order(6, 7, 0) != prompt_order(6, 7, 1) and prompt_order(6, 7, 0) != prompt_order(6, 8, 0)


def test_a_step_maps_to_its_generation_and_share():
    layout = StreamLayout(prompts=10, group=4, global_batch=8, steps_per_generation=2, iterations=2)
    # each generation trains 2 shares, twice over: steps 0-3 generation 0 (shares 0, 1, 0, 1)
    assert [layout.generation_of(s) for s in range(6)] == [0, 0, 0, 0, 1, 1]
    assert [layout.share_of(s) for s in range(6)] == [0, 1, 0, 1, 0, 1]


def test_a_text_prompt_goes_through_the_chat_template_with_chat_prompts():
    tokenizer = AutoTokenizer.from_pretrained(asset_path("gpt2_tokenizer"))
    tokenizer.chat_template = asset_path("chat_template_plain.jinja").read_text()
    text = "What is 2 + 2?"
    assert prompt_tokens(tokenizer, text) == tokenizer(text)["input_ids"]
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    assert prompt_tokens(tokenizer, text, as_chat=True) == templated != tokenizer(text)["input_ids"]
