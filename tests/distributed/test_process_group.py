"""Which GPU each process binds to (CUDA queries monkeypatched): torchrun-style one
device per local rank, and srun with one GPU per task."""

import os

import pytest
import torch

from runner.distributed.process_group import device_index, select_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend `n` GPUs are visible; returns the list of set_device calls."""
    calls: list[int] = []

    def visible(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(int(index)))
        return calls

    return visible


def test_each_local_rank_gets_its_own_device_on_an_8_gpu_node(gpus, monkeypatch):
    calls = gpus(8)
    for local_rank in range(8):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert select_device() == local_rank
        assert os.environ["LOCAL_RANK"] == str(local_rank)  # unchanged
    assert calls == list(range(8))


@pytest.mark.parametrize("local_rank", [0, 1, 7])
def test_srun_with_one_gpu_per_task_binds_device_0(gpus, monkeypatch, local_rank):
    """--gpus-per-task=1: every task sees one GPU; set_device(LOCAL_RANK) would be an
    invalid ordinal for LOCAL_RANK >= 1."""
    calls = gpus(1)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert select_device() == 0
    assert calls == [0]
    # DeepSpeed's engine then calls set_device(int(os.environ["LOCAL_RANK"])): a valid ordinal.
    assert int(os.environ["LOCAL_RANK"]) < torch.cuda.device_count()


def test_more_processes_than_gpus_is_a_clear_error():
    assert device_index(3, 4) == 3
    with pytest.raises(RuntimeError, match="sees 4 GPUs.*one process per visible GPU"):
        device_index(5, 4)
