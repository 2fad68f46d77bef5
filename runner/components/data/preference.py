"""Preference data: a prompt with a chosen and a rejected answer, as two token rows with
loss on the answers, tokenized exactly as TRL 1.16's DPOTrainer tokenizes them.

TRL's rules (trl/trainer/dpo_trainer.py `_prepare_dataset` and its `tokenize_fn`,
trl/data_utils.py `_tokenize` and `common_prefix_length`), followed here one for one:
- Plain text: the tokenizer's EOS *text* is appended to the chosen and to the rejected
  answer unless it already ends them (`add_eos`). Then three texts are tokenized, each
  whole, with the tokenizer's own special tokens (`tokenizer(text)`: Llama's BOS, none
  for GPT-2): the prompt, prompt + chosen, prompt + rejected.
- Chat messages: the same three through the chat template (`apply_chat_template`,
  tokenize=True, which adds no special tokens: a BOS is the template's to write): the
  prompt with the generation prompt, then prompt + chosen and prompt + rejected as whole
  conversations. No EOS is appended: an answer ends with what the template writes after
  an assistant turn (Qwen's <|im_end|>; runner's plain template writes a blank line and
  no EOS, so with it a chat answer teaches no stop).
- Chat answers that repeat the prompt's turns, beside the prompt as text
  (HuggingFaceH4/ultrafeedback_binarized: `prompt` a string, `chosen` and `rejected`
  each [user, assistant]): the prompt is the turns the two conversations share at their
  start, each answer the turns after (each keeps at least its last), as TRL's
  `maybe_extract_prompt` takes them (trl/data_utils.py); the prompt's text is not read.
- Each row is the whole prompt + answer tokenization (joint, not the pieces' ids
  joined), and its loss starts at the prompt's length in tokens, cut back to where the
  prompt's ids and each of the two whole texts' ids first differ (the smaller of the
  two: one boundary for both rows). Where the prompt's end tokenizes otherwise before an
  answer (GPT-2: a closing space joins the answer's first word, a closing blank line is
  one token alone and two before a word) or a template renders the prompt alone
  otherwise, the prompt's last tokens are trained as part of both answers (TRL warns).
This differs from runner/components/data/instruct.py's prompt_completion_example, which puts
the prompt's own ids (as a client tokenizes it at inference) before the answer's: TRL
trains on the joint text's ids. The issue asks for TRL's tokenization (a preference run
is proven equal to DPOTrainer step by step), so this format follows TRL, not instruct.py.

Labels are -100 on the prompt and the answer's ids elsewhere: exactly TRL's completion
mask (DataCollatorForPreference). A causal loss never predicts position 0, so a label
there, when TRL's boundary is 0, trains nothing.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from runner.components.data.labels import IGNORE_INDEX

SIDES = ("chosen", "rejected")
SETTINGS = ("prompt_field", "chosen_field", "rejected_field")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


def _common_prefix(ids: Sequence[Any], other: Sequence[Any]) -> int:
    """How many leading ids (or messages) the two have in common (TRL's common_prefix_length)."""
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


def _values(record: dict[str, Any], index: int, names: dict[str, str], where: str) -> list[Any]:
    """The record's prompt, chosen and rejected; each present, not empty, and all text or
    all chat messages, else refused naming the record."""
    from runner.config.errors import UserError

    values = []
    for setting in SETTINGS:
        name = names[setting]
        value = record.get(name)
        if value is None:
            raise UserError(f"{where}: record {index} has no '{name}' (it has: {', '.join(record)}). Set "
                            f"data.{setting} to the field that holds it, or fix the record.")
        if isinstance(value, (str, list)) and not value:
            raise UserError(f"{where}: record {index}'s '{name}' is empty (it has: {', '.join(record)}): a preference "
                            f"pair needs a prompt and two answers. Set data.{setting} to the field that holds it, or "
                            "fix or remove the record.")
        values.append(value)
    prompt, chosen, rejected = values
    if isinstance(prompt, str) and _is_messages(chosen) and _is_messages(rejected):
        # The conversations repeat the prompt's turns (the text beside them is not read):
        # the turns both start with are the prompt, each answer keeps at least its last.
        shared = min(_common_prefix(chosen, rejected), min(len(chosen), len(rejected)) - 1)
        if not shared:
            raise UserError(f"{where}: record {index}'s '{names['prompt_field']}' is text and its "
                            f"'{names['chosen_field']}' and '{names['rejected_field']}' conversations start with no "
                            "turn in common to be the prompt: give the prompt as messages (then each answer its "
                            "assistant turns), or start both conversations with the prompt's turns.")
        values = [chosen[:shared], chosen[shared:], rejected[shared:]]
    fields = ", ".join(f"'{names[s]}'" for s in SETTINGS)
    if not (all(isinstance(v, str) for v in values) or all(_is_messages(v) for v in values)):
        raise UserError(f"{where}: record {index}'s {fields} must all be text, or all lists of {{role, content}} "
                        "messages (the prompt's conversation, then each answer's assistant turns).")
    return values


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], template: Optional[str],
              add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"])


def preference_record_row(record: dict[str, Any], index: int, names: dict[str, str], tokenizer: Any,
                          template: Optional[str], where: str) -> dict[str, Any]:
    """One preference record as `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
    `rejected_labels` (TRL's tokenization: the module's docstring) and `same`. `names`
    maps prompt_field, chosen_field and rejected_field to the record's field names;
    `template` is data.chat_template's text (None: the tokenizer's own), used only for
    chat records. A function of the record alone, so datasets' map can run it on several
    processes (data.preprocessing_num_workers).

    `same` is true when the chosen and the rejected rows are the same ids (the same
    answer, or answers that tokenize alike: "x" and "x<|endoftext|>"). Such a pair is not
    refused: the caller counts and drops it, and reports the count. Its two log-probs are
    one function of the weights, so under sigmoid (with any label smoothing), ipo, hinge
    and simpo its gradient is zero and dropping it changes only the pair count the loss
    is a mean over (and the rewards/* means). Under orpo the odds-ratio term is likewise
    zero but its chosen answer's NLL term is not: dropping the pair there leaves out that
    answer's supervised loss. TRL keeps such pairs; runner drops them because they carry
    no preference, and says how many.
    """
    from runner.config.errors import UserError

    prompt, chosen, rejected = _values(record, index, names, where)
    if isinstance(prompt, str):
        eos = tokenizer.eos_token
        answers = [answer if eos is None or answer.endswith(eos) else answer + eos for answer in (chosen, rejected)]
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        rows = [list(tokenizer(prompt + answer)["input_ids"]) for answer in answers]
    else:
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: record {index} is chat messages, and this tokenizer has no chat template "
                            "(GPT-2's has none): set data.chat_template=<a .jinja file or the template itself>, e.g. "
                            "data.chat_template=${asset:chat_template_plain.jinja}, runner's plain one.")
        prompt_ids = _chat_ids(tokenizer, prompt, template, add_generation_prompt=True)
        rows = [_chat_ids(tokenizer, prompt + answer, template, add_generation_prompt=False)
                for answer in (chosen, rejected)]
    start = min(_common_prefix(prompt_ids, ids) for ids in rows)
    row: dict[str, Any] = {}
    for side, ids in zip(SIDES, rows):
        row[f"{side}_input_ids"] = ids
        row[f"{side}_labels"] = [IGNORE_INDEX] * start + ids[start:]
    row["same"] = rows[0] == rows[1]
    return row


def _fit(ids: list[int], labels: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """One sequence cut to block_size: the prompt's start goes first (the last block_size
    tokens, TRL's truncation_mode=keep_end, while the answer and one prompt token before
    it fit); an answer longer than that keeps the prompt's last token and the answer's
    start (TRL's default keep_start, applied from there)."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    start = len(ids) - block_size if len(ids) - first < block_size else max(first - 1, 0)
    return ids[start:start + block_size], labels[start:start + block_size]


def fit_pair_to_block(row: dict[str, Any], block_size: int, too_long: str) -> Optional[dict[str, Any]]:
    """A pair whose chosen or rejected row is longer than block_size: too_long=drop ->
    None; truncate -> each longer row cut on its own (the other keeps its length):
    - the answer and at least one prompt token fit: the row's last block_size tokens,
      the prompt cut from its start. This is TRL's DataCollatorForPreference with
      max_length=block_size and truncation_mode="keep_end", token for token;
    - the answer alone does not: the prompt's last token (so the answer's first token
      is still predicted) and the answer's first block_size - 1 tokens, its end cut, as
      TRL's default keep_start cuts an answer (TRL's keep_end would keep its end and
      cut its start instead; TRL deprecates keep_end, and keep_start drops a pair whose
      prompt alone fills max_length, which runner keeps with one prompt token).
    The rows' own length is TRL's max_length: chosen and rejected are separate
    sequences. A pair that fits comes back as itself (the caller counts `is not`)."""
    lengths = [len(row[f"{side}_input_ids"]) for side in SIDES]
    if max(lengths) <= block_size:
        return row
    if too_long == "drop":
        return None
    fitted = dict(row)
    for side, length in zip(SIDES, lengths):
        if length > block_size:
            ids, labels = _fit(list(row[f"{side}_input_ids"]), list(row[f"{side}_labels"]), block_size)
            fitted[f"{side}_input_ids"], fitted[f"{side}_labels"] = ids, labels
    return fitted
