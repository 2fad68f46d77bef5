"""Instruction examples: the loss boundary, truncation, packing, and proofs on real
models that packing cannot leak (runner/components/data/instruct.py)."""

from __future__ import annotations

import pytest
import torch

from runner.components.data.instruct import (
    Example,
    build,
    chat_example,
    chat_spans,
    fit_to_block,
    pack,
    pad_batch,
    prompt_completion_example,
    record_examples,
    renderer,
    stack_packed,
)
from runner.components.data.labels import IGNORE_INDEX, model_inputs, real_tokens, token_losses
from runner.config.errors import UserError
from runner.config.paths import asset_path

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "No."}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))


@pytest.fixture(scope="module")
def plain():
    return asset_path("chat_template_plain.jinja").read_text()


def trained_text(tokenizer, example: Example) -> str:
    return tokenizer.decode([i for i, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


def test_the_completion_and_eos_are_trained_and_no_prompt_token_is(tokenizer):
    prompt, completion = "The capital of France is", " Paris."
    example = prompt_completion_example(tokenizer, prompt, completion)
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert example.input_ids[:n_prompt] == tokenizer(prompt)["input_ids"]
    assert example.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert example.labels[n_prompt] == example.input_ids[n_prompt] != IGNORE_INDEX  # the first completion token
    assert example.input_ids[-1] == example.labels[-1] == tokenizer.eos_token_id
    assert trained_text(tokenizer, example) == " Paris.<|endoftext|>"
    everything = prompt_completion_example(tokenizer, prompt, completion, train_on_prompt=True)
    assert everything.labels[1:] == everything.input_ids[1:] and everything.labels[0] == IGNORE_INDEX


def test_a_chat_trains_the_assistant_turns_only(tokenizer, plain):
    whole, spans = chat_spans(CHAT, renderer(tokenizer, plain))
    assert [whole[low:high] for low, high in spans] == ["Hello.\n\n", "No.\n\n"]
    example = chat_example(tokenizer, CHAT, plain)
    assert trained_text(tokenizer, example) == "Hello.\n\nNo.\n\n<|endoftext|>"
    assert tokenizer.decode(example.input_ids).startswith("### System:\nBe brief.")  # rendered once, no BOS added
    assert tokenizer.decode(example.input_ids).count("### Assistant:") == 2


def test_a_template_that_does_not_render_turn_by_turn_is_refused(tokenizer):
    reversed_turns = "{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(UserError, match="renders turn by turn"):
        chat_example(tokenizer, CHAT, reversed_turns)


def test_too_long_examples_are_truncated_keeping_the_answer_or_dropped():
    example = Example(list(range(10)), [IGNORE_INDEX] * 6 + [6, 7, 8, 9])  # 6 prompt tokens, 4 trained
    cut = fit_to_block(example, 6, "truncate")
    assert cut.input_ids == [4, 5, 6, 7, 8, 9] and cut.labels == [IGNORE_INDEX, IGNORE_INDEX, 6, 7, 8, 9]
    short = fit_to_block(example, 3, "truncate")  # the answer does not fit: one prompt token, then its start
    assert short.input_ids == [5, 6, 7] and short.labels == [IGNORE_INDEX, 6, 7]
    assert fit_to_block(example, 6, "drop") is None and fit_to_block(example, 10, "drop") is example
    rows, counts = build([example, Example([1, 2], [IGNORE_INDEX, 2])], 6, "truncate", packing=False, pad_id=0)
    assert (counts.examples, counts.truncated, counts.dropped, counts.tokens, counts.trained_tokens) == (2, 1, 0, 8, 5)
    _, dropped = build([example, Example([1, 2], [IGNORE_INDEX, 2])], 6, "drop", packing=False, pad_id=0)
    assert (dropped.examples, dropped.dropped) == (1, 1)


def test_packing_fills_rows_with_whole_examples_and_restarts_positions():
    examples = [Example([1, 2, 3], [IGNORE_INDEX, 2, 3]), Example([4, 5], [IGNORE_INDEX, 5]),
                Example([6, 7, 8, 9], [IGNORE_INDEX, 7, 8, 9])]
    rows = pack(examples, 6, pad_id=0)
    assert rows == [
        {"input_ids": [1, 2, 3, 4, 5, 0], "labels": [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5, IGNORE_INDEX],
         "position_ids": [0, 1, 2, 0, 1, 0], "real_tokens": 5},
        {"input_ids": [6, 7, 8, 9, 0, 0], "labels": [IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX, IGNORE_INDEX],
         "position_ids": [0, 1, 2, 3, 0, 1], "real_tokens": 4},
    ]
    _, counts = build(examples, 6, "truncate", packing=True, pad_id=0)
    assert counts.rows == 2 and counts.packing_efficiency == pytest.approx(9 / 12)


def test_rates_count_real_tokens_not_padding():
    examples = [Example([1, 2, 3], [IGNORE_INDEX, 2, 3]), Example([4, 5], [IGNORE_INDEX, 5]),
                Example([6, 7, 8, 9], [IGNORE_INDEX, 7, 8, 9])]
    packed = stack_packed(pack(examples, 6, pad_id=0))
    assert real_tokens(packed) == 9 and "real_tokens" not in model_inputs(packed)
    padded = pad_batch([{"input_ids": e.input_ids, "labels": e.labels} for e in examples], pad_id=0)
    assert padded["input_ids"].numel() == 12 and real_tokens(padded) == 9
    assert real_tokens({"input_ids": torch.zeros(2, 8, dtype=torch.long)}) == 16  # run_clm's blocks: all real


# ---------------------------------------------------------------- proofs on real models
ARCHS = ["gpt2", "llama", "qwen3"]  # absolute positions; rotary with grouped-query attention; rotary with QK-norm


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    from transformers import AutoModelForCausalLM

    from runner.certify.architectures import TINY
    from runner.components.model import build_config
    from runner.config.spec import ModelSpec

    torch.manual_seed(0)
    config = build_config(ModelSpec(model_type=request.param, config_overrides=TINY[request.param]))
    return AutoModelForCausalLM.from_config(config).eval()


def random_examples(seed: int, lengths: list[int], prompt: int = 3) -> list[Example]:
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for n in lengths:
        ids = torch.randint(0, 50000, (n,), generator=generator).tolist()
        examples.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return examples


def per_example_losses(model, rows: list[dict], packed: bool) -> list[float]:
    """Each example's mean token loss, read off the rows by its segments."""
    with torch.no_grad():
        batch = stack_packed(rows) if packed else pad_batch(rows, pad_id=0)
        losses, mask = token_losses(model(**model_inputs(batch)).logits, batch["labels"])
    out = []
    for r in range(len(rows)):
        starts = [i for i, p in enumerate(batch["position_ids"][r].tolist()) if p == 0] if packed else [0]
        bounds = starts + [batch["input_ids"].shape[1]]
        for lo, hi in zip(bounds, bounds[1:]):
            m = mask[r, lo:hi - 1]  # targets of tokens lo+1 .. hi-1: this segment's own
            if m.any():
                out.append((losses[r, lo:hi - 1].sum() / m.sum()).item())
    return out


def test_changing_one_example_leaves_every_other_examples_logits_in_its_row_unchanged(model):
    examples = random_examples(0, [9, 7, 11])
    rows = pack(examples, 32, pad_id=0)
    assert len(rows) == 1
    changed = [examples[0], random_examples(1, [7])[0], examples[2]]
    with torch.no_grad():
        before = model(**model_inputs(stack_packed(rows))).logits
        after = model(**model_inputs(stack_packed(pack(changed, 32, pad_id=0)))).logits
    same = list(range(0, 9)) + list(range(16, 27))  # the first and the third example's positions
    assert torch.equal(before[0, same], after[0, same])  # exact
    assert not torch.equal(before[0, 9:16], after[0, 9:16])  # the changed one did change


def test_packed_per_example_losses_equal_each_example_run_alone(model):
    examples = random_examples(2, [9, 7, 11, 5, 13])
    rows = pack(examples, 32, pad_id=0)
    assert len(rows) == 2  # several examples a row, and a second row
    alone = [per_example_losses(model, [{"input_ids": e.input_ids, "labels": e.labels}], packed=False)[0]
             for e in examples]
    assert per_example_losses(model, rows, packed=True) == pytest.approx(alone, abs=1e-5)


def test_packed_and_padded_token_weighted_losses_agree(model):
    examples = random_examples(3, [9, 7, 11, 5, 13, 6])
    with torch.no_grad():
        packed_batch = stack_packed(pack(examples, 32, pad_id=0))
        padded_batch = pad_batch([{"input_ids": e.input_ids, "labels": e.labels} for e in examples], pad_id=0)
        packed_losses, packed_mask = token_losses(model(**model_inputs(packed_batch)).logits, packed_batch["labels"])
        padded_losses, padded_mask = token_losses(model(**model_inputs(padded_batch)).logits, padded_batch["labels"])
    assert packed_mask.sum() == padded_mask.sum() == sum(len(e) - 3 for e in examples)
    packed = (packed_losses.sum() / packed_mask.sum()).item()
    padded = (padded_losses.sum() / padded_mask.sum()).item()
    assert packed == pytest.approx(padded, abs=1e-5)


# ---------------------------------------------------------------- settings
def test_instruction_settings_are_refused_where_they_cannot_work(compose_spec):
    from runner.config.validate import spec_problems

    def problems(*overrides: str, world: int = 1) -> str:
        return "\n".join(spec_problems(compose_spec("recipe=gpt2_sft_tiny", *overrides), world))

    assert problems() == ""
    assert "data.packing set with data.format=text" in problems("data.format=text",
                                                                "data.train_file=${asset:austen.txt.gz}")
    assert "data.streaming=true is for data.format=text" in problems("data.streaming=true")
    assert problems(world=2) == problems("train.grad_accum_steps=2") == ""  # token-weighted across micro-batches
    assert "reads .json or .jsonl records" in problems("data.train_file=${asset:austen.txt.gz}")
    assert "data.chat_template is for data.format=chat" in problems("data.chat_template=x")


def test_a_chat_without_a_template_is_refused_naming_the_plain_one(tokenizer):
    from runner.components.data.instruct import chat_template_text

    with pytest.raises(UserError, match=r"chat_template_plain.jinja"):
        chat_template_text(None, tokenizer)
    assert "### User:" in chat_template_text(str(asset_path("chat_template_plain.jinja")), tokenizer)
    assert chat_template_text("{{ messages }}", tokenizer) == "{{ messages }}"


def test_a_record_without_its_field_is_refused_naming_it(tokenizer):
    from runner.components.data.instruct import record_examples

    names = {"prompt_field": "prompt", "completion_field": "completion", "messages_field": "messages"}
    with pytest.raises(UserError, match=r"record 1 has no 'completion' \(it has: prompt, answer\).*data.completion_field"):
        record_examples([{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}], "prompt_completion",
                        names, tokenizer, None, False, "train data (x.jsonl)")


@pytest.mark.parametrize("arch, leaks", [("gpt2", False), ("llama", False), ("opt", True)])
def test_the_packing_probe_finds_a_model_that_lets_examples_attend_across(arch, leaks):
    """OPT reads its positions from the attention mask, not position_ids: packed, its
    examples see each other, and the probe says so."""
    from transformers import AutoModelForCausalLM

    from runner.certify.architectures import TINY
    from runner.components.data.instruct import packing_leak
    from runner.components.model import build_config
    from runner.config.spec import ModelSpec

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(ModelSpec(model_type=arch, config_overrides=TINY[arch])))
    gap = packing_leak(model.train(), 50257)
    assert (gap > 1e-3) is leaks, gap
    assert model.training  # left as it was


# ---------------------------------------------------------------- the text's own tokens
@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer as Llama 2 and Mistral have (transformers'
    LlamaTokenizer: BPE with byte fallback under a Metaspace pre-tokenizer, "▁" before a
    text's first word, a BOS), its merges learnt from the embedded novels' first lines:
    the hub is offline."""
    import gzip
    import itertools
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    with gzip.open(asset_path("austen.txt.gz"), "rt") as handle:
        lines = [line.strip() for line in itertools.islice(handle, 400) if line.strip()]
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]  # Llama's byte pieces
    bpe.train_from_iterator(lines + ["2+2=4"], trainers.BpeTrainer(vocab_size=600, special_tokens=special))
    learnt = json.loads(bpe.to_str())["model"]
    return LlamaTokenizer(vocab=learnt["vocab"], merges=[tuple(m) for m in learnt["merges"]], add_bos_token=True)


def sft_records(count: int) -> list[dict]:
    import gzip
    import itertools
    import json

    with gzip.open(asset_path("austen_sft.jsonl.gz"), "rt") as handle:
        return [json.loads(line) for line in itertools.islice(handle, count)]


def without_generation_tags(template: str) -> str:
    """The same template with no {% generation %} blocks: its answers are then found by
    rendering turn by turn (chat_spans) instead of transformers' assistant mask."""
    return template.replace("{% generation %}", "").replace("{% endgeneration %}\n", "")


def test_a_metaspace_tokenizer_trains_the_answers_own_tokens_not_a_leading_piece(metaspace):
    """SentencePiece puts "▁" before a text's first word: the answer "4" tokenized on its
    own is ['▁', '4'], after "2+2=" in the text it is ['4']."""
    example = prompt_completion_example(metaspace, "2+2=", "4")
    trained = [metaspace.convert_ids_to_tokens(i) for i, label in zip(example.input_ids, example.labels)
               if label != IGNORE_INDEX]
    assert trained == ["4", "</s>"]
    assert example.input_ids == metaspace("2+2=4")["input_ids"] + [metaspace.eos_token_id]
    records = sft_records(200)
    for record in records:
        example = prompt_completion_example(metaspace, record["prompt"], record["completion"])
        assert example.input_ids[:-1] == metaspace(record["prompt"] + record["completion"])["input_ids"]
        assert trained_text(metaspace, example) == record["completion"] + "</s>"


def test_byte_level_bpe_examples_are_the_prompts_ids_then_the_answers(tokenizer):
    """GPT-2's outputs as before: the prompt tokenized alone (a client's tokens at
    inference: its closing blank line one token, 628), then the answer's tokens."""
    for record in sft_records(200):
        example = prompt_completion_example(tokenizer, record["prompt"], record["completion"])
        prompt, answer = (tokenizer(record[key])["input_ids"] for key in ("prompt", "completion"))
        assert example.input_ids == prompt + answer + [tokenizer.eos_token_id]
        assert example.labels == [IGNORE_INDEX] * len(prompt) + answer + [tokenizer.eos_token_id]
    straddling = prompt_completion_example(tokenizer, "Q: ", "Paris")  # " Paris" is one token of the text
    assert straddling.input_ids[:-1] == tokenizer("Q: Paris")["input_ids"]
    assert trained_text(tokenizer, straddling) == " Paris<|endoftext|>"


@pytest.mark.parametrize("which", ["tokenizer", "metaspace"])
def test_a_chat_is_its_rendered_text_tokenized_once(which, plain, request):
    """The ids are the template's text as apply_chat_template tokenizes it (no space
    between the assistant header and the answer that the template never rendered), and
    the answers found by rendering turn by turn are those of the template's own
    assistant mask ({% generation %}, transformers)."""
    tokenizer = request.getfixturevalue(which)
    eos = tokenizer.eos_token
    text = renderer(tokenizer, plain)(CHAT)
    example = chat_example(tokenizer, CHAT, plain)
    assert tokenizer.decode(example.input_ids) == text + eos
    assert example.input_ids[:-1] == tokenizer.apply_chat_template(CHAT, chat_template=plain, tokenize=True,
                                                                   return_dict=True)["input_ids"]
    assert trained_text(tokenizer, example) == f"Hello.\n\nNo.\n\n{eos}"
    assert chat_example(tokenizer, CHAT, without_generation_tags(plain)) == example


def test_packing_stays_leak_free_on_metaspace_examples(metaspace, plain):
    """Examples built by the new path pack with restarting positions like any others."""
    from transformers import AutoModelForCausalLM

    from runner.certify.architectures import TINY
    from runner.components.model import build_config
    from runner.config.spec import ModelSpec

    records = sft_records(4)
    examples = [prompt_completion_example(metaspace, r["prompt"], r["completion"]) for r in records[:2]]
    examples += [chat_example(metaspace, r["messages"], plain) for r in records[2:]]
    torch.manual_seed(0)
    overrides = TINY["llama"] + f",vocab_size={len(metaspace)}"
    model = AutoModelForCausalLM.from_config(build_config(ModelSpec(model_type="llama", config_overrides=overrides)))
    rows = pack(examples, 512, pad_id=0)
    alone = [per_example_losses(model.eval(), [{"input_ids": e.input_ids, "labels": e.labels}], packed=False)[0]
             for e in examples]
    assert len(rows) < len(examples)
    assert per_example_losses(model, rows, packed=True) == pytest.approx(alone, abs=1e-5)


# ---------------------------------------------------------------- what a chat ends on
def test_a_chat_ends_its_example_on_its_last_answer(tokenizer, plain):
    """An EOS is trained only after an assistant turn: turns after the last answer are
    cut, a chat with no answer is left out; both are counted."""
    names = {"prompt_field": "prompt", "completion_field": "completion", "messages_field": "messages"}
    trailing = CHAT + [{"role": "user", "content": "Bye"}]
    unanswered = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    examples, counts = record_examples([{"messages": trailing}, {"messages": unanswered}, {"messages": CHAT}], "chat",
                                       names, tokenizer, plain, False, "train data (x.jsonl)")
    assert (len(examples), counts.no_answer, counts.turns_cut) == (2, 1, 1)
    assert examples[0] == examples[1] == chat_example(tokenizer, CHAT, plain)
    assert tokenizer.decode(examples[0].input_ids).endswith("### Assistant:\nNo.\n\n<|endoftext|>")


def test_the_counts_of_cut_and_unanswered_chats_are_reported_per_split(tmp_path, tokenizer, plain):
    """instruction_rows' counts (the banner and all_results.json's instruction_data), and
    the same rows on two tokenizing processes (data.preprocessing_num_workers) as on one."""
    import json

    from runner.components.data.prepare import instruction_rows, load_raw
    from runner.config.spec import DataFormat, DataSpec

    records = [{"messages": CHAT}, {"messages": CHAT + [{"role": "user", "content": "Bye"}]},
               {"messages": CHAT[:2]}] * 4
    for name, rows in (("train.jsonl", records), ("validation.jsonl", records[:3])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = {}
    for workers in (None, 2):
        data = DataSpec(train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "validation.jsonl"),
                        format=DataFormat.chat, preprocessing_num_workers=workers)
        blocks, counts = instruction_rows(load_raw(data), data, tokenizer, 256, plain)
        rows[workers] = blocks["train"]["input_ids"]
        assert {split: (c["examples"], c["no_answer"], c["turns_cut"]) for split, c in counts.items()} == \
            {"train": (8, 4, 4), "validation": (2, 1, 1)}
    assert rows[None] == rows[2]


# ---------------------------------------------------------------- data.chat_template
def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused(tokenizer):
    from runner.components.data.instruct import chat_template_text

    typo = str(asset_path("chat_tempalte_plain.jinja"))
    with pytest.raises(UserError) as refused:
        chat_template_text(typo, tokenizer)
    assert refused.value.problems == [
        f"data.chat_template={typo}: no such file, and not a template either (no {{{{ or {{%). Fix the path, e.g. "
        "data.chat_template=${asset:chat_template_plain.jinja}, or give the template's text."]


def test_a_chat_template_that_does_not_parse_is_refused_naming_its_line(tokenizer, tmp_path):
    from runner.components.data.instruct import chat_template_text

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}\n{{ message['content'] }}\n")  # no endfor
    with pytest.raises(UserError) as refused:
        chat_template_text(str(broken), tokenizer)
    (line,) = refused.value.problems
    assert line.startswith(f"data.chat_template={broken}: the template does not parse: line 2: Unexpected end of "
                           "template.") and "'endfor'" in line and "\n" not in line
    with pytest.raises(UserError, match=r"^data.chat_template: the template does not parse: line 1: .*'endif'"):
        chat_template_text("{% if messages %}{{ messages }}", tokenizer)


# ---------------------------------------------------------------- run_clm's settings
def test_text_settings_are_refused_with_instruction_formats(compose_spec):
    from runner.config.validate import spec_problems

    def problems(*overrides: str) -> list[str]:
        return spec_problems(compose_spec("recipe=gpt2_sft_tiny", *overrides))

    assert problems("data.text_column=text") == [
        "data.text_column=text is for data.format=text; data.format=prompt_completion reads data.prompt_field and "
        "data.completion_field. Set data.text_column=null (and name the records' fields there)."]
    assert problems("data.keep_linebreaks=false") == [
        "data.keep_linebreaks=false is for .txt files (data.format=text); data.format=prompt_completion reads JSON "
        "records, whose text keeps its line breaks. Remove the override."]
    assert problems("data.preprocessing_num_workers=2") == []  # honoured: the records are tokenized on 2


# Qwen2.5's layout, its end of turn written as the tokenizer's EOS (Qwen's <|im_end|> is its EOS)
CHATML_EOS = ("{%- for message in messages %}"
              "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
              "{%- if message['role'] == 'assistant' %}{{- eos_token + '\\n' }}{%- else %}{{- '<|im_end|>\\n' }}{%- endif %}"
              "{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("turns", [1, 2])
@pytest.mark.parametrize("which", ["tokenizer", "metaspace"])  # GPT-2's byte-level BPE; a SentencePiece-style one
def test_a_template_that_closes_a_turn_with_the_eos_and_a_newline_gets_no_second_eos(request, which, turns):
    """ChatML-style templates (Qwen's: <|im_end|> is its EOS) end an answer with the EOS and
    a newline; the example ends there, not with a second, trained EOS after the newline
    (issue 61, 11)."""
    from runner.components.data.instruct import chat_example

    tokenizer = request.getfixturevalue(which)
    messages = []
    for turn in range(turns):
        messages += [{"role": "user", "content": f"Question {turn}?"}, {"role": "assistant", "content": f"Answer {turn}."}]
    example = chat_example(tokenizer, messages, CHATML_EOS)
    eos = tokenizer.eos_token_id
    assert example.input_ids.count(eos) == turns  # one a turn, the template's own
    assert tokenizer.decode(example.input_ids).endswith(f"Answer {turns - 1}.{tokenizer.eos_token}\n")
    last = len(example.input_ids) - 1 - example.input_ids[::-1].index(eos)
    assert example.labels[last] == eos  # the answer's EOS is trained
    # A template that writes no EOS still gets one, trained, after the answer.
    plain = chat_example(tokenizer, messages, CHATML_EOS.replace("eos_token + ", "'<|im_end|>' + "))
    assert tokenizer.decode(plain.input_ids).endswith(f"<|im_end|>\n{tokenizer.eos_token}")
    assert plain.input_ids[-1] == eos and plain.labels[-1] == eos
