"""The reference model's log-probs for a preference objective (preference.reference).

- `precomputed`: the starting weights' per-sequence log-probs of every pair, computed
  once before training by the policy itself (it holds the starting weights then; eval
  mode, no gradient), in any layout: each rank scores its share of the pairs, and the
  table is gathered on every rank. It is kept in the run folder, so a resume, and one on
  another world size or strategy, reads the same numbers instead of scoring the trained
  weights. No second copy of the model is held, under any strategy.
- `adapter_off`: with peft, the same model with its adapters disabled (peft's
  `disable_adapter`), under no gradient: the base model, with no second copy.
- `frozen`: a second copy of the starting weights, prepared by the strategy as the
  policy is sharded, scoring each micro-batch as it comes (frozen.py).
- `none`: reference-free losses (simpo, orpo).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runner.components.chunked_pairs import forward_pairs
from runner.components.data.labels import model_inputs
from runner.components.data.preference_batch import PAIR_INDEX, SEQUENCE_IDS
from runner.components.objectives.preference_loss import sequence_logps as logps_of_logits

log = logging.getLogger("runner")

TABLE_FILE = "reference_logps.pt"
# Beside the prepared data (data.cache_dir): tables any run of that data can reuse, one a
# key (describe_key's digest).
SHARED_DIR = "reference_logps"

SequenceScores = tuple[torch.Tensor, torch.Tensor]  # per sequence: summed answer log-probs, answer tokens


def sequence_logps(model: Any, batch: dict[str, Any], cache: bool = True, chunked: Any = None) -> SequenceScores:
    """One forward of `model` on `batch`: each sequence's summed log-probs of its trained
    tokens in fp32, and their count (preference_loss.sequence_logps of its logits; through
    the chunked head when one is installed: the whole logits are never held)."""
    inputs = model_inputs({k: v for k, v in batch.items() if k not in (PAIR_INDEX, SEQUENCE_IDS)}, cache=cache)
    if chunked is not None:
        _, logps, tokens = forward_pairs(chunked, model, inputs, batch["labels"], packed=batch)
        return logps, tokens
    return logps_of_logits(model(**inputs).logits, batch["labels"], batch)


class Reference:
    """Where a batch's reference log-probs come from; `None` from `logps`: no reference."""

    scored = False  # whether building it scored the data (its time is the ledger's `reference` part)

    def logps(self, model: Any, batch: dict[str, Any], split: str) -> Optional[torch.Tensor]:
        return None


class AdapterOff(Reference):
    def __init__(self, bare: Any, cache: bool, chunked: Any = None) -> None:
        self.bare, self.cache = bare, cache  # the PeftModel under the strategy's wrapper
        self.chunked = chunked

    def logps(self, model: Any, batch: dict[str, Any], split: str) -> Optional[torch.Tensor]:
        """The base's log-probs in eval mode, as the precomputed and frozen references score:
        with the policy's dropout kept (preference.disable_dropout=false) the reference
        still has none, in every mode."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.bare.disable_adapter():
                return sequence_logps(model, batch, self.cache, self.chunked)[0]
        finally:
            model.train(was_training)


class Precomputed(Reference):
    def __init__(self, tables: dict[str, torch.Tensor], scored: bool) -> None:
        self.tables = tables  # split -> [pairs, 2] (chosen, rejected), on the device
        self.scored = scored

    def logps(self, model: Any, batch: dict[str, Any], split: str) -> Optional[torch.Tensor]:
        table = self.tables[split]
        rows = table[batch[PAIR_INDEX].to(table.device)]
        return torch.cat([rows[:, 0], rows[:, 1]])


def score_pairs(model: Any, dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], batch_size: int,
                accelerator: Any, cache: bool, chunked: Any = None) -> torch.Tensor:
    """[pairs, 2]: the model's (chosen, rejected) log-probs of every pair of `dataset`, in
    eval mode with no gradient. Rank r scores pairs r, r + world, ...; every rank runs as
    many forwards (a sharded model's forward is collective), the last ones repeating a
    pair, and the scores are gathered on every rank."""
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    count = len(dataset)
    mine = list(range(rank, count, world))
    per_rank = -(-count // world)
    forwards = -(-per_rank // batch_size)
    scores = torch.full((forwards * batch_size, 3), -1.0, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step in range(forwards):
                chunk = mine[step * batch_size:(step + 1) * batch_size]
                indices = chunk or [0]  # a rank with no pair left still runs the forward
                batch = {k: v.to(device) for k, v in collate([dataset[i] for i in indices]).items()}
                logps, _ = sequence_logps(model, batch, cache, chunked)
                pairs = len(indices)
                rows = torch.stack([batch[PAIR_INDEX].double(), logps[:pairs].double(), logps[pairs:].double()], 1)
                if not chunk:
                    rows[:, 0] = -1.0
                scores[step * batch_size:step * batch_size + pairs] = rows
    finally:
        model.train(was_training)
    gathered = accelerator.gather(scores) if world > 1 else scores
    table = torch.zeros((count, 2), dtype=torch.float32, device=device)
    kept = gathered[gathered[:, 0] >= 0]
    table[kept[:, 0].long()] = kept[:, 1:].float()
    return table


def precomputed_tables(model: Any, splits: dict[str, Any], collate: Callable[[list[Any]], dict[str, Any]],
                       batch_size: int, accelerator: Any, run_dir: Path, key: str, shared_dir: Optional[Path] = None,
                       cache: bool = True, chunked: Any = None) -> tuple[dict[str, torch.Tensor], str]:
    """The reference log-prob tables of every split, and where they came from ("run
    folder", "shared", "scored"): the run folder's when it holds this key's (a resume:
    the model holds trained weights by now, or will); else `shared_dir`'s (beside the
    prepared data: another run of the same data and starting weights scored them), copied
    into the run folder; else scored now and written to both by rank 0 (atomically). The
    run folder's copy is what a resume reads, whatever becomes of the shared cache."""
    sizes = {split: len(dataset) for split, dataset in splits.items()}
    local = run_dir / TABLE_FILE
    shared = None if shared_dir is None else shared_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    for path, origin in ((local, "run folder"), (shared, "shared")):
        tables = _read_tables(path, key, sizes) if path is not None else None
        if tables is not None:
            if origin == "shared" and accelerator.is_main_process:
                _write_tables(local, key, tables)
            accelerator.wait_for_everyone()
            return {split: table.to(accelerator.device) for split, table in tables.items()}, origin
    tables = {split: score_pairs(model, dataset, collate, batch_size, accelerator, cache, chunked)
              for split, dataset in splits.items()}
    if accelerator.is_main_process:
        for path in (local, shared):
            if path is not None:
                _write_tables(path, key, {s: t.cpu() for s, t in tables.items()})
    accelerator.wait_for_everyone()
    return tables, "scored"


def _read_tables(path: Path, key: str, sizes: dict[str, int]) -> Optional[dict[str, torch.Tensor]]:
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu")
    if saved.get("key") == key and {s: len(t) for s, t in saved["tables"].items()} == sizes:
        return saved["tables"]
    log.warning(f"{path} was scored for other data or weights; not used")
    return None


def _write_tables(path: Path, key: str, tables: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"key": key, "tables": tables}, tmp)
    os.replace(tmp, path)


# The table's own format: 2 numbers a mixture's pairs by their place in the mixture (a table
# keyed before that indexed each source's pairs from 0, colliding).
TABLE_FORMAT = 2


def describe_key(cache_path: Path, model: Any, seed: int, precision: str, sizes: dict[str, int]) -> str:
    """What a table is valid for: the prepared data (and how many of its pairs), the
    starting weights (a folder's weight files by name, size and modification time; a hub
    id; or a scratch model's config and seed), model.config_overrides (applied to a
    pretrained config too, they change the function the weights compute) and the precision
    they were scored in. Kernels that compute the same function to float rounding
    (attention, activations, compile, the chunked head) share a table, as layouts do."""
    weights: Any = model.name_or_path
    if model.name_or_path is None:
        weights = {"model_type": model.model_type, "seed": seed}
    elif Path(model.name_or_path).is_dir():
        folder = Path(model.name_or_path)
        weights = {"folder": str(folder.resolve()), "files": sorted(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
            if f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json"))}
    return json.dumps({"data": cache_path.name, "sizes": sizes, "weights": weights, "precision": precision,
                       "config_overrides": model.config_overrides, "format": TABLE_FORMAT}, sort_keys=True)


def build_reference(spec: Any, model: Any, bare: Any, accelerator: Any, data: Any, run_dir: Path,
                    chunked: Any = None, frozen: Optional[Callable[[], Reference]] = None) -> Optional[Reference]:
    """The run's reference (None: its objective has none), built on the prepared model
    before any checkpoint is loaded into it: it still holds the starting weights.
    `chunked`: the chunked head installed on the model, which scores it too. `frozen`:
    builds preference.reference=frozen's copy (runner/components/objectives/frozen.py,
    given the run's strategy by the worker)."""
    from runner.components.data.prepare import collate_for
    from runner.config.batch import eval_batch_size
    from runner.config.spec import ObjectiveKind, ReferenceMode
    from runner.config.validate import reference_mode

    if spec.train.objective is not ObjectiveKind.dpo:
        return None
    mode, cache = reference_mode(spec), not spec.model.compile
    if mode is ReferenceMode.adapter_off:
        return AdapterOff(bare, cache, chunked)
    if mode is ReferenceMode.frozen:
        assert frozen is not None, "preference.reference=frozen: the worker hands over how to build the copy"
        return frozen()
    if mode is ReferenceMode.precomputed:
        batch = eval_batch_size(spec.train)
        splits = {"train": data.train, "validation": data.validation}
        key = describe_key(data.cache_path, spec.model, spec.train.seed, spec.precision.kind.value,
                           {split: len(dataset) for split, dataset in splits.items()})
        shared_dir = data.cache_path.parent / SHARED_DIR
        tables, origin = precomputed_tables(model, splits, collate_for(spec.data, data.pad_id), int(batch),
                                            accelerator, run_dir, key, shared_dir, cache, chunked)
        if origin != "run folder" and accelerator.is_main_process:
            pairs = sum(len(t) for t in tables.values())
            log.info(f"reference: scored {pairs:,} pairs with the starting weights (preference.reference=precomputed), "
                     f"kept in {run_dir / TABLE_FILE} and beside the prepared data ({shared_dir})" if origin == "scored"
                     else f"reference: {pairs:,} pairs' log-probs read from {shared_dir}, scored by an earlier run of "
                     f"this data and these starting weights; kept in {run_dir / TABLE_FILE}")
        return Precomputed(tables, origin == "scored")
    return Reference()
