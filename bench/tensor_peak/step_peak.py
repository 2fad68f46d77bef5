"""The peak of live torch tensors over one training step: the instrument behind
sitecustomize.py (runner's workers) and bench/preference.py's TRL worker (transformers'
Trainer, `trainer_callback`). A bench instrument, not part of runner; sitecustomize.py's
docstring says what the figure is and why it is measured so.

Outside a profiled process (RUNNER_BENCH_TENSOR_PEAK unset) nothing here runs: importing
it does nothing but import torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

PROFILED_STEP = 2  # the first optimizer step with AdamW's state
MARKER = "runner_bench_profiled_step"


def count_frees_on_every_thread() -> None:
    """c10's flag that makes the CPU allocator's running total count frees on every
    thread (sitecustomize.py); set it before any tensor exists."""
    try:
        ctypes.c_bool.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")),
                             "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError) as error:  # another build of torch: say the figures may drift
        print(f"tensor_peak: cannot count frees on other threads ({error}); step 2's peak may read high",
              file=sys.stderr)


def start_profile() -> Any:
    """A running torch profiler that records every CPU allocation with the running total."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()
    return prof


def peak_in_marker(prof: Any) -> int:
    """Stops `prof`; the largest running total of live CPU tensor bytes that an allocation
    event inside the MARKER event carried. The marker's window is in the clock the events
    carry, not this process's wall clock."""
    prof.__exit__(None, None, None)
    from torch._C._profiler import _EventType

    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        events.append(event)
    marker = next(e for e in events if e.name == MARKER)
    start_ns, end_ns = marker.start_time_ns, marker.end_time_ns
    peak, at = 0, None
    for event in events:
        if event.typed[0] == _EventType.Allocation and str(event.typed[1].device) == "cpu":
            if start_ns <= event.start_time_ns <= end_ns and event.typed[1].total_allocated > peak:
                peak, at = event.typed[1].total_allocated, event
    if os.environ.get("RUNNER_BENCH_TENSOR_PEAK_DETAIL") and at is not None:
        _describe_peak(events, at)
    return peak


def _ops(event: Any) -> str:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.parent
    return " < ".join(names[1:6])


def _describe_peak(events: list[Any], at: Any) -> None:
    """RUNNER_BENCH_TENSOR_PEAK_DETAIL=1: on stderr, the operators around the peak's
    allocation and the largest tensors live then (address-matched allocations and frees
    up to it), each with the operators that allocated it: what a peak is made of."""
    from torch._C._profiler import _EventType

    memory = sorted((e for e in events if e.typed[0] == _EventType.Allocation and str(e.typed[1].device) == "cpu"),
                    key=lambda e: e.start_time_ns)
    live: dict[int, tuple[int, Any]] = {}
    for event in memory:
        if event.start_time_ns > at.start_time_ns:
            break
        info = event.typed[1]
        if info.alloc_size > 0:
            live[info.ptr] = (info.alloc_size, event)
        else:
            live.pop(info.ptr, None)
    print(f"tensor_peak: peak {at.typed[1].total_allocated / 2**20:,.0f} MB at an allocation of "
          f"{at.typed[1].alloc_size / 2**20:,.1f} MB in {_ops(at)}", file=sys.stderr)
    by_op: dict[str, list[int]] = {}
    for size, event in live.values():
        by_op.setdefault(_ops(event), []).append(size)
    for ops, sizes in sorted(by_op.items(), key=lambda item: -sum(item[1]))[:15]:
        print(f"tensor_peak:   {sum(sizes) / 2**20:9,.1f} MB in {len(sizes):4} tensors from {ops}", file=sys.stderr)


def file_mapped_bytes(*models: Any) -> int:
    """Bytes of the models' tensors whose storage is a mapped file, not the allocator's."""
    files = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[5].startswith("/"):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            files.append((low, high))
    from torch.distributed.tensor import DTensor

    storages = {}
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            # FSDP2's parameters are DTensors: their storage is the local shard's
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            pointer = storage.data_ptr()
            if any(low <= pointer < high for low, high in files):
                storages[pointer] = storage.nbytes()  # tied weights share one storage
    return sum(storages.values())


def write(rank: int, peak_bytes: float) -> None:
    out = Path(os.environ["RUNNER_BENCH_TENSOR_PEAK"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"peak_mb": peak_bytes / 2**20}))


def trainer_callback(trainer: Any) -> Any:
    """A callback for transformers' Trainer (TRL's trainers are ones) that writes the peak
    of live tensors over optimizer step PROFILED_STEP, from its start (the batch fetched)
    to its end (optimizer stepped, gradients zeroed), as runner's train_step is measured;
    the mapped-file bytes of the policy and of a reference model (`trainer.ref_model`)
    are added."""
    from transformers import TrainerCallback

    class StepPeak(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step + 1 != PROFILED_STEP:
                return
            if trainer.accelerator.device.type == "cuda":  # on a GPU the allocator keeps the count itself
                torch.cuda.reset_peak_memory_stats(trainer.accelerator.device)
                return
            self.prof = start_profile()
            self.marker = torch.profiler.record_function(MARKER)
            self.marker.__enter__()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step != PROFILED_STEP:
                return
            if trainer.accelerator.device.type == "cuda":
                write(trainer.accelerator.process_index, torch.cuda.max_memory_allocated(trainer.accelerator.device))
                return
            self.marker.__exit__(None, None, None)
            models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
            write(trainer.accelerator.process_index, peak_in_marker(self.prof) + file_mapped_bytes(*models))

    return StepPeak()
