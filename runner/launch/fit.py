"""Will it fit: each rank's peak memory (model states, strategy buffers and one traced
micro-batch's activations) against the memory of the device the run is on or names
(`launch.device_memory`), the largest micro-batch that fits at the same global batch,
and the refusal of a run predicted not to fit (`launch.check_fit`)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import torch

from runner.components.adapters import add_adapters, uses_adapters
from runner.components.model import build_config, count_parameters, count_trainable_parameters, layer_parameters
from runner.components.step_trace import Numerics, StepTrace, trace_step
from runner.config.errors import UserError
from runner.config.spec import ObjectiveKind, OffloadDevice, PeftSpec, ReferenceMode, RunSpec
from runner.config.validate import reference_mode
from runner.launch.memory_estimate import MemoryEstimate, estimate_memory, with_activations

# Memory of the GPUs people name, in GiB (what torch.cuda reports as total_memory, rounded).
# A name with no size picks the larger variant (A100 -> 80); `A100-40GB` names the other.
GPU_MEMORY_GIB: dict[str, float] = {
    "T4": 15, "V100": 32, "V100-16GB": 16, "A10": 22, "A10G": 22, "L4": 22, "A40": 44.4, "L40": 44.4, "L40S": 44.4,
    "A6000": 47.5, "A100": 79.2, "A100-80GB": 79.2, "A100-40GB": 39.4, "H100": 79.2, "H100-80GB": 79.2, "H200": 139.8,
    "B200": 178.4, "RTX3090": 23.6, "RTX4090": 23.6, "MI250X": 64, "MI300X": 192,
}
# A GPU's memory that tensors cannot have: the CUDA context, cuBLAS/NCCL workspaces and
# the caching allocator's fragmentation. Fixed, documented, and shown as "usable".
GPU_RESERVE_BYTES = 1.5 * 2**30
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|G|MiB|MB|M|TiB|TB|T)?\s*$", re.IGNORECASE)
_UNITS = {"t": 2**40, "tb": 10**12, "tib": 2**40, "g": 2**30, "gb": 10**9, "gib": 2**30, "m": 2**20, "mb": 10**6,
          "mib": 2**20}


@dataclass(frozen=True)
class Budget:
    """What one rank may hold."""

    bytes_per_rank: float
    described: str  # "8 x A40 (44.4 GiB each, 42.9 GiB usable)"
    gpu: bool


def parse_device_memory(value: str) -> tuple[float, bool]:
    """(bytes, is a GPU name) for `launch.device_memory`: a GPU's name (A40, H100, A100-40GB)
    or a size (80GB, 48GiB, 24G; G means GiB). A UserError names both forms."""
    key = value.strip().upper().replace(" ", "").replace("NVIDIA", "")
    for name, gib in GPU_MEMORY_GIB.items():
        if key == name.upper():
            return gib * 2**30, True
    match = _SIZE.match(value)
    if match:
        unit = (match.group(2) or "G").lower()
        return float(match.group(1)) * _UNITS[unit], False
    raise UserError(f"launch.device_memory={value} is neither a GPU this runner knows ({', '.join(GPU_MEMORY_GIB)}) "
                    "nor a size such as 80GB or 48GiB. Give one of those.")


def _host_available() -> float:
    import psutil

    return float(psutil.virtual_memory().available)


def local_processes(spec: RunSpec, world: int) -> int:
    return max(world // max(spec.launch.nnodes, 1), 1)


def _gpu_budget(size: float, name: str, world: int) -> Budget:
    usable = size - GPU_RESERVE_BYTES
    return Budget(usable, f"{world} x {name} ({size / 2**30:.1f} GiB each, {usable / 2**30:.1f} GiB usable)", True)


def budget(spec: RunSpec, world: int) -> Budget:
    """The run's memory per rank: `launch.device_memory` when given; else this machine's
    GPU (the smallest visible one), less GPU_RESERVE_BYTES; else, on a CPU, the host memory
    available now shared by this node's ranks."""
    if spec.launch.device_memory:
        size, named = parse_device_memory(spec.launch.device_memory)
        if named:
            return _gpu_budget(size, spec.launch.device_memory, world)
        return Budget(size, f"{world} x {spec.launch.device_memory}", False)
    if torch.cuda.is_available():
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        return _gpu_budget(float(min(sizes)), torch.cuda.get_device_name(0), world)
    local = local_processes(spec, world)
    available = _host_available()
    return Budget(available / local, f"this machine's host memory ({available / 2**30:.1f} GiB available, "
                  f"{local} rank(s))", False)


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of the model."""

    parameters: int
    hidden_size: Optional[int]  # sizes ZeRO's buckets (runner/distributed/deepspeed.py zero_sizes)
    layers: Optional[int] = None  # transformer layers: FSDP2 gathers one or two at a time
    layer_parameters: Optional[int] = None  # one layer's, counted on the model's module tree
    trainable: Optional[int] = None  # with adapters (peft=lora|dora): theirs; None: every parameter trains


def shape_of(config: Any, peft: Optional[PeftSpec] = None) -> ModelShape:
    """The model `config` describes, with the run's adapters, built on the meta device (no
    memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        layer = layer_parameters(model)
        if peft is not None and uses_adapters(peft):
            model = add_adapters(peft, model)
    trainable = count_trainable_parameters(model) if peft is not None and uses_adapters(peft) else None
    return ModelShape(count_parameters(model), getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None),
                      layer, trainable)


def model_shape(spec: RunSpec) -> ModelShape:
    """The model the run would build."""
    return shape_of(build_config(spec.model), spec.peft)


def estimate_for(shape: ModelShape, strategy: str, precision: str, world_size: int, offload_optimizer: bool = False,
                 offload_params: bool = False, frozen_reference: bool = False) -> MemoryEstimate:
    """Per-rank memory of this model's states and the strategy's buffers (no activations);
    `frozen_reference`: with a frozen copy of the starting weights (without adapters)."""
    reference = shape.parameters - (shape.trainable or 0) if frozen_reference else 0
    return estimate_memory(shape.parameters, strategy, precision, world_size, offload_optimizer, offload_params,
                           hidden_size=shape.hidden_size, layers=shape.layers, cuda=torch.cuda.is_available(),
                           layer_parameters=shape.layer_parameters, trainable=shape.trainable, reference=reference)


def numerics(strategy: str, precision: str) -> Numerics:
    """What dtypes a strategy computes in (runner/distributed: ddp autocasts over fp32
    weights; fsdp gathers low-precision weights under autocast; DeepSpeed's ZeRO holds
    low-precision weights and runs without autocast)."""
    if precision == "fp32":
        return Numerics.fp32
    if strategy == "ddp":
        return Numerics.autocast
    return Numerics.half_autocast if strategy == "fsdp" else Numerics.half


class Planner:
    """Per-rank peaks of one run spec under any strategy and micro-batch. Traces are
    cached: the dry run's table, the fit check and the auto micro-batch ask for the same
    few again."""

    def __init__(self, spec: RunSpec, block_size: int, world: int, gpu: bool = False):
        """`gpu`: the ranks are GPUs (Budget.gpu), whose fused attention kernels keep less
        than the CPU's (runner/components/step_trace.py gpu_attention_kernels). Nothing is
        built until an estimate is asked for (a run with launch.check_fit=false asks none)."""
        self.spec, self.block_size, self.world, self.gpu = spec, block_size, world, gpu
        self._traces: dict[tuple[int, Numerics], StepTrace] = {}
        # A preference objective's micro-batch is pairs: twice as many sequences.
        self.pairs = spec.train.objective is ObjectiveKind.dpo
        self.frozen = self.pairs and reference_mode(spec) is ReferenceMode.frozen  # a second copy of the weights

    @cached_property
    def config(self) -> Any:
        return build_config(self.spec.model)

    @cached_property
    def shape(self) -> ModelShape:
        return shape_of(self.config, self.spec.peft)

    def trace(self, micro_batch: int, how: Numerics) -> StepTrace:
        key = (micro_batch, how)
        if key not in self._traces:
            self._traces[key] = trace_step(self.spec.model, self.config, micro_batch, self.block_size,
                                           self.spec.precision.kind.value, how, gpu_kernels=self.gpu,
                                           peft=self.spec.peft, pairs=self.pairs)
        return self._traces[key]

    def estimate(self, strategy: str, micro_batch: Optional[int] = None, grad_accum_steps: Optional[int] = None,
                 own_offload: bool = True) -> MemoryEstimate:
        """Rank peak under `strategy` at `micro_batch` (default: the spec's). The spec's
        offload options apply when `own_offload` (the run's own strategy)."""
        s = self.spec
        precision = s.precision.kind.value
        offload_opt = own_offload and s.strategy.offload_optimizer is OffloadDevice.cpu
        offload_par = own_offload and s.strategy.offload_params is OffloadDevice.cpu
        states = estimate_for(self.shape, strategy, precision, self.world, offload_opt, offload_par, self.frozen)
        b = micro_batch or s.train.per_device_batch_size
        accum = grad_accum_steps if grad_accum_steps is not None else s.train.grad_accum_steps
        return with_activations(states, self.trace(b, numerics(strategy, precision)), strategy, self.world, accum)

    def largest_micro_batch(self, strategy: str, per_rank_batch: int, limit: float,
                            own_offload: bool = True) -> Optional[int]:
        """The largest micro-batch dividing `per_rank_batch` (so an integer accumulation keeps
        the global batch) whose peak stays within `limit` bytes; None if not even 1 fits.
        Peaks grow with the micro-batch, so a binary search over the divisors."""
        divisors = [d for d in range(1, per_rank_batch + 1) if per_rank_batch % d == 0]
        lo, hi, best = 0, len(divisors) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            b = divisors[mid]
            if self.estimate(strategy, b, per_rank_batch // b, own_offload).device_total <= limit:
                best, lo = b, mid + 1
            else:
                hi = mid - 1
        return best


def gib(n_bytes: float) -> str:
    """GiB from 1 GiB up (either sign), MiB below."""
    return f"{n_bytes / 2**30:,.2f} GiB" if abs(n_bytes) >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


# What to change when not even a micro-batch of 1 fits (the refusal's and auto's message).
WAYS_OUT = ("a sharding strategy (strategy=zero3 or fsdp), more processes, model.gradient_checkpointing=true or a "
            "smaller data.block_size")


def per_rank_batch(spec: RunSpec) -> int:
    """Sequences each rank handles per optimizer step: the global batch over the ranks."""
    return spec.train.per_device_batch_size * spec.train.grad_accum_steps


def verdict_lines(planner: Planner, strategies: tuple[str, ...], room: Budget) -> list[str]:
    """For each strategy: its peak, whether it fits `room`, the headroom, and the largest
    micro-batch that fits at the same global batch."""
    spec, world = planner.spec, planner.world
    share = per_rank_batch(spec)
    global_batch = share * world
    lines = [f"  fits on {room.described}? per rank, global batch {global_batch} kept:"]
    for strategy in strategies:
        own = strategy == spec.strategy.kind.value
        peak = planner.estimate(strategy, own_offload=own).device_total
        largest = planner.largest_micro_batch(strategy, share, room.bytes_per_rank, own_offload=own)
        verdict = (f"fits, {gib(room.bytes_per_rank - peak)} headroom" if peak <= room.bytes_per_rank
                   else f"does not fit ({gib(peak - room.bytes_per_rank)} over)")
        best = ("no micro-batch fits, not even 1" if largest is None else
                f"largest micro-batch {largest} x {share // largest} accumulation")
        lines.append(f"    {strategy:<6} peak {gib(peak):>11}  {verdict}; {best}")
    return lines


def check_fit(spec: RunSpec, planner: Planner, room: Budget) -> None:
    """Refuse, in one line, a run predicted not to fit (launch.check_fit=false lets it start)."""
    if not spec.launch.check_fit:
        return
    strategy = spec.strategy.kind.value
    try:
        peak = planner.estimate(strategy).device_total
    except Exception as err:  # a model the fake-tensor trace cannot run must still train
        sys.stderr.write(f"runner: note: no memory plan for this model ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}); the run starts unchecked\n")
        return
    if peak <= room.bytes_per_rank:
        return
    share = per_rank_batch(spec)
    largest = planner.largest_micro_batch(strategy, share, room.bytes_per_rank)
    fix = (f"no micro-batch fits: choose {WAYS_OUT}" if largest is None else
           f"train.per_device_batch_size={largest} train.grad_accum_steps={share // largest} keeps the global batch "
           f"{share * planner.world} and fits")
    raise UserError(f"this run is predicted not to fit: {gib(peak)} per rank under {strategy} at micro-batch "
                    f"{spec.train.per_device_batch_size}, {gib(room.bytes_per_rank)} available on {room.described}; "
                    f"{fix} (dry_run=true shows the plan; launch.check_fit=false starts it anyway).")

