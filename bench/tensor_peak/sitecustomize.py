"""Peak of live torch tensors in one training step of every rank (bench/strategy_memory.py --tensor-peak).

Imported by each worker when this folder is on PYTHONPATH and RUNNER_BENCH_TENSOR_PEAK
names an output folder. torch.profiler's memory recording runs from the start of
`runner.train.worker.train` (before the model exists) to the end of the second optimizer
step (the first allocates AdamW's state); every CPU allocation event carries the
allocator's running total of live bytes (every thread's frees counted: below), so the largest
total seen during step 2 is the peak of live tensors then. On a CPU that is what
CUDA's max_memory_allocated is on a GPU: tensors only, without the interpreter,
libraries, Python objects and allocator slack that the resident set (peak RSS) also
counts. On a GPU it reads torch.cuda.max_memory_allocated over step 2 itself. Writes
`<folder>/rank<R>.json`. A bench instrument, not part of runner.

The running total counts frees on every thread only with c10's flag
`caffe2_report_cpu_memory_usage` set. Without it, c10's CPU allocator subtracts a free
only on a thread that the profiler records (its state is thread-local), so tensors that
gloo's worker threads free (the all-reduce and all-gather buffers of DDP's reducer and
of ZeRO-3's prefetcher) stayed in the total: step 2's peak drifted up by 0 to 3 of
ZeRO-3's 49 MB gathered output heads from run to run. The flag is a plain exported
global of libc10 (`FLAGS_caffe2_report_cpu_memory_usage`, verified on torch 2.13.0); it
is set before any tensor exists, so the total is every live tensor of the process.

On a CPU `from_pretrained` maps the safetensors file: the weights of a pretrained base
are pages of that file, not the allocator's, so no allocation event counts them. Where
a strategy leaves them so (adapters on a frozen base under zero2 in fp32: DeepSpeed
copies only what trains; ddp, ZeRO-3's partitions, FSDP's shards and a bf16 cast all
copy them into the allocator) the step's peak reads low by the whole base, which on a
GPU is device memory like any other. The bytes of the model's tensors stored in a
mapped file (/proc/self/maps) are added to the peak.
"""

import os

if os.environ.get("RUNNER_BENCH_TENSOR_PEAK"):
    import ctypes
    import json
    import sys
    from pathlib import Path

    import torch

    try:
        ctypes.c_bool.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")),
                             "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError) as error:  # another build of torch: say the figures may drift
        print(f"tensor_peak: cannot count frees on other threads ({error}); step 2's peak may read high",
              file=sys.stderr)

    import runner.train.trainer as _trainer
    import runner.train.worker as _worker

    _PROFILED_STEP = 2
    _MARKER = "runner_bench_profiled_step"
    _state: dict = {}
    _plain_train, _plain_step = _worker.train, _trainer.Trainer.train_step

    def _train(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        from torch.profiler import ProfilerActivity, profile

        _state["prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        _state["prof"].__enter__()
        return _plain_train(spec, *args, **kwargs)  # the launch's start too (worker.run)

    def _step(self, batch):  # type: ignore[no-untyped-def]
        import torch

        if self.state.step + 1 != _PROFILED_STEP or "prof" not in _state:
            return _plain_step(self, batch)
        if self.accelerator.device.type == "cuda":  # on a GPU the allocator keeps the count itself
            _state.pop("prof").__exit__(None, None, None)
            torch.cuda.reset_peak_memory_stats(self.accelerator.device)
            done = _plain_step(self, batch)
            _write(self.accelerator.process_index, torch.cuda.max_memory_allocated(self.accelerator.device))
            return done
        # The step's window in the clock the allocation events carry: a marker event
        # around it, not this process's wall clock.
        with torch.profiler.record_function(_MARKER):
            done = _plain_step(self, batch)
        prof = _state.pop("prof")
        prof.__exit__(None, None, None)
        from torch._C._profiler import _EventType

        events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while pending:
            event = pending.pop()
            pending.extend(event.children)
            events.append(event)
        marker = next(e for e in events if e.name == _MARKER)
        start_ns, end_ns = marker.start_time_ns, marker.end_time_ns
        peak = 0
        for event in events:
            if event.typed[0] == _EventType.Allocation and str(event.typed[1].device) == "cpu":
                if start_ns <= event.start_time_ns <= end_ns:
                    peak = max(peak, event.typed[1].total_allocated)
        _write(self.accelerator.process_index, peak + _file_mapped_bytes(self.model))
        return done

    def _file_mapped_bytes(model) -> int:  # type: ignore[no-untyped-def]
        """Bytes of the model's tensors whose storage is a mapped file, not the allocator's."""
        files = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[5].startswith("/"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                files.append((low, high))
        from torch.distributed.tensor import DTensor

        storages = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            # FSDP2's parameters are DTensors: their storage is the local shard's
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            pointer = storage.data_ptr()
            if any(low <= pointer < high for low, high in files):
                storages[pointer] = storage.nbytes()  # tied weights share one storage
        return sum(storages.values())

    def _write(rank, peak_bytes):  # type: ignore[no-untyped-def]
        out = Path(os.environ["RUNNER_BENCH_TENSOR_PEAK"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps({"peak_mb": peak_bytes / 2**20}))

    _worker.train, _trainer.Trainer.train_step = _train, _step
