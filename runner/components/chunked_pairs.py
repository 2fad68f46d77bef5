"""A preference loss without the whole logits: the output head and each sequence's
log-probs over chunks of pairs, forward and backward.

A preference micro-batch of P pairs is 2P sequences (chosen rows 0..P-1, rejected rows
P..2P-1: runner/components/data/preference_batch.py). Its plain loss holds the logits of all
2P sequences, their log-softmax and, in backward, their gradient: 3 x 2P x tokens x
vocabulary x 4 bytes (GPT-2, 4 pairs of 1,024 tokens: 4.9 GB). A preference loss is a
sum over pairs of a term of that pair's two log-prob sums (and constants: the reference's
log-probs, the step's pair count), so a chunk of pairs is computed whole: its two halves'
logits, their per-token log-probs (labels.token_losses, the plain path's math), the
pairs' part of the loss, and by autograd that part's gradient, which the head's two
matmuls take back to the hidden states and the weight; then the chunk's logits go. No
matmul is redone; backward only scales the gradients kept, as runner/components/
chunked_loss.py's token loss does, and reaches every strategy the same way (through the
output head's own call: chunked_loss.ChunkedLoss.computing).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from runner.components.chunked_loss import (
    CHUNK_LOGIT_BYTES,
    MIN_CHUNK_TOKENS,
    HeadGradients,
    check_positions,
    shifted_labels,
)
from runner.components.data.labels import IGNORE_INDEX, token_losses
from runner.components.data.preference_batch import SEQUENCE_IDS, pairs_in

# (chosen log-probs, rejected log-probs, chosen tokens, rejected tokens, which pairs) of a
# chunk of pairs -> their part of the micro-batch's loss (a differentiable scalar).
PairLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, slice], torch.Tensor]


def pairs_per_chunk(vocab_size: int, tokens: int, budget: int = CHUNK_LOGIT_BYTES) -> int:
    """Pairs whose fp32 logits (two sequences each) fit the budget, or as many as hold
    MIN_CHUNK_TOKENS tokens when that is more (chunked_loss.py says why); at least one."""
    sequence = 2 * max(tokens, 1)
    return max(1, budget // (4 * max(vocab_size, 1) * sequence), MIN_CHUNK_TOKENS // sequence)


class ChunkedPairLoss(torch.autograd.Function):
    """(the loss of the pairs, each sequence's summed log-probs, each sequence's trained
    tokens) of the head over `hidden` (2P x tokens x width) against unshifted `labels`
    (2P x tokens). Only the loss is differentiable; without `pair_loss` (scoring under
    no gradient) it is zero."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, pair_loss: Optional[PairLoss],
                chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pairs = hidden.shape[0] // 2
        logps = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        tokens = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grads = HeadGradients(hidden, weight, bias, ctx.needs_input_grad)
        wanted = pair_loss is not None and grads.wanted
        for start in range(0, pairs, chunk):
            end = min(pairs, start + chunk)
            rows = torch.cat([torch.arange(start, end), torch.arange(pairs + start, pairs + end)]).to(hidden.device)
            h, count, counts = hidden[rows], end - start, tokens[rows]
            logits = F.linear(h, weight, bias)  # under autocast: in its compute dtype, as the plain head
            with torch.enable_grad():
                logits.requires_grad_(wanted)
                losses, _ = token_losses(logits, labels[rows])
                sums = -losses.sum(dim=-1)
                part = None if pair_loss is None else pair_loss(
                    sums[:count], sums[count:], counts[:count], counts[count:], slice(start, end))
                g = None
                if wanted and part is not None and part.requires_grad:
                    (g,) = torch.autograd.grad(part, logits)
            logps[rows] = sums.detach()
            if part is not None:
                total += part.detach().float()
            del logits, losses, sums
            if g is not None:
                grads.add(rows, g, h, weight)
        grads.save(ctx, weight, bias)
        ctx.mark_non_differentiable(logps, tokens)
        return total, logps, tokens

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _logps: Any, _tokens: Any) -> tuple[Any, ...]:
        return (*HeadGradients.scaled(ctx, grad_total), None, None, None)


class ChunkedPackedPairLoss(torch.autograd.Function):
    """ChunkedPairLoss over packed rows (runner/components/preference_batch.pack_pairs):
    `hidden` flattened (positions x width), `targets` each position's next token (-100:
    none trained) and `owner` the sequence that token belongs to (0..2P-1). A chunk of
    pairs is the positions whose targets belong to its pairs, wherever the rows put them;
    only trained positions go through the head (no prompt, no padding). Selecting them
    reads the targets on the host: one device sync a micro-batch, packed runs only."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, owner: torch.Tensor, pairs: int, pair_loss: Optional[PairLoss],
                chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        trained = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        sequence = owner[trained]
        pair = sequence % pairs
        logps = torch.zeros(2 * pairs, dtype=torch.float32, device=hidden.device)
        tokens = torch.bincount(sequence, minlength=2 * pairs)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grads = HeadGradients(hidden, weight, bias, ctx.needs_input_grad)
        wanted = pair_loss is not None and grads.wanted
        for start in range(0, pairs, chunk):
            end = min(pairs, start + chunk)
            count, mine = end - start, (pair >= start) & (pair < end)
            positions, of = trained[mine], sequence[mine]
            # Chosen sequences (k < P) first, then rejected, as ChunkedPairLoss's rows.
            local = torch.where(of < pairs, of - start, of - pairs - start + count)
            h = hidden[positions]
            logits = F.linear(h, weight, bias)  # under autocast: in its compute dtype, as the plain head
            with torch.enable_grad():
                logits.requires_grad_(wanted)
                wide = logits.float()
                losses = torch.logsumexp(wide, dim=-1) - wide.gather(-1, targets[positions].unsqueeze(-1)).squeeze(-1)
                sums = torch.zeros(2 * count, dtype=torch.float32, device=hidden.device).index_add(0, local, -losses)
                ranks = torch.cat([torch.arange(start, end), torch.arange(pairs + start, pairs + end)]).to(hidden.device)
                counts = tokens[ranks]
                part = None if pair_loss is None else pair_loss(
                    sums[:count], sums[count:], counts[:count], counts[count:], slice(start, end))
                g = None
                if wanted and part is not None and part.requires_grad:
                    (g,) = torch.autograd.grad(part, logits)
            logps[ranks] = sums.detach()
            if part is not None:
                total += part.detach().float()
            del logits, wide, losses, sums
            if g is not None:
                grads.add(positions, g, h, weight)
        grads.save(ctx, weight, bias)
        ctx.mark_non_differentiable(logps, tokens)
        return total, logps, tokens

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _logps: Any, _tokens: Any) -> tuple[Any, ...]:
        return (*HeadGradients.scaled(ctx, grad_total), None, None, None, None, None)


def chunked_pair_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      labels: torch.Tensor, pair_loss: Optional[PairLoss], chunk: Optional[int] = None,
                      packed: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ChunkedPairLoss; `chunk` pairs at a time (default: what CHUNK_LOGIT_BYTES holds).
    `packed`: the micro-batch when its rows are packed (its sequence ids and pairs)."""
    chunk = chunk or pairs_per_chunk(weight.shape[0], labels.shape[1])
    if packed is None or SEQUENCE_IDS not in packed:
        return ChunkedPairLoss.apply(hidden, weight, bias, labels, pair_loss, chunk)
    owner = packed[SEQUENCE_IDS].to(labels.device)
    return ChunkedPackedPairLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, shifted_labels(labels),
                                       F.pad(owner, (0, 1), value=-1)[:, 1:].reshape(-1), pairs_in(packed),
                                       pair_loss, chunk)


def forward_pairs(chunked: Any, model: Any, inputs: dict[str, Any], labels: torch.Tensor,
                  pair_loss: Optional[PairLoss] = None, packed: Optional[dict[str, Any]] = None,
                  extras: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward of `model` on a micro-batch of pairs through the chunked head
    (`chunked`, runner/components/chunked_loss.ChunkedLoss): (the pairs' loss as the model
    returned it, each sequence's summed log-probs, each sequence's trained tokens).
    `packed`: the batch, when its rows are packed (preference_batch.pack_pairs). `extras`
    gets the forward's router loss (`aux_loss`)."""
    kept: dict[str, torch.Tensor] = {}

    def compute(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        check_positions(hidden, labels)
        total, kept["logps"], kept["tokens"] = chunked_pair_loss(hidden, weight, bias, labels, pair_loss,
                                                                 packed=packed)
        return total

    loss = chunked.computing(model, inputs, compute, extras)
    return loss, kept["logps"], kept["tokens"]
