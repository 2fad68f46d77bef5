"""A run's plan: its batch arithmetic and step count, computed once and shown in the start banner."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from runner.components.optim import effective_lr
from runner.config.batch import global_batch, global_batch_size
from runner.config.spec import ObjectiveKind, RunSpec


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    per_device_batch_size: int
    grad_accum_steps: int
    block_size: int
    steps_per_epoch: int
    total_steps: int
    train_blocks: int
    eval_blocks: int
    parameters: int
    strategy: str
    precision: str
    device: str
    lr: float
    effective_lr: float
    lr_rule: str = "none"
    stream: str = ""  # data.streaming=true: what is streamed (its length, so steps_per_epoch, is unknown)
    trainable_parameters: int = 0  # what the optimizer updates; 0: every parameter
    sequences_per_example: int = 1  # a preference objective's example is a pair: 2 sequences

    @property
    def trainable(self) -> int:
        return self.trainable_parameters or self.parameters

    @property
    def model_line(self) -> str:
        if self.trainable == self.parameters:
            return f"{self.parameters:,} parameters"
        return (f"{self.parameters:,} parameters, {self.trainable:,} trainable ({100 * self.trainable / self.parameters:.2f}%;"
                " the rest frozen)")

    @property
    def global_batch_size(self) -> int:
        return global_batch_size(self.per_device_batch_size, self.world_size, self.grad_accum_steps)

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step holds at most (padded preference pairs hold fewer)."""
        return self.global_batch_size * self.sequences_per_example * self.block_size

    @property
    def tokens_line(self) -> str:
        if self.sequences_per_example == 1:
            return f"{self.tokens_per_step:,} = {self.global_batch_size} x {self.block_size}"
        return (f"{self.tokens_per_step:,} at most = {self.global_batch_size} pairs x {self.sequences_per_example} "
                f"sequences x {self.block_size}")

    @property
    def micro_batch_line(self) -> str:
        if self.sequences_per_example == 1:
            return f"micro-batch {self.per_device_batch_size} x {self.block_size} tokens"
        return (f"micro-batch {self.per_device_batch_size} pairs = {self.per_device_batch_size * self.sequences_per_example}"
                f" sequences x {self.block_size} tokens")

    @property
    def epochs(self) -> float:
        return self.total_steps / max(self.steps_per_epoch, 1)

    @property
    def steps_line(self) -> str:
        """What the steps add up to; a stream's epochs are unknown until it is read through."""
        if self.stream:
            return (f"{self.total_steps:,} (train.max_steps; an epoch is one pass over the stream, its length unknown "
                    f"until read), {self.total_steps * self.tokens_per_step:,} tokens")
        return (f"{self.total_steps:,} ({self.epochs:.2f} epochs of {self.steps_per_epoch:,} steps),"
                f" {self.total_steps * self.tokens_per_step:,} tokens")

    @property
    def data_line(self) -> str:
        if self.stream:
            return (f"{self.stream}, each rank its own share, in blocks of {self.block_size} tokens; "
                    f"{self.eval_blocks:,} eval blocks held in memory")
        if self.sequences_per_example == 2:
            return (f"{self.train_blocks:,} train / {self.eval_blocks:,} eval pairs, each answer with its prompt in "
                    f"at most {self.block_size} tokens")
        return f"{self.train_blocks:,} train / {self.eval_blocks:,} eval blocks of {self.block_size} tokens"

    def as_dict(self) -> dict:
        return {**asdict(self), "global_batch_size": self.global_batch_size, "tokens_per_step": self.tokens_per_step}


def batches_per_rank(n_blocks: int, per_device_batch_size: int, world_size: int) -> int:
    """Accelerate shards whole batches round-robin; the last round is completed with
    fillers (runner/components/data/epoch_batches.py), so every rank runs as many."""
    return math.ceil(math.ceil(n_blocks / per_device_batch_size) / world_size)


def steps_per_epoch(batches_per_rank: int, grad_accum_steps: int) -> int:
    """Optimizer steps in one pass: the last, short accumulation still steps
    (Accelerate syncs at the end of the dataloader), as run_clm_no_trainer counts."""
    return math.ceil(batches_per_rank / grad_accum_steps)


def total_steps(max_steps: int | None, num_epochs: float, per_epoch: int) -> int:
    return max_steps if max_steps is not None else max(1, math.ceil(num_epochs * per_epoch))


def plan_run(
    spec: RunSpec,
    world_size: int,
    *,
    batches_per_rank: int,
    block_size: int,
    train_blocks: int,
    eval_blocks: int,
    parameters: int,
    precision: str,
    device: str,
    stream: str = "",
    trainable_parameters: int = 0,
) -> RunPlan:
    """The plan from the spec and what only the caller knows: the worker's prepared
    loader and model, or the dry run's estimates of them."""
    t = spec.train
    per_epoch = 0 if stream else steps_per_epoch(batches_per_rank, t.grad_accum_steps)  # a stream: unknown
    return RunPlan(
        world_size=world_size,
        per_device_batch_size=t.per_device_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        block_size=block_size,
        steps_per_epoch=per_epoch,
        total_steps=total_steps(t.max_steps, t.num_epochs, per_epoch),
        train_blocks=train_blocks,
        eval_blocks=eval_blocks,
        parameters=parameters,
        strategy=spec.strategy.kind.value,
        precision=precision,
        device=device,
        lr=spec.optim.lr,
        effective_lr=effective_lr(spec.optim, global_batch(t, world_size)),
        lr_rule=spec.optim.scale_lr.value,
        stream=stream,
        trainable_parameters=trainable_parameters,
        sequences_per_example=2 if spec.train.objective is ObjectiveKind.dpo else 1,
    )


def banner(plan: RunPlan, run_dir: str) -> str:
    p = plan
    lines = [
        "runner: starting",
        f"  run folder     {run_dir}",
        f"  strategy       {p.strategy} on {p.world_size} process(es), device {p.device}, precision {p.precision}",
        f"  model          {p.model_line}",
        f"  data           {p.data_line}",
        f"  global batch   {p.global_batch_size} = {p.per_device_batch_size} per device x {p.world_size} process(es)"
        f" x {p.grad_accum_steps} accumulation",
        f"  tokens/step    {p.tokens_line}",
        f"  steps          {p.steps_line}",
        f"  learning rate  {p.lr:g} configured, {p.effective_lr:g} in effect"
        + (f" ({p.lr_rule} scaling to global batch {p.global_batch_size})" if p.lr_rule != "none" else ""),
    ]
    return "\n".join(lines)
