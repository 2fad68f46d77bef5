"""Stopping on a signal: all ranks agree on the same step, without a device round-trip."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from runner.train.signals import StopRequest


def _rank(rank: int, world: int, init_file: str, results: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    reduced: list[torch.Tensor] = []
    real_all_reduce = dist.all_reduce

    def spying_all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor)
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = spying_all_reduce
    stop = StopRequest()
    accelerator = SimpleNamespace(num_processes=world)  # agreed() needs nothing else
    stopped_at = None
    for step in range(1, 9):
        if rank == 1 and step == 3:
            stop.signum = signal.SIGTERM  # what the handler records
        if stop.agreed(accelerator) is not None:
            stopped_at = step
            break
    results[rank] = (stopped_at, stop.signum, {str(t.device) for t in reduced})
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_rank_stops_at_the_same_step_on_host_tensors(tmp_path):
    """Rank 1 is signalled during step 3; both ranks stop at the next boundary (step 4),
    and the agreement only ever reduced CPU tensors (no GPU sync, also on NCCL runs)."""
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(world, str(tmp_path / "init"), results), nprocs=world, join=True)
        got = dict(results)
    assert got[0][0] == got[1][0] == 4
    assert got[0][1] == got[1][1] == signal.SIGTERM  # the unsignalled rank stops for SIGTERM too
    assert got[0][2] == got[1][2] == {"cpu"}


def test_one_process_answers_at_once_without_collectives():
    stop = StopRequest()
    accelerator = SimpleNamespace(num_processes=1)
    assert stop.agreed(accelerator) is None
    stop.signum = signal.SIGINT
    assert stop.agreed(accelerator) == signal.SIGINT


def test_a_signal_held_between_sweep_jobs_stops_the_next_training_loop(monkeypatch):
    """A local sweep's launcher holds SIGTERM outside training loops; the next loop
    starts already asked to stop, so it checkpoints after its first step."""
    import os

    import runner.train.signals as signals

    monkeypatch.setattr(signals, "_held", None)
    monkeypatch.setattr(signals, "_holding", False)
    saved = {sig: signal.getsignal(sig) for sig in signals.EXIT_CODES}
    try:
        signals.hold_signals()
        first = StopRequest().install()
        assert first.signum is None  # nothing held yet
        first.restore()  # back to the hold
        os.kill(os.getpid(), signal.SIGTERM)  # would end the process without the hold
        assert signals.held_signal() == signal.SIGTERM
        stop = StopRequest().install()
        assert stop.agreed(SimpleNamespace(num_processes=1)) == signal.SIGTERM
        stop.restore()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
