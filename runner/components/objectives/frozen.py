"""preference.reference=frozen: a second copy of the starting weights that scores each
micro-batch's reference log-probs as it comes.

The copy is built as the worker builds the policy (the seed, then the tokenizer, config
and model of model.name_or_path or of a scratch config; no adapters: the reference of a
peft run is its base), so it holds the weights the policy starts from, and a resume
rebuilds it from them, not from a checkpoint. The strategy prepares it as it shards the
policy (runner/distributed: `Strategy.frozen_copy`): partitioned under zero3, sharded by
FSDP2 under fsdp, whole on each device under ddp, zero2 or one process; in eval mode,
without gradients, outside the optimizer and the checkpoint. Each forward goes through
the same per-sequence log-prob code as the other modes (its own chunked head when the
policy has one), on every rank alike: the objective runs each micro-batch's forward on
every rank, an epoch's fillers included, as a sharded forward needs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from runner.components.objectives.reference import Reference, sequence_logps

log = logging.getLogger("runner")


class Frozen(Reference):
    def __init__(self, model: Any, chunked: Any, cache: bool, release: Callable[[Any], None]) -> None:
        self.model, self.chunked, self.cache = model, chunked, cache  # the prepared copy and its head
        self.release = release  # the strategy's: gathered shards freed after each forward

    def logps(self, model: Any, batch: dict[str, Any], split: str) -> Optional[torch.Tensor]:
        with torch.no_grad():
            scores = sequence_logps(self.model, batch, self.cache, self.chunked)[0]
        self.release(self.model)
        return scores


def starting_weights(model_spec: Any, seed: int, chunked_head: bool) -> tuple[torch.nn.Module, Any]:
    """The policy's starting model again (as runner/train/worker.py build_seeded_model
    builds it, without adapters), and the chunked head installed on it when the policy has
    one (None otherwise). Seeding here is safe: the loop's random state is seeded after
    setup (runner/train/restore.py)."""
    from runner.components.chunked_loss import install
    from runner.components.model import starting_model

    model = starting_model(model_spec, seed)[2]
    chunked = install(model, probe=False)[0] if chunked_head else None
    return model, chunked


def held_elements(strategy: Any, model: Any) -> int:
    """The parameter elements this rank holds of a prepared model (its shards; a
    parameter held whole counted whole), by the strategy's own account of its pieces."""
    return sum(int((whole if whole is not None else shard).numel())
               for shard, whole in strategy.parameter_pieces(model) if whole is not None or shard is not None)


def frozen_reference(spec: Any, strategy: Any, accelerator: Any, chunked_head: bool) -> Frozen:
    """The frozen copy, prepared by `strategy` (the run's Strategy object); rank 0 logs
    what each rank holds of it (run.log)."""
    heads: list[Any] = []
    total: list[int] = []

    def build() -> torch.nn.Module:
        model, head = starting_weights(spec.model, spec.train.seed, chunked_head)
        heads.append(head)
        total.append(sum(p.numel() for p in model.parameters()))  # each tied parameter once
        return model

    model = strategy.frozen_copy(accelerator, build)
    held = torch.tensor([held_elements(strategy, model)], device=accelerator.device)
    per_rank = (accelerator.gather(held) if accelerator.num_processes > 1 else held).tolist()
    strategy.after_evaluation(model)
    if accelerator.is_main_process:
        log.info(f"reference: a frozen copy of the starting weights (preference.reference=frozen), prepared by "
                 f"strategy={strategy.name}: the ranks hold {per_rank} of its {total[0]:,} parameter elements")
    return Frozen(model, heads[0], not spec.model.compile, strategy.after_evaluation)
