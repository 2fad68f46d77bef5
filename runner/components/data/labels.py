"""The label convention every run uses: what a batch's labels mean, which of its tokens
are real, and what the model is given.

A batch is `input_ids` and `labels` of equal length, plus what the data adds (an
attention mask for padded rows; position ids and a per-row `real_tokens` count for
packed ones). A label of IGNORE_INDEX trains nothing: the prompt of instruction data,
the first token of a packed example, padding, an epoch's fillers. Token t's target is
label t + 1 (transformers' ForCausalLMLoss shifts them), so the last position predicts
nothing. Run_clm's text blocks train every token.
"""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100  # the label transformers' loss skips


def real_tokens(batch: dict[str, Any]) -> int:
    """The batch's tokens that are not padding: what tokens/s and MFU count."""
    return int(row_real_tokens(batch).sum())


def row_real_tokens(batch: dict[str, Any]) -> Any:
    """Each row's tokens that are not padding. Packed rows carry their own count (as do
    a batch's fillers: runner/components/data/epoch_batches.py); padded ones, their attention
    mask; run_clm's blocks are all real."""
    import torch

    if "real_tokens" in batch:
        return batch["real_tokens"]
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1)
    rows, length = batch["input_ids"].shape
    return torch.full((rows,), length, dtype=torch.int64)


# A mixture's evaluation batches name each row's source (runner/components/data/mixture.py): not a model input.
SOURCE = "source"


def model_inputs(batch: dict[str, Any], labels: bool = False, cache: bool = True) -> dict[str, Any]:
    """The forward's arguments for a batch (its labels only if asked). A packed batch
    (position ids, no attention mask) runs with no cache: a model that builds one (GPT-2
    does whenever use_cache is on, its config's default) skips the packed-sequence mask,
    and packed examples would attend to each other. tests/components/data/test_instruct.py
    fails on that leak. `cache=False` (model.compile): none either, as each layer's cache
    state is a guard that would recompile every layer. Otherwise the model's default
    stays: with neither cache nor mask, transformers looks for packed sequences in the
    position ids it makes, reading the device (a GPU sync a step)."""
    inputs = {k: v for k, v in batch.items() if (labels or k != "labels") and k not in ("real_tokens", SOURCE)}
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

