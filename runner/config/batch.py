"""The batch arithmetic, written once: what a step is in sequences, and the
accumulation a requested global batch implies.

global batch = per-device batch x processes x accumulation steps
(e.g. 8 per device x 2 processes x 4 steps = 64 sequences, x block_size 128 = 8,192 tokens a step)
"""

from __future__ import annotations

from runner.config.spec import TrainSpec


def global_batch_size(per_device_batch_size: int, world_size: int, grad_accum_steps: int) -> int:
    """Sequences per optimizer step."""
    return per_device_batch_size * world_size * grad_accum_steps


def global_batch(train: TrainSpec, world_size: int) -> int:
    """Sequences per optimizer step of `train` at `world_size` processes."""
    return global_batch_size(train.per_device_batch_size, world_size, train.grad_accum_steps)


def eval_batch_size(train: TrainSpec, micro_batch: int | None = None) -> int:
    """Sequences (or pairs) per device per evaluation batch: train.per_device_eval_batch_size,
    else the training micro-batch (`micro_batch` where one is being planned)."""
    return train.per_device_eval_batch_size or micro_batch or train.per_device_batch_size


def accumulation_for(train: TrainSpec, world_size: int) -> tuple[int, list[str]]:
    """(grad_accum_steps, problems): the accumulation `train.global_batch_size` implies at
    `world_size`, or `train.grad_accum_steps` when no global batch is asked for. Pure: the
    launcher writes the result into the spec it freezes."""
    t = train
    if t.global_batch_size is None:
        return t.grad_accum_steps, []
    per_step = global_batch_size(t.per_device_batch_size, world_size, 1)
    if t.global_batch_size <= 0 or per_step <= 0 or t.global_batch_size % per_step:
        return t.grad_accum_steps, [
            f"train.global_batch_size={t.global_batch_size} is not a multiple of per_device_batch_size x world size "
            f"= {t.per_device_batch_size} x {world_size} = {per_step}. Change train.global_batch_size, "
            "train.per_device_batch_size or launch.nproc_per_node."
        ]
    derived = t.global_batch_size // per_step
    if t.grad_accum_steps not in (1, derived):
        return t.grad_accum_steps, [
            f"train.grad_accum_steps={t.grad_accum_steps} contradicts train.global_batch_size={t.global_batch_size} "
            f"(which needs {derived}). Set only one of them."
        ]
    return derived, []


def accumulation_at(train: TrainSpec, world_size: int) -> int:
    """launch.min_workers (Ray's elastic range): the accumulation that keeps the global batch
    the launcher froze (train.global_batch_size) on a worker group of `world_size`; the
    launcher checked that every size in the range divides it (runner/launch/elastic.py)."""
    assert train.global_batch_size is not None, "an elastic run's spec carries its global batch"
    per_step = global_batch_size(train.per_device_batch_size, world_size, 1)
    if train.global_batch_size % per_step:
        raise ValueError(f"a group of {world_size} workers cannot hold the global batch of {train.global_batch_size} "
                         f"in micro-batches of {train.per_device_batch_size}")
    return train.global_batch_size // per_step
