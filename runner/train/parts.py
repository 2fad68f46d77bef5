"""What the trainer is handed, already built and prepared (runner/train/worker.py builds
them): the engine that steps, the data it reads, and the loop's settings. The plan
(runner/train/plan.py) and the objective (runner/components/objectives/) come beside them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.config.spec import PrecisionSpec
from runner.distributed.strategy import Strategy


@dataclass
class Engine:
    """The prepared model and its update: backward, norm, step and loss scale are the strategy's own."""

    accelerator: Any  # accelerate.Accelerator
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any  # stepped by the trainer, once per optimizer step
    strategy: Strategy


@dataclass
class TrainData:
    train_loader: Any
    eval_loader: Any
    sampler: Any = None  # the trainer sets its epoch
    # data.streaming=true: train_loader is this rank's own stateful loader (not prepared by
    # Accelerate), its position saved with each checkpoint (runner/train/windows.py).
    stream: bool = False
    # Which data the position indexes (a stream's files, the cached blocks' key): a resume checks it
    record: dict[str, Any] = field(default_factory=dict)
    # Rows hold padding (instruction data): rates and checkpoints count the tokens that are
    # not padding, not the rows' capacity.
    counts_real_tokens: bool = False
    # data.mixture: the sources' names, in the order the rows' `source` indexes them
    sources: tuple[str, ...] = ()


@dataclass
class LoopSettings:
    run_dir: Path
    max_grad_norm: float = 0.0
    log_every: int = 0
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 1
    spec_yaml: str = ""  # saved into each checkpoint, to check a resume against
    max_consecutive_skipped_steps: int = PrecisionSpec.max_consecutive_skipped_steps  # fp16 overflows in a row that stop the run
    flops_per_token: float = 0.0
    peak_flops: float = 0.0  # all devices together; 0: MFU unknown
    compiled: bool = False  # model.compile: what compiling cost is counted apart (runner/train/ledger.py)
