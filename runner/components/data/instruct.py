"""Instruction data: prompt/completion pairs and chats as token ids with loss on the answer, packed.

Each example becomes `input_ids` and `labels` of equal length, labels -100 where no loss
is taken (the prompt, system and user turns, the template's markup before an answer).
The example's whole text (prompt + completion, or the rendered chat) is tokenized once,
as it is at inference, and the tokens whose characters overlap the answer's are
trained (the tokenizer's offsets; transformers' rule for a template's assistant mask).
Tokenizing the pieces apart and joining the ids is not the text's tokenization:
SentencePiece/Metaspace tokenizers (Llama 2, Mistral, Gemma) start every piece with a
"▁" the text does not have, and byte-level BPE (GPT-2) splits whitespace before a word
otherwise (a prompt's closing blank line is one token alone, two before the answer).
An EOS closes each example that ends on an answer; a chat's turns after its last
answer are cut, and a chat with no answer is left out (both counted).

Packing puts whole examples, in order, into rows of `block_size` tokens. Position ids
restart at 0 for each example: transformers reads restarts in `position_ids` (with no
attention mask) as packed sequences and masks attention block-diagonally
(masking_utils.find_packed_sequence_indices), so no example attends to another. The
first token of every example has label -100: it is not predicted from the previous
example's last token. The rest of a row is padding, labels -100, its own segment.
transformers skips that mask when the forward builds a cache, so the forward runs with
use_cache=False (model_inputs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from runner.components.data.labels import IGNORE_INDEX, model_inputs


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Counts:
    """What building the examples did, for the banner and all_results.json."""

    examples: int = 0
    no_answer: int = 0  # chats with no assistant turn: nothing to train, left out
    turns_cut: int = 0  # chats whose turns after the last assistant turn were cut
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0  # input tokens of the kept examples
    trained_tokens: int = 0  # tokens predicted with a loss (labels not -100)
    rows: int = 0
    row_capacity: int = 0  # rows x block_size when packed; the examples' tokens otherwise

    @property
    def trained_share(self) -> float:
        return self.trained_tokens / self.tokens if self.tokens else 0.0

    @property
    def packing_efficiency(self) -> float:
        """Non-padding tokens over the rows' capacity."""
        return self.tokens / self.row_capacity if self.row_capacity else 0.0


def trained_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Which tokens are trained: those whose characters [start, end) overlap a trained
    span, the rule transformers applies to a template's {% generation %} spans
    (apply_chat_template(return_assistant_tokens_mask=True)). A token straddling a span's
    edge is trained; a special token the tokenizer adds (a BOS) has no characters and is not."""
    return [any(end > low and start < high for low, high in spans) for start, end in offsets]


def _offsets(tokenizer: Any, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """`text`'s token ids and each token's characters [start, end) in it."""
    from runner.config.errors import UserError

    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"instruction data needs a fast tokenizer (character offsets: which tokens hold the answer); "
                        f"{type(tokenizer).__name__} is not one. Give model.tokenizer_name a tokenizer with a "
                        "tokenizer.json.")
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(encoding["input_ids"]), [tuple(pair) for pair in encoding["offset_mapping"]]


def encode(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool) -> Example:
    """`text` tokenized once, labels on the tokens over `spans` (characters of `text`)."""
    ids, offsets = _offsets(tokenizer, text, add_special_tokens)
    trained = trained_tokens(offsets, spans)
    return Example(ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, trained)])


def _closed_by_template(example: Example, eos_id: Optional[int], tokenizer: Any) -> bool:
    """Whether the template wrote the EOS in the last answer, only whitespace after it:
    ChatML-style templates (Qwen's, whose <|im_end|> is the EOS) end a turn with the EOS
    and a newline, and a second EOS after the newline would be trained too."""
    ids = example.input_ids
    if eos_id is None or eos_id not in ids:
        return False
    last = len(ids) - 1 - ids[::-1].index(eos_id)
    tail = ids[last + 1:]
    return example.labels[last] != IGNORE_INDEX and (not tail or not tokenizer.decode(tail).strip())


def _close(example: Example, eos_id: Optional[int], train_on_prompt: bool, tokenizer: Any = None) -> Example:
    """An EOS (trained) closes the example, unless the chat template closed its last answer
    with one (`tokenizer` given: _closed_by_template); the first token is never a target."""
    ids, labels = list(example.input_ids), list(example.labels)
    if tokenizer is not None and _closed_by_template(example, eos_id, tokenizer):
        pass  # the template's EOS, in the answer's span, is trained already
    elif eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)
        labels.append(eos_id)
    elif eos_id is not None:  # written by the template or the tokenizer's post-processor: trained all the same
        labels[-1] = eos_id
    if train_on_prompt:
        labels = list(ids)
    if labels:
        labels[0] = IGNORE_INDEX
    return Example(ids, labels)


def prompt_completion_example(tokenizer: Any, prompt: str, completion: str, train_on_prompt: bool = False) -> Example:
    """The prompt's ids as a client tokenizes it at inference (with the tokenizer's special
    tokens, e.g. Llama's BOS), then the completion's as the whole text tokenizes them
    after it (prompt + completion tokenized once, its tokens from the completion's first
    character on: no "▁" that SentencePiece gives a text of its own), then EOS. Loss on
    the completion and the EOS. Where a token of the whole text straddles the two (a
    prompt ending in a space before a word), the two do not join: the whole text's
    tokens, the straddling one trained."""
    boundary = len(prompt)
    ids, offsets = _offsets(tokenizer, prompt + completion, add_special_tokens=True)
    if any(start < boundary < end for start, end in offsets):
        example = encode(tokenizer, prompt + completion, [(boundary, boundary + len(completion))], True)
    else:
        first = next((i for i, (start, end) in enumerate(offsets) if start >= boundary and end > start), len(ids))
        prompt_ids = _offsets(tokenizer, prompt, add_special_tokens=True)[0]
        example = Example(prompt_ids + ids[first:], [IGNORE_INDEX] * len(prompt_ids) + ids[first:])
    return _close(example, tokenizer.eos_token_id, train_on_prompt)


def through_last_answer(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The chat up to and with its last assistant turn: what follows it has no answer to
    train, and an EOS after a user's text would teach the model to stop there. Empty
    when the chat has no assistant turn."""
    roles = [message.get("role") for message in messages]
    last = len(roles) - 1 - roles[::-1].index("assistant") if "assistant" in roles else -1
    return list(messages[:last + 1])


def chat_spans(messages: Sequence[dict[str, str]], render: Callable[..., str]) -> tuple[str, list[tuple[int, int]]]:
    """The chat's rendered text and the character spans trained in it: each assistant
    turn's text beyond what the template renders before it with the generation prompt
    (its content and end-of-turn markup). `render(messages, add_generation_prompt)` is
    the template. It must render each chat's start as a prefix of the whole: a template
    that does not cannot be masked exactly this way, and is refused (a template with
    {% generation %} blocks marks its answers itself: chat_example)."""
    from runner.config.errors import UserError

    whole = render(list(messages), add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    done = 0  # characters of `whole` already cut
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(list(messages[:i]), add_generation_prompt=True)
        through = render(list(messages[: i + 1]), add_generation_prompt=False)
        if not (whole.startswith(through) and through.startswith(before) and len(before) >= done):
            raise UserError("the chat template does not render a chat's first turns as a prefix of the whole chat, "
                            "so the answer tokens cannot be found exactly. Give data.chat_template a template that "
                            "renders turn by turn (the documented plain template does), or one that marks its "
                            "answers with {% generation %} ... {% endgeneration %}.")
        if len(through) > len(before):
            spans.append((len(before), len(through)))
        done = len(through)
    return whole, spans


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_example(tokenizer: Any, messages: Sequence[dict[str, str]], template: Optional[str],
                 train_on_prompt: bool = False) -> Example:
    """The rendered chat tokenized once (no special tokens added: the template writes any
    BOS itself), loss on the assistant turns and the closing EOS. A template with
    {% generation %} blocks gives its own assistant mask (transformers'
    return_assistant_tokens_mask), the library's way; most templates have none (Llama 3's,
    Qwen2.5's, Mistral's), and for them the answers are found by rendering turn by turn
    (chat_spans) and marked by the same rule on the tokenizer's offsets."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a chat example ends on an assistant turn (through_last_answer): an EOS after any other "
                         "turn would be trained")
    text = template if template is not None else str(getattr(tokenizer, "chat_template", "") or "")
    if GENERATION_TAG.search(text):
        out = tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        example = Example(ids, [token if mask else IGNORE_INDEX for token, mask in zip(ids, out["assistant_masks"])])
    else:
        whole, spans = chat_spans(messages, renderer(tokenizer, template))
        example = encode(tokenizer, whole, spans, add_special_tokens=False)
    return _close(example, tokenizer.eos_token_id, train_on_prompt, tokenizer)


def fit_to_block(example: Example, block_size: int, too_long: str) -> Optional[Example]:
    """An example longer than block_size: `drop` -> None; `truncate` -> cut from the left
    while the trained tokens still fit (the start of the prompt goes first), else keep the
    block that starts one token before the first trained token (so that token is still
    predicted) and cut its end."""
    if len(example) <= block_size:
        return example
    if too_long == "drop":
        return None
    trained = [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX]
    first = trained[0] if trained else len(example)
    start = len(example) - block_size if len(example) - first < block_size else max(first - 1, 0)
    ids, labels = example.input_ids[start:start + block_size], example.labels[start:start + block_size]
    labels[0] = IGNORE_INDEX
    return Example(ids, labels)


def pack(examples: Sequence[Example], block_size: int, pad_id: int) -> list[dict[str, list[int]]]:
    """Whole examples, in order, into rows of exactly block_size tokens: a row is closed
    (padded) when the next example does not fit. Position ids restart at each example;
    the padding is one more segment, labels -100. `real_tokens` is the row's tokens
    less its padding: what rates and MFU count (real_tokens)."""
    rows: list[dict[str, list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def close() -> None:
        pad = block_size - len(ids)
        rows.append({"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE_INDEX] * pad,
                     "position_ids": positions + list(range(pad)), "real_tokens": len(ids)})

    for example in examples:
        if len(example) > block_size:
            raise ValueError(f"an example of {len(example)} tokens is longer than a row ({block_size})")
        if len(ids) + len(example) > block_size:
            close()
            ids, labels, positions = [], [], []
        ids += example.input_ids
        labels += example.labels
        positions += list(range(len(example)))
    if ids:
        close()
    return rows


def build(examples: Sequence[Example], block_size: int, too_long: str, packing: bool,
          pad_id: int, counts: Optional[Counts] = None) -> tuple[list[dict[str, list[int]]], Counts]:
    """Rows to train on, and what it took: examples fitted to the block, then packed (or
    one example a row, padded per batch at collate time). `counts`: what reading the
    records counted already (examples_of)."""
    counts = counts or Counts()
    kept: list[Example] = []
    for example in examples:
        fitted = fit_to_block(example, block_size, too_long)
        if fitted is None:
            counts.dropped += 1
            continue
        counts.truncated += fitted is not example
        kept.append(fitted)
    counts.examples = len(kept)
    counts.tokens = sum(len(e) for e in kept)
    counts.trained_tokens = sum(sum(label != IGNORE_INDEX for label in e.labels) for e in kept)
    if packing:
        rows = pack(kept, block_size, pad_id)
        counts.row_capacity = len(rows) * block_size
    else:
        rows = [{"input_ids": e.input_ids, "labels": e.labels} for e in kept]
        counts.row_capacity = counts.tokens
    counts.rows = len(rows)
    return rows, counts


def pad_batch(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Unpacked rows padded on the right to the longest in the batch: labels -100 and
    attention mask 0 on the padding."""
    import torch

    longest = max(len(r["input_ids"]) for r in rows)

    def padded(values: Any, fill: int) -> list[int]:
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        return values + [fill] * (longest - len(values))

    return {
        "input_ids": torch.tensor([padded(r["input_ids"], pad_id) for r in rows]),
        "labels": torch.tensor([padded(r["labels"], IGNORE_INDEX) for r in rows]),
        "attention_mask": torch.tensor([padded([1] * len(r["input_ids"]), 0) for r in rows]),
    }


def stack_packed(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Packed rows (all block_size long): ids, labels and the restarting position ids; no
    attention mask, so transformers derives the block-diagonal one from the positions.
    `real_tokens` (one a row) is not a model input: model_inputs leaves it out."""
    import torch

    keys = ("input_ids", "labels", "position_ids", "real_tokens")
    return {key: torch.stack([torch.as_tensor(r[key]) for r in rows]) for key in keys}


def renderer(tokenizer: Any, template: Optional[str]) -> Callable[..., str]:
    """The chat template as a function of (messages, add_generation_prompt): `template`
    (Jinja text) if given, else the tokenizer's own."""

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not messages and not add_generation_prompt:
            return ""
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    return render


def chat_template_text(setting: Optional[str], tokenizer: Any) -> str:
    """data.chat_template as Jinja text: a file's contents, the setting itself, else the
    tokenizer's own template; refused when there is none, when the setting names no file
    and holds no template syntax (a mistyped path would be rendered as the text of every
    chat), and when the template does not parse."""
    import os

    from runner.config.errors import UserError

    if setting:
        path = os.path.expanduser(setting)
        if os.path.isfile(path):
            text, source = open(path, encoding="utf-8").read(), f"data.chat_template={setting}"
        elif "{{" in setting or "{%" in setting:
            text, source = setting, "data.chat_template"
        else:
            raise UserError(f"data.chat_template={setting}: no such file, and not a template either (no {{{{ or {{%). "
                            "Fix the path, e.g. data.chat_template=${asset:chat_template_plain.jinja}, or give the "
                            "template's text.")
    elif getattr(tokenizer, "chat_template", None):
        text, source = str(tokenizer.chat_template), "the tokenizer's chat template"
    else:
        raise UserError("data.format=chat needs a chat template, and this tokenizer has none (GPT-2's has none): set "
                        "data.chat_template=<a .jinja file or the template itself>, e.g. "
                        "data.chat_template=${asset:chat_template_plain.jinja}, runner's plain one.")
    _check_syntax(text, source, tokenizer)
    return text


def _check_syntax(text: str, source: str, tokenizer: Any) -> None:
    """A template that does not parse, refused in one line with jinja2's line and message.
    Parsed by rendering a short chat through transformers (its Jinja environment has the
    {% generation %} tag and loop controls that plain jinja2 lacks). Only syntax is judged
    here: a template's own refusals (roles that must alternate) are about records."""
    import jinja2

    from runner.config.errors import UserError

    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        tokenizer.apply_chat_template(chat, chat_template=text, tokenize=False)
    except jinja2.TemplateSyntaxError as err:
        message = (err.message or type(err).__name__).rstrip(".")
        raise UserError(f"{source}: the template does not parse: line {err.lineno}: {message}. Fix the "
                        "template.") from None
    except jinja2.TemplateError:
        pass


def record_example(record: dict[str, Any], index: int, fmt: str, names: dict[str, str], tokenizer: Any,
                   template: Optional[str], train_on_prompt: bool, where: str) -> dict[str, Any]:
    """One record as a row: its example's `input_ids` and `labels` (empty for a chat with
    no assistant turn), `answered` and `turns_cut`. `names` maps the settings
    prompt_field, completion_field and messages_field to the records' field names. A
    record without its field, or with a value of the wrong kind, is refused naming it.
    A function of the record alone, so datasets' map can run it on several processes
    (data.preprocessing_num_workers)."""
    from runner.config.errors import UserError

    def value(setting: str) -> Any:
        name = names[setting]
        if record.get(name) is None:
            raise UserError(f"{where}: record {index} has no '{name}' (it has: {', '.join(record)}). Set "
                            f"data.{setting} to the field that holds it, or fix the record.")
        return record[name]

    cut = False
    if fmt == "prompt_completion":
        prompt, completion = value("prompt_field"), value("completion_field")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise UserError(f"{where}: record {index}'s prompt and completion must be text.")
        example: Optional[Example] = prompt_completion_example(tokenizer, prompt, completion, train_on_prompt)
    else:
        messages = value("messages_field")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                     for m in messages):
            raise UserError(f"{where}: record {index}'s '{names['messages_field']}' must be a list of "
                            "{role, content} messages.")
        answered = through_last_answer(messages)
        cut = 0 < len(answered) < len(messages)
        example = chat_example(tokenizer, answered, template, train_on_prompt) if answered else None
    return {"input_ids": example.input_ids if example else [], "labels": example.labels if example else [],
            "answered": example is not None, "turns_cut": cut}


def examples_of(rows: Any) -> tuple[list[Example], Counts]:
    """record_example's rows as examples, and the counts of chats left out or cut."""
    counts, examples = Counts(), []
    for row in rows:
        counts.no_answer += not row["answered"]
        counts.turns_cut += bool(row["turns_cut"])
        if row["answered"]:
            examples.append(Example(list(row["input_ids"]), list(row["labels"])))
    return examples, counts


def record_examples(records: Any, fmt: str, names: dict[str, str], tokenizer: Any, template: Optional[str],
                    train_on_prompt: bool, where: str) -> tuple[list[Example], Counts]:
    """Each record of a split as an Example, in one process (record_example)."""
    return examples_of(record_example(record, index, fmt, names, tokenizer, template, train_on_prompt, where)
                       for index, record in enumerate(records))


def packing_leak(model: Any, vocab_size: int) -> float:
    """How far packing moves an example's logits on this model: two short examples packed
    in one row (position ids restarting) against the second run alone, in eval mode (no
    dropout); the largest logit difference. 0 (to rounding) where the model honours the
    restart (transformers' packed-sequence mask); large where it attends across
    examples or reads positions elsewhere (OPT derives them from the attention mask).
    Every rank runs it (a sharded model's forward is collective)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, vocab_size, (1, 6), generator=generator) for _ in range(2))
    device = next(model.parameters()).device
    packed = {"input_ids": torch.cat([first, second], dim=1).to(device),
              "position_ids": torch.tensor([list(range(6)) * 2], device=device)}
    alone = {"input_ids": second.to(device), "position_ids": torch.arange(6, device=device).unsqueeze(0)}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            together = model(**model_inputs(packed)).logits[0, 6:].float()
            apart = model(**model_inputs(alone)).logits[0].float()
    finally:
        model.train(was_training)
    return float((together - apart).abs().max() / apart.abs().max().clamp(min=1.0))


def check_packing(model: Any, vocab_size: int, precision: str, describe: str) -> None:
    """Refuse packing on a model whose forward lets packed examples see each other:
    logits moved by more than rounding (fp32: 1e-3 of their scale; bf16/fp16, whose
    kernels round per shape: 5e-2)."""
    from runner.config.errors import UserError

    gap = packing_leak(model, vocab_size)
    if gap > (1e-3 if precision == "fp32" else 5e-2):
        raise UserError(f"data.packing=true: on this {describe} packed examples attend to each other (a probe moved "
                        f"an example's logits by {gap:.2g} of their scale): its forward does not restart attention at "
                        "the position ids (transformers' packed-sequence mask). Set data.packing=false: one example a "
                        "row, padded, which is exact on any model.")
