"""model.compile=true: torch.compile of each transformer layer, in place, under every
strategy; and what compiling cost (its time, apart from the steps', and recompilations).

Per layer, as torchtitan compiles each block under FSDP2: the layers are identical, so
dynamo traces one and every other layer reuses its graph (parameters are graph inputs,
torch._dynamo.config.inline_inbuilt_nn_modules), and the embedding, the head and the loss
(runner/components/chunked_loss.py) stay eager. In place (`Module.compile`), before the
strategy wraps the model: the module tree, its state-dict keys and every wrapper runner
unwraps stay as they are, and the hooks DDP, DeepSpeed ZeRO and FSDP2 install on a layer
afterwards still run on its call path (nn.Module._call_impl is what is compiled).
Accelerate's own dynamo_backend is not used: it compiles the whole model, or per region
through three different paths (a copy of the module tree under DDP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Enough to keep every compile of a run (torch keeps the last 64 by default).
_METRICS_KEPT = 100_000


def compile_layers(model: torch.nn.Module, layer_classes: Sequence[str]) -> int:
    """Compile each module whose class is one of `layer_classes` (the model's
    transformer layers, transformers' _no_split_modules), in place; returns how many."""
    from torch._dynamo.utils import set_compilation_metrics_limit

    # A fresh start for this run: an earlier run in this process (a sweep's job, runs in
    # turn) left cache entries guarded on its own modules, which would count toward
    # dynamo's recompile limit (8 a function, then it runs eagerly) and its statistics.
    torch._dynamo.reset()
    set_compilation_metrics_limit(_METRICS_KEPT)
    names = set(layer_classes)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        layer.compile(backend="inductor")
    return len(layers)


@dataclass(frozen=True)
class CompileStats:
    """What torch.compile has cost this process so far."""

    seconds: float  # dynamo's frame compiles (forward graphs, with inductor) and AOTAutograd's backward compiles
    frames: int  # frames compiled: the first of each compiled function, recompilations, graph-break resumes
    recompilations: int  # frames compiled again after a guard failed (another shape, grad mode, ...)
    graph_breaks: int

    def minus(self, earlier: "CompileStats") -> "CompileStats":
        return CompileStats(self.seconds - earlier.seconds, self.frames - earlier.frames,
                            self.recompilations - earlier.recompilations, self.graph_breaks - earlier.graph_breaks)


NO_COMPILE = CompileStats(0.0, 0, 0, 0)


def compile_stats() -> CompileStats:
    """torch's own compile metrics (torch._dynamo.utils, as on torch 2.13): each frame
    compile's record names its recompile number (compile id "frame/recompile"); the
    backward graphs, compiled lazily at the first backward, are timed apart."""
    from torch._dynamo.utils import compilation_time_metrics, counters, get_compilation_metrics

    records = get_compilation_metrics()
    recompiles = sum(1 for r in records if _recompile_number(r) > 0)
    forward = sum(r.entire_frame_compile_time_s or 0.0 for r in records)
    backward = sum(compilation_time_metrics.get("backward._backward_impl", []))
    breaks = sum(counters["graph_break"].values())
    return CompileStats(forward + backward, len(records), recompiles, breaks)


def _recompile_number(record: Any) -> int:
    compile_id = str(getattr(record, "compile_id", "") or "")
    _, _, number = compile_id.partition("/")
    try:
        return int(number.split("_")[0])
    except ValueError:
        return 0
