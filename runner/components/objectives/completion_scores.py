"""Per-token log-probs and entropies of sampled completions, computed exactly: the
whole logits of each row, over the temperature, through torch's log_softmax.

Rows are prompt + completion, right-padded, so every token sits at its natural position
(as it did when it was sampled, one prompt at a time): a left-padded batch would move a
learned-position model's positions, one of the ways other tools' training and sampling
log-probs drift apart. The completion's token t is predicted at the row's position
prompt_length - 1 + t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass
class CompletionRows:
    """A micro-batch of prompt + completion rows, ready for the model."""

    input_ids: torch.Tensor  # [b, P + L]
    attention_mask: torch.Tensor  # [b, P + L]
    starts: torch.Tensor  # [b]: where each completion starts (its prompt's length)
    completion_ids: torch.Tensor  # [b, L]
    mask: torch.Tensor  # [b, L] float: the completion's tokens (its end-of-sequence included)

    def to(self, device: torch.device) -> "CompletionRows":
        return CompletionRows(*(t.to(device, non_blocking=True) for t in
                                (self.input_ids, self.attention_mask, self.starts, self.completion_ids, self.mask)))


def completion_rows(prompts: Sequence[Sequence[int]], completion_ids: torch.Tensor, lengths: torch.Tensor,
                    pad_id: int) -> CompletionRows:
    """Rows of each prompt followed by its completion's L places, right-padded to the longest prompt."""
    b, length = completion_ids.shape
    longest = max(len(p) for p in prompts)
    ids = torch.full((b, longest + length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, longest + length), dtype=torch.long)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    for i, prompt in enumerate(prompts):
        p = len(prompt)
        ids[i, :p] = torch.tensor(list(prompt), dtype=torch.long)
        ids[i, p:p + length] = completion_ids[i]
        attention[i, :p + int(lengths[i])] = 1
    starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return CompletionRows(ids, attention, starts, completion_ids.long(), mask)


def completion_logps(model: Any, rows: CompletionRows, temperature: float, entropy: bool = True,
                     extras: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token log-probs [b, L], entropies [b, L] or None) of the completions under `model`;
    `extras` receives the forward's router loss (`aux_loss`) of a mixture of experts that returns one."""
    outputs = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, use_cache=False)
    if extras is not None:
        extras["aux_loss"] = getattr(outputs, "aux_loss", None)
    b, length = rows.completion_ids.shape
    where = (rows.starts[:, None] - 1 + torch.arange(length, device=rows.starts.device)[None, :])
    where = where.clamp(max=rows.input_ids.shape[1] - 1)
    logits = outputs.logits.float().gather(1, where[:, :, None].expand(b, length, outputs.logits.shape[-1]))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logps = logp_all.gather(2, rows.completion_ids[:, :, None]).squeeze(2)
    ent = -(logp_all.exp() * logp_all).sum(-1).detach() if entropy else None
    return logps, ent
