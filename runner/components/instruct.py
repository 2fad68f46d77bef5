"""Instruction data: prompt/completion pairs and chats as token ids with loss on the answer, packed.

Each example becomes `input_ids` and `labels` of equal length, labels -100 where no loss
is taken (the prompt, system and user turns, the template's markup before an answer).
The boundary is exact by construction: the prompt and the answer are tokenized
separately and their ids concatenated, so no token straddles the two; the first
answer token is trained and no prompt token is. An EOS closes each example.

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

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

IGNORE_INDEX = -100  # the label transformers' loss skips


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


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _close(example: Example, eos_id: Optional[int], train_on_prompt: bool) -> Example:
    """An EOS (trained) closes the example; the first token is never a target."""
    ids, labels = list(example.input_ids), list(example.labels)
    if eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)
        labels.append(eos_id)
    if train_on_prompt:
        labels = list(ids)
    if labels:
        labels[0] = IGNORE_INDEX
    return Example(ids, labels)


def prompt_completion_example(tokenizer: Any, prompt: str, completion: str, train_on_prompt: bool = False) -> Example:
    """The prompt's ids (with the tokenizer's own leading special tokens, e.g. Llama's BOS,
    once), then the completion's, then EOS. Loss on the completion and the EOS."""
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    completion_ids = _ids(tokenizer, completion)
    example = Example(prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids)
    return _close(example, tokenizer.eos_token_id, train_on_prompt)


def chat_segments(messages: Sequence[dict[str, str]], render: Callable[..., str]) -> list[tuple[str, bool]]:
    """The chat's rendered text cut into (text, trained) pieces: each assistant turn's text
    beyond what the template renders before it with the generation prompt (its content and
    end-of-turn markup) is trained; everything else is not. `render(messages,
    add_generation_prompt)` is the template. It must render each chat's start as a prefix
    of the whole: a template that does not cannot be masked exactly, and is refused."""
    from runner.config.errors import UserError

    whole = render(list(messages), add_generation_prompt=False)
    segments: list[tuple[str, bool]] = []
    done = 0  # characters of `whole` already cut
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(list(messages[:i]), add_generation_prompt=True)
        through = render(list(messages[: i + 1]), add_generation_prompt=False)
        if not (whole.startswith(through) and through.startswith(before) and len(before) >= done):
            raise UserError("the chat template does not render a chat's first turns as a prefix of the whole chat, "
                            "so the answer tokens cannot be found exactly. Give data.chat_template a template that "
                            "renders turn by turn (the documented plain template does).")
        segments += [(whole[done:len(before)], False), (whole[len(before):len(through)], True)]
        done = len(through)
    segments.append((whole[done:], False))
    return [(text, trained) for text, trained in segments if text]


def chat_example(tokenizer: Any, messages: Sequence[dict[str, str]], render: Callable[..., str],
                 train_on_prompt: bool = False) -> Example:
    """Each piece tokenized on its own (the template writes any BOS itself: no special
    tokens added, so none twice), loss on the assistant turns and the closing EOS."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in chat_segments(messages, render):
        piece = _ids(tokenizer, text)
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    return _close(Example(ids, labels), tokenizer.eos_token_id, train_on_prompt)


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
          pad_id: int) -> tuple[list[dict[str, list[int]]], Counts]:
    """Rows to train on, and what it took: examples fitted to the block, then packed (or
    one example a row, padded per batch at collate time)."""
    counts = Counts()
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


def real_tokens(batch: dict[str, Any]) -> int:
    """The batch's tokens that are not padding: what tokens/s and MFU count."""
    return int(row_real_tokens(batch).sum())


def row_real_tokens(batch: dict[str, Any]) -> Any:
    """Each row's tokens that are not padding. Packed rows carry their own count (as do
    a batch's fillers: runner/components/epoch_batches.py); padded ones, their attention
    mask; run_clm's blocks are all real."""
    import torch

    if "real_tokens" in batch:
        return batch["real_tokens"]
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1)
    rows, length = batch["input_ids"].shape
    return torch.full((rows,), length, dtype=torch.int64)


def model_inputs(batch: dict[str, Any], labels: bool = False, cache: bool = True) -> dict[str, Any]:
    """The forward's arguments for a batch (its labels only if asked). A packed batch
    (position ids, no attention mask) runs with no cache: a model that builds one (GPT-2
    does whenever use_cache is on, its config's default) skips the packed-sequence mask,
    and packed examples would attend to each other. tests/components/test_instruct.py
    fails on that leak. `cache=False` (model.compile): none either, as each layer's cache
    state is a guard that would recompile every layer. Otherwise the model's default
    stays: with neither cache nor mask, transformers looks for packed sequences in the
    position ids it makes, reading the device (a GPU sync a step)."""
    inputs = {k: v for k, v in batch.items() if (labels or k != "labels") and k != "real_tokens"}
    return {**inputs, "use_cache": False} if "position_ids" in batch or not cache else inputs


def token_losses(logits: Any, labels: Any) -> tuple[Any, Any]:
    """A forward's logits and its batch's labels as per-token next-token losses (fp32) and
    the mask of the trained ones, both aligned with labels[:, 1:] (zero where untrained):
    their sum over the mask's count is the token-weighted loss, which neither padding nor
    packing changes."""
    import torch

    logits = logits[:, :-1].float()  # a no-op in fp32; bf16/fp16 logits reduce in fp32
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - picked) * mask, mask


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
    tokenizer's own template; refused when there is none."""
    import os

    from runner.config.errors import UserError

    if setting:
        path = os.path.expanduser(setting)
        return open(path, encoding="utf-8").read() if os.path.isfile(path) else setting
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.chat_template)
    raise UserError("data.format=chat needs a chat template, and this tokenizer has none (GPT-2's has none): set "
                    "data.chat_template=<a .jinja file or the template itself>, e.g. "
                    "data.chat_template=${asset:chat_template_plain.jinja}, runner's plain one.")


def record_examples(records: Any, fmt: str, names: dict[str, str], tokenizer: Any, template: Optional[str],
                    train_on_prompt: bool, where: str) -> list[Example]:
    """Each record of a split as an Example. `names` maps the settings prompt_field,
    completion_field and messages_field to the records' field names. A record without
    its field, or with a value of the wrong kind, is refused naming the record."""
    from runner.config.errors import UserError

    render = renderer(tokenizer, template) if fmt == "chat" else None
    examples = []
    for index, record in enumerate(records):
        def value(setting: str) -> Any:
            name = names[setting]
            if record.get(name) is None:
                raise UserError(f"{where}: record {index} has no '{name}' (it has: {', '.join(record)}). Set "
                                f"data.{setting} to the field that holds it, or fix the record.")
            return record[name]

        if fmt == "prompt_completion":
            prompt, completion = value("prompt_field"), value("completion_field")
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise UserError(f"{where}: record {index}'s prompt and completion must be text.")
            examples.append(prompt_completion_example(tokenizer, prompt, completion, train_on_prompt))
        else:
            messages = value("messages_field")
            if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                         for m in messages):
                raise UserError(f"{where}: record {index}'s '{names['messages_field']}' must be a list of "
                                "{role, content} messages.")
            examples.append(chat_example(tokenizer, messages, render, train_on_prompt))  # type: ignore[arg-type]
    return examples


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
