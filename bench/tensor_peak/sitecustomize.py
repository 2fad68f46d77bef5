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
mapped file (/proc/self/maps) are added to the peak, and those of a frozen reference
copy (preference.reference=frozen) likewise.

The measuring itself is step_peak.py's (this folder), which a worker that is not
runner's (bench/preference.py's TRL worker) uses through its Trainer callback.
"""

import os

if os.environ.get("RUNNER_BENCH_TENSOR_PEAK"):
    import step_peak  # this folder is on sys.path: that is how this file was imported

    step_peak.count_frees_on_every_thread()

    import runner.train.trainer as _trainer
    import runner.train.worker as _worker

    _state: dict = {}
    _plain_train, _plain_step = _worker.train, _trainer.Trainer.train_step

    def _train(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        _state["prof"] = step_peak.start_profile()
        return _plain_train(spec, *args, **kwargs)  # the launch's start too (worker.run)

    def _step(self, batch):  # type: ignore[no-untyped-def]
        import torch

        if self.state.step + 1 != step_peak.PROFILED_STEP or "prof" not in _state:
            return _plain_step(self, batch)
        if self.accelerator.device.type == "cuda":  # on a GPU the allocator keeps the count itself
            _state.pop("prof").__exit__(None, None, None)
            torch.cuda.reset_peak_memory_stats(self.accelerator.device)
            done = _plain_step(self, batch)
            step_peak.write(self.accelerator.process_index, torch.cuda.max_memory_allocated(self.accelerator.device))
            return done
        with torch.profiler.record_function(step_peak.MARKER):
            done = _plain_step(self, batch)
        peak = step_peak.peak_in_marker(_state.pop("prof"))
        # preference.reference=frozen's copy loads from the same folder, mapped too
        frozen = getattr(getattr(self.objective, "reference", None), "model", None)
        models = (self.model,) if frozen is None else (self.model, frozen)
        step_peak.write(self.accelerator.process_index, peak + step_peak.file_mapped_bytes(*models))
        return done

    _worker.train, _trainer.Trainer.train_step = _train, _step
