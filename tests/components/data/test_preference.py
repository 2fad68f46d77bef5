"""Preference records as token rows: TRL 1.16's DPOTrainer tokenization (its own code run
on the same records is the oracle), the one-line refusals, and over-long pairs
(runner/components/data/preference.py)."""

from __future__ import annotations

import copy
import gzip
import itertools
import json
from types import SimpleNamespace

import pytest

from runner.components.data.labels import IGNORE_INDEX
from runner.components.data.preference import fit_pair_to_block, preference_record_row
from runner.config.errors import UserError
from runner.config.paths import asset_path

NAMES = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}
WHERE = "train_file=pairs.jsonl"


@pytest.fixture(scope="module")
def gpt2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer as Llama 2 and Mistral have (a Metaspace "▁" before
    a text's first word, byte fallback, a BOS the tokenizer adds), its merges learnt from
    the embedded novels' first lines: the hub is offline (as tests/components/data/test_instruct.py
    builds it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    with gzip.open(asset_path("austen.txt.gz"), "rt") as handle:
        lines = [line.strip() for line in itertools.islice(handle, 400) if line.strip()]
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, special_tokens=special))
    learnt = json.loads(bpe.to_str())["model"]
    return LlamaTokenizer(vocab=learnt["vocab"], merges=[tuple(m) for m in learnt["merges"]], add_bos_token=True)


@pytest.fixture(scope="module")
def plain():
    return asset_path("chat_template_plain.jinja").read_text()


def pref_records(count: int) -> list[dict]:
    with gzip.open(asset_path("austen_pref.jsonl.gz"), "rt") as handle:
        return [json.loads(line) for line in itertools.islice(handle, count)]


def edge_records(eos: str) -> list[dict]:
    """Where tokenizing the pieces apart differs from TRL's joint text: a prompt ending in
    a space before a word (GPT-2's " yes" straddles the boundary), the same for the
    rejected answer only (" No" straddles, "  Indeed" does not: one boundary for both,
    the earlier), an answer that already ends with the EOS text, non-ASCII text."""
    return [{"prompt": "The answer is ", "chosen": "yes", "rejected": "no, it is not"},
            {"prompt": "Is it so? ", "chosen": " Indeed.", "rejected": "No."},
            {"prompt": "Say it:", "chosen": f" done{eos}", "rejected": " not yet"},
            {"prompt": "Café au lait?\n\n", "chosen": "Oui — s’il vous plaît.", "rejected": "Non."}]


def as_chat(record: dict, system: bool) -> dict:
    prompt = [{"role": "user", "content": record["prompt"].strip()}]
    if system:
        prompt = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Hello."},
                  {"role": "assistant", "content": "Good day."}] + prompt
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": record["chosen"]}],
            "rejected": [{"role": "assistant", "content": record["rejected"]}]}


def ultrafeedback_layout(record: dict, system: bool) -> dict:
    """The record as HuggingFaceH4/ultrafeedback_binarized holds one: the prompt as text
    (the user's last turn), `chosen` and `rejected` whole conversations that repeat the
    prompt's turns, and its other columns."""
    chat = as_chat(record, system)
    return {"prompt": chat["prompt"][-1]["content"], "prompt_id": f"{len(record['prompt']):064x}",
            "chosen": chat["prompt"] + chat["chosen"], "rejected": chat["prompt"] + chat["rejected"],
            "messages": chat["prompt"] + chat["chosen"], "score_chosen": 8.0, "score_rejected": 5.0}


def trl_prepared(tokenizer, records: list[dict], template: str | None = None) -> list[dict]:
    """TRL's own preprocessing of the records: DPOTrainer._prepare_dataset (extract prompt,
    add EOS, tokenize_fn, its prompt/completion boundary) with the template set as the
    tokenizer's, as a DPOTrainer given this tokenizer would run it. Its only use of the
    trainer is the tokenizer's EOS text."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = copy.deepcopy(tokenizer)
    if template is not None:
        tok.chat_template = template
    args = DPOConfig(output_dir="unused", max_length=None, use_cpu=True, bf16=False, report_to=[])
    prepared = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list(records), tok, args,
                                           "train")
    return [dict(example) for example in prepared]


def trl_rows(prepared: list[dict], **collator) -> list[tuple[list[int], list[int]]]:
    """TRL's DataCollatorForPreference on the prepared records: each sequence's ids and
    labels (its completion mask: the id where trained, -100 elsewhere), padding removed.
    The chosen rows first, then the rejected ones, in record order."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    batch = DataCollatorForPreference(pad_token_id=0, **collator)(prepared)
    rows = []
    for ids, attention, trained in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                       batch["completion_mask"].tolist()):
        length = sum(attention)
        rows.append((ids[:length], [i if t else IGNORE_INDEX for i, t in zip(ids[:length], trained[:length])]))
    return rows


def runner_rows(rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    return ([(r["chosen_input_ids"], r["chosen_labels"]) for r in rows]
            + [(r["rejected_input_ids"], r["rejected_labels"]) for r in rows])


# ---------------------------------------------------------------- TRL's tokenization
@pytest.mark.parametrize("family", ["gpt2", "metaspace"])
def test_text_records_are_trls_ids_and_completion_mask(request, family):
    """Plain strings: the prompt + answer + EOS text tokenized whole, with the tokenizer's
    special tokens (Llama's BOS, none for GPT-2), loss from TRL's boundary on."""
    tokenizer = request.getfixturevalue(family)
    records = pref_records(150) + edge_records(tokenizer.eos_token)
    ours = [preference_record_row(r, i, NAMES, tokenizer, None, WHERE) for i, r in enumerate(records)]
    assert runner_rows(ours) == trl_rows(trl_prepared(tokenizer, records))
    for row in ours:  # the EOS closes each answer and is trained; the BOS only where the tokenizer adds one
        assert row["chosen_input_ids"][-1] == row["chosen_labels"][-1] == tokenizer.eos_token_id
        assert (row["chosen_input_ids"][0] == tokenizer.bos_token_id) == (family == "metaspace")
        assert row["chosen_input_ids"].count(tokenizer.eos_token_id) == 1  # " done</s>": not twice
    straddle = ours[150]  # "The answer is " + "yes": GPT-2's " yes" is the first trained token
    if family == "gpt2":
        first = straddle["chosen_labels"].index(next(x for x in straddle["chosen_labels"] if x != IGNORE_INDEX))
        assert tokenizer.decode(straddle["chosen_input_ids"][first:]) == " yes<|endoftext|>"


@pytest.mark.parametrize("family, bos", [("gpt2", False), ("metaspace", False), ("metaspace", True)])
def test_chat_records_are_trls_ids_through_the_same_template(request, plain, family, bos):
    """Chat messages: the prompt with the generation prompt and prompt + answer rendered
    whole by the same template, no special tokens added (a template's own BOS appears
    once) and no EOS appended: the answer ends with what the template writes."""
    tokenizer = request.getfixturevalue(family)
    template = ("{{ bos_token }}" + plain) if bos else plain
    records = [as_chat(r, system=i % 3 == 0) for i, r in enumerate(pref_records(60) + edge_records(""))]
    ours = [preference_record_row(r, i, NAMES, tokenizer, template, WHERE) for i, r in enumerate(records)]
    assert runner_rows(ours) == trl_rows(trl_prepared(tokenizer, records, template))
    for row, record in zip(ours, records):
        assert row["chosen_input_ids"].count(tokenizer.bos_token_id) == bos
        answer = [i for i in row["chosen_labels"] if i != IGNORE_INDEX]
        text = tokenizer.decode(answer)  # a Metaspace decode drops a leading space: compared stripped
        assert text.endswith("\n\n") and text.strip() == record["chosen"][0]["content"].strip()  # the turn's end


@pytest.mark.parametrize("family", ["gpt2", "metaspace"])
def test_conversations_that_repeat_the_prompt_are_split_as_trls_maybe_extract_prompt(request, plain, family):
    """ultrafeedback_binarized's layout (the prompt as text beside conversations that repeat
    its turns, with a system turn and an earlier exchange in every third): the shared turns
    are the prompt, as TRL's maybe_extract_prompt splits them, and the rows are TRL's on the
    split records, and runner's on the same pairs given with the prompt as messages."""
    from trl.data_utils import maybe_extract_prompt

    tokenizer = request.getfixturevalue(family)
    pairs = pref_records(60) + edge_records("")
    records = [ultrafeedback_layout(r, system=i % 3 == 0) for i, r in enumerate(pairs)]
    ours = [preference_record_row(r, i, NAMES, tokenizer, plain, WHERE) for i, r in enumerate(records)]
    extracted = [maybe_extract_prompt({key: r[key] for key in ("prompt", "chosen", "rejected")}) for r in records]
    assert all(len(e["chosen"]) == len(e["rejected"]) == 1 for e in extracted)  # TRL's split: the answers' turn
    assert runner_rows(ours) == trl_rows(trl_prepared(tokenizer, extracted, plain))
    explicit = [preference_record_row(as_chat(r, system=i % 3 == 0), i, NAMES, tokenizer, plain, WHERE)
                for i, r in enumerate(pairs)]
    assert ours == explicit
    same = {**records[0], "rejected": records[0]["chosen"]}  # one conversation twice: its last turn is the answer
    assert preference_record_row(same, 0, NAMES, tokenizer, plain, WHERE)["same"] is True


@pytest.mark.parametrize("family", ["gpt2", "metaspace"])
def test_the_vendored_pairs_train_their_answers_only(request, family):
    """austen_pref.jsonl.gz's prompts end on a token boundary (one newline): TRL's loss
    starts right after the prompt's own ids, with no prompt token trained; no pair is
    the same answer twice."""
    tokenizer = request.getfixturevalue(family)
    for index, record in enumerate(pref_records(500)):
        row = preference_record_row(record, index, NAMES, tokenizer, None, WHERE)
        prompt = tokenizer(record["prompt"])["input_ids"]
        for side in ("chosen", "rejected"):
            ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
            assert ids[:len(prompt)] == prompt and labels[:len(prompt)] == [IGNORE_INDEX] * len(prompt)
            assert labels[len(prompt):] == ids[len(prompt):]
        assert not row["same"]


def test_a_chat_record_without_a_template_is_refused(gpt2):
    record = as_chat(pref_records(1)[0], system=False)
    with pytest.raises(UserError) as refused:
        preference_record_row(record, 3, NAMES, gpt2, None, WHERE)
    assert str(refused.value) == (
        "train_file=pairs.jsonl: record 3 is chat messages, and this tokenizer has no chat template (GPT-2's has "
        "none): set data.chat_template=<a .jinja file or the template itself>, e.g. "
        "data.chat_template=${asset:chat_template_plain.jinja}, runner's plain one.")


def test_a_pair_whose_answers_tokenize_alike_is_marked_same_not_refused(gpt2, plain):
    """Same text, and "x" against "x<|endoftext|>" (TRL appends the EOS text to one only),
    are the same rows; the caller drops and counts them."""
    eos = gpt2.eos_token
    pairs = [("It rained.", "It rained.", True), ("It rained.", f"It rained.{eos}", True),
             ("It rained.", "It rained!", False)]
    for chosen, rejected, same in pairs:
        row = preference_record_row({"prompt": "Weather?", "chosen": chosen, "rejected": rejected}, 0, NAMES, gpt2,
                                    None, WHERE)
        assert row["same"] is same
        assert (row["chosen_input_ids"] == row["rejected_input_ids"]) is same
    chat = as_chat({"prompt": "Weather?", "chosen": "It rained.", "rejected": "It rained."}, system=False)
    assert preference_record_row(chat, 0, NAMES, gpt2, plain, WHERE)["same"] is True


def test_the_records_own_field_names_are_read(gpt2):
    names = {"prompt_field": "question", "chosen_field": "good", "rejected_field": "bad"}
    record = pref_records(1)[0]
    renamed = {"question": record["prompt"], "good": record["chosen"], "bad": record["rejected"]}
    assert (preference_record_row(renamed, 0, names, gpt2, None, WHERE)
            == preference_record_row(record, 0, NAMES, gpt2, None, WHERE))


# ---------------------------------------------------------------- refusals, one line each
@pytest.mark.parametrize("record, message", [
    ({"prompt": "Hi", "chosen": "Hello."},
     "train_file=pairs.jsonl: record 7 has no 'rejected' (it has: prompt, chosen). Set data.rejected_field to the "
     "field that holds it, or fix the record."),
    ({"prompt": "Hi", "chosen": "", "rejected": "Go."},
     "train_file=pairs.jsonl: record 7's 'chosen' is empty (it has: prompt, chosen, rejected): a preference pair "
     "needs a prompt and two answers. Set data.chosen_field to the field that holds it, or fix or remove the record."),
    ({"prompt": [], "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant",
                                                                                    "content": "b"}]},
     "train_file=pairs.jsonl: record 7's 'prompt' is empty (it has: prompt, chosen, rejected): a preference pair "
     "needs a prompt and two answers. Set data.prompt_field to the field that holds it, or fix or remove the record."),
    ({"prompt": "Hi", "chosen": 5, "rejected": "Go."},
     "train_file=pairs.jsonl: record 7's 'prompt', 'chosen', 'rejected' must all be text, or all lists of {role, "
     "content} messages (the prompt's conversation, then each answer's assistant turns)."),
    ({"prompt": [{"role": "user", "content": "Hi"}], "chosen": "Hello.", "rejected": "Go."},
     "train_file=pairs.jsonl: record 7's 'prompt', 'chosen', 'rejected' must all be text, or all lists of {role, "
     "content} messages (the prompt's conversation, then each answer's assistant turns)."),
    ({"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]},
     "train_file=pairs.jsonl: record 7's 'prompt', 'chosen', 'rejected' must all be text, or all lists of {role, "
     "content} messages (the prompt's conversation, then each answer's assistant turns)."),
    ({"prompt": "Hi", "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]},
     "train_file=pairs.jsonl: record 7's 'prompt' is text and its 'chosen' and 'rejected' conversations start with "
     "no turn in common to be the prompt: give the prompt as messages (then each answer its assistant turns), or "
     "start both conversations with the prompt's turns."),
], ids=["missing", "empty-text", "empty-messages", "wrong-kind", "mixed-kinds", "message-without-content",
        "text-prompt-no-shared-turn"])
def test_a_bad_record_is_refused_in_one_line_naming_it(gpt2, plain, record, message):
    with pytest.raises(UserError) as refused:
        preference_record_row(record, 7, NAMES, gpt2, plain, WHERE)
    assert str(refused.value) == message
    assert "\n" not in refused.value.render()


# ---------------------------------------------------------------- over-long pairs
def test_a_pair_that_fits_is_kept_as_it_is(gpt2):
    row = preference_record_row(pref_records(1)[0], 0, NAMES, gpt2, None, WHERE)
    longest = max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))
    assert fit_pair_to_block(row, longest, "truncate") is row
    assert fit_pair_to_block(row, longest, "drop") is row
    assert fit_pair_to_block(row, longest - 1, "drop") is None


@pytest.mark.parametrize("family", ["gpt2", "metaspace"])
def test_truncation_cuts_the_prompts_start_as_trls_keep_end(request, family):
    """While each answer and one prompt token fit, each row is its last block_size
    tokens: TRL's collator with max_length=block_size, truncation_mode=keep_end."""
    tokenizer = request.getfixturevalue(family)
    records = pref_records(40)
    rows = [preference_record_row(r, i, NAMES, tokenizer, None, WHERE) for i, r in enumerate(records)]
    prepared = trl_prepared(tokenizer, records)
    longest_answer = max(len(p[side]) for p in prepared for side in ("chosen_ids", "rejected_ids"))
    for block_size in (longest_answer + 1, longest_answer + 9):
        fitted = [fit_pair_to_block(row, block_size, "truncate") for row in rows]
        assert any(f is not row for f, row in zip(fitted, rows))  # some were cut
        assert runner_rows(fitted) == trl_rows(prepared, max_length=block_size, truncation_mode="keep_end")


def test_an_answer_longer_than_the_block_keeps_its_start_after_the_prompts_last_token(gpt2):
    row = preference_record_row({"prompt": "Recite:", "chosen": " one two three four five six seven eight",
                                 "rejected": " nine"}, 0, NAMES, gpt2, None, WHERE)
    prompt = [i for i, label in zip(row["chosen_input_ids"], row["chosen_labels"]) if label == IGNORE_INDEX]
    answer = row["chosen_input_ids"][len(prompt):]
    fitted = fit_pair_to_block(row, 5, "truncate")
    assert fitted["chosen_input_ids"] == prompt[-1:] + answer[:4]
    assert fitted["chosen_labels"] == [IGNORE_INDEX] + answer[:4]
    assert gpt2.decode(fitted["chosen_input_ids"]) == ": one two three four"
    assert (fitted["rejected_input_ids"], fitted["rejected_labels"]) == (row["rejected_input_ids"],
                                                                         row["rejected_labels"])


# ---------------------------------------------------------------- recipe=qwen_dpo_lora's data, offline
ULTRAFEEDBACK_SPLITS = ("train_prefs", "train_sft", "test_prefs", "test_sft", "train_gen", "test_gen")


@pytest.fixture
def ultrafeedback_copy(tmp_path, monkeypatch):
    """A local stand-in for HuggingFaceH4/ultrafeedback_binarized (the hub is offline): its
    six splits as .jsonl files of its layout, 24 pairs in train_prefs and 6 in test_prefs,
    read by runner's load_raw through datasets' json builder in place of the hub."""
    from datasets import load_dataset

    import runner.components.data.prepare as data_module

    pairs = pref_records(30)
    files = {}
    for split in ULTRAFEEDBACK_SPLITS:
        chosen = pairs[24:] if split.startswith("test") else pairs[:24]
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(ultrafeedback_layout(r, system=False)) + "\n" for r in chosen))

    def from_hub(name, config=None):
        assert (name, config) == ("HuggingFaceH4/ultrafeedback_binarized", None)
        return load_dataset("json", data_files={split: str(path) for split, path in files.items()})

    monkeypatch.setattr(data_module, "load_dataset", from_hub)
    return pairs


def test_the_dpo_lora_recipe_reads_ultrafeedbacks_layout(compose_spec, ultrafeedback_copy, gpt2, plain):
    """recipe=qwen_dpo_lora's data settings: train_prefs trained, test_prefs evaluated (not
    held out of train), each pair's prompt the shared user turn and its answers the
    assistant's turns: the rows of the same pairs given as prompt messages and answers.
    GPT-2's tokenizer and runner's plain template stand in for Qwen's (offline)."""
    import dataclasses

    from runner.components.data.prepare import load_raw, preference_rows

    spec = compose_spec("recipe=qwen_dpo_lora")
    data = dataclasses.replace(spec.data, chat_template=plain)
    raw = load_raw(data)
    assert (len(raw["train"]), len(raw["validation"])) == (24, 6)
    rows, counts = preference_rows(raw, data, gpt2, spec.data.block_size, plain)
    assert (counts["train"]["pairs"], counts["validation"]["pairs"]) == (24, 6)
    expected = [preference_record_row(as_chat(r, system=False), i, NAMES, gpt2, plain, WHERE)
                for i, r in enumerate(ultrafeedback_copy)]
    got = list(rows["train"]) + list(rows["validation"])
    for row, want in zip(got, expected):
        for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
            assert row[key] == want[key]
    answer = [i for i in got[0]["chosen_labels"] if i != IGNORE_INDEX]
    assert gpt2.decode(answer).strip() == ultrafeedback_copy[0]["chosen"].strip()


def test_a_split_the_hub_dataset_lacks_is_refused_naming_those_it_has(compose_spec, ultrafeedback_copy):
    import dataclasses

    from runner.components.data.prepare import load_raw

    data = compose_spec("recipe=qwen_dpo_lora").data
    with pytest.raises(UserError) as refused:
        load_raw(dataclasses.replace(data, train_split="train"))
    assert str(refused.value) == (
        "HuggingFaceH4/ultrafeedback_binarized has no split 'train' (data.train_split); its splits: "
        f"{', '.join(ULTRAFEEDBACK_SPLITS)}. Set data.train_split to one of them.")
    held = load_raw(dataclasses.replace(data, validation_split=None))  # no `validation` split: 5% of train held out
    assert (len(held["train"]), len(held["validation"])) == (23, 1)


def test_chat_pairs_rendered_by_the_tokenizers_own_template_key_the_cache_with_it(gpt2, plain, tmp_path):
    """Two tokenizers that differ only in their chat template: a run of the second must not
    read the pairs the first one's template rendered (issue 61, 3)."""
    import copy

    from runner.components.data.prepare import prepare
    from runner.config.data_spec import DataFormat, DataSpec

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(as_chat(r, system=False)) + "\n" for r in pref_records(40)))
    first, second = copy.deepcopy(gpt2), copy.deepcopy(gpt2)
    first.chat_template = plain
    second.chat_template = plain.replace("### Assistant:", "### Reply:")  # the same but for one heading
    data = DataSpec(train_file=str(pairs), format=DataFormat.preference, validation_split_percentage=10,
                    cache_dir=str(tmp_path / "cache"))
    one, two = prepare(data, first, 256), prepare(data, second, 256)
    assert one.cache_path != two.cache_path
    assert "### Reply:" in gpt2.decode(two.train[0]["chosen_input_ids"])  # what the second's own template renders
    assert "### Reply:" not in gpt2.decode(one.train[0]["chosen_input_ids"])


def test_packing_is_not_in_the_preference_cache_key(gpt2, tmp_path):
    """Pairs are packed at collate time: a packed run reads a padded run's rows and its
    precomputed reference table, keyed by the data's key (issue 61, 10)."""
    from dataclasses import replace

    from runner.components.data.prepare import cache_key
    from runner.config.data_spec import DataFormat, DataSpec

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pref_records(10)))
    data = DataSpec(train_file=str(pairs), format=DataFormat.preference)
    assert cache_key(data, gpt2, 256) == cache_key(replace(data, packing=True), gpt2, 256)
    sft = DataSpec(train_file=str(pairs), format=DataFormat.prompt_completion, completion_field="chosen")
    assert cache_key(sft, gpt2, 256) != cache_key(replace(sft, packing=True), gpt2, 256)  # instruction rows are packed when built
