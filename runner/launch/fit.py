"""Will it fit: each rank's peak memory (model states, strategy buffers and one traced
micro-batch's activations, or one evaluation batch's where evaluation holds more) against
the memory of the device the run is on or names (`launch.device_memory`), the largest
micro-batch that fits at the same global batch, and the refusal of a run predicted not
to fit (`launch.check_fit`), naming what decides it."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import torch

from runner.components.adapters import add_adapters, uses_adapters
from runner.components.model import build_config, count_parameters, count_trainable_parameters, layer_parameters
from runner.components.step_trace import EvaluationTrace, Numerics, StepTrace, trace_evaluation, trace_step
from runner.config.batch import eval_batch_size
from runner.config.errors import UserError
from runner.config.spec import ObjectiveKind, OffloadDevice, PeftSpec, ReferenceMode, RunSpec
from runner.config.validate import reference_mode
from runner.launch.memory_estimate import (MemoryEstimate, estimate_memory, generation_bytes, with_activations,
                                          with_evaluation, with_generation)

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


# Traces by everything a trace reads (_traced), for the life of the process: a sweep's
# jobs, certify's legs and a resume plan the same model again (certify gpt2 llama qwen3:
# 24 claims traced in 17.6 s of 23; the four strategies trace alike in fp32).
_TRACED: dict[tuple[Any, ...], Any] = {}


def _traced(kind: Any, spec: RunSpec, config: Any, batch: int, block_size: int, how: Numerics, gpu: bool,
            pairs: bool) -> Any:
    """trace_step or trace_evaluation (`kind`) of this model and batch, traced once a process."""
    # A preference run trains with dropout off by default (preference.disable_dropout): its
    # masks are not kept for backward. Evaluation runs in eval mode, without them anyway.
    extra = {"dropout": not (pairs and spec.preference.disable_dropout)} if kind is trace_step else {}
    key = (kind, repr(spec.model), config.to_json_string(), batch, block_size, spec.precision.kind.value,
           how, gpu, repr(spec.peft), pairs, tuple(extra.items()))
    if key not in _TRACED:
        _TRACED[key] = kind(spec.model, config, batch, block_size, spec.precision.kind.value, how, gpu_kernels=gpu,
                            peft=spec.peft, pairs=pairs, **extra)
    return _TRACED[key]


class Planner:
    """Per-rank peaks of one run spec under any strategy and micro-batch. Traces are
    cached (_traced): the dry run's table, the fit check and the auto micro-batch ask for
    the same few again, and so do a sweep's jobs."""

    def __init__(self, spec: RunSpec, block_size: int, world: int, gpu: bool = False):
        """`gpu`: the ranks are GPUs (Budget.gpu), whose fused attention kernels keep less
        than the CPU's (runner/components/step_trace.py gpu_attention_kernels). Nothing is
        built until an estimate is asked for (a run with launch.check_fit=false asks none)."""
        self.spec, self.block_size, self.world, self.gpu = spec, block_size, world, gpu
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
        return _traced(trace_step, self.spec, self.config, micro_batch, self.block_size, how, self.gpu, self.pairs)

    def evaluation(self, batch: int, how: Numerics) -> EvaluationTrace:
        return _traced(trace_evaluation, self.spec, self.config, batch, self.block_size, how, self.gpu, self.pairs)

    def eval_batch(self, micro_batch: Optional[int] = None) -> int:
        """The evaluation batch the run uses at `micro_batch`: train.per_device_eval_batch_size,
        else the micro-batch (runner/train/loaders.py)."""
        return eval_batch_size(self.spec.train, micro_batch)

    def estimate(self, strategy: str, micro_batch: Optional[int] = None, grad_accum_steps: Optional[int] = None,
                 own_offload: bool = True, eval_batch: Optional[int] = None,
                 bounded_untraced: bool = True) -> MemoryEstimate:
        """Rank peak under `strategy` at `micro_batch` (default: the spec's), its training
        step's or its evaluation's (at `eval_batch`, default: the run's at that micro-batch).
        The spec's offload options apply when `own_offload` (the run's own strategy).
        `bounded_untraced`: an evaluation the training step bounds is not traced (below)."""
        s = self.spec
        precision = s.precision.kind.value
        offload_opt = own_offload and s.strategy.offload_optimizer is OffloadDevice.cpu
        offload_par = own_offload and s.strategy.offload_params is OffloadDevice.cpu
        states = estimate_for(self.shape, strategy, precision, self.world, offload_opt, offload_par, self.frozen)
        b = micro_batch or s.train.per_device_batch_size
        accum = grad_accum_steps if grad_accum_steps is not None else s.train.grad_accum_steps
        how, evaluated = numerics(strategy, precision), eval_batch or self.eval_batch(b)
        trace = self.trace(b, how)
        training = with_activations(states, trace, strategy, self.world, accum)
        if s.train.objective.online_rl:  # sampling between steps: a group's KV cache and logits
            training = with_generation(training, generation_bytes(self.config, s.rl.num_generations, self.block_size),
                                       strategy)
        if bounded_untraced and trace.chunked and evaluated <= b:
            # The chunked head evaluating a batch no larger than the micro-batch holds less
            # than the step's forward (the same forward without what it saves for backward,
            # and a chunk's logits as the loss's): not traced.
            return training
        return with_evaluation(training, self.evaluation(evaluated, how).peak, strategy)

    def largest_micro_batch(self, strategy: str, per_rank_batch: int, limit: float,
                            own_offload: bool = True, evaluation: bool = True) -> Optional[int]:
        """The largest micro-batch dividing `per_rank_batch` (so an integer accumulation keeps
        the global batch) whose peak stays within `limit` bytes; None if not even 1 fits.
        `evaluation`: the run's evaluation counts (else the training step's peak alone).
        Peaks grow with the micro-batch, so a binary search over the divisors."""
        divisors = [d for d in range(1, per_rank_batch + 1) if per_rank_batch % d == 0]

        def fits(b: int) -> bool:
            estimate = self.estimate(strategy, b, per_rank_batch // b, own_offload)
            return (estimate.device_total if evaluation else estimate.training_total) <= limit

        return _largest(divisors, fits)

    def largest_eval_batch(self, strategy: str, limit: float, below: int,
                           micro_batch: Optional[int] = None) -> Optional[int]:
        """The largest evaluation batch under `below` whose evaluation stays within `limit`
        bytes (at `micro_batch`, default the run's: what is allocated while evaluating does
        not depend on it); None if not even 1 does."""
        def fits(e: int) -> bool:
            return self.estimate(strategy, micro_batch, eval_batch=e, bounded_untraced=False).evaluation_total <= limit

        return _largest(list(range(1, below)), fits)


def _largest(sizes: list[int], fits: Any) -> Optional[int]:
    """The largest of ascending `sizes` that `fits`, which holds up to some size and not
    beyond (peaks grow with the batch): a binary search; None if none fits."""
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            best, lo = sizes[mid], mid + 1
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


def decided(estimate: MemoryEstimate) -> str:
    """" (evaluation)" where evaluation is the peak; nothing where the training step is."""
    return " (evaluation)" if estimate.decided_by == "evaluation" else ""


def verdict_lines(planner: Planner, strategies: tuple[str, ...], room: Budget) -> list[str]:
    """For each strategy: its peak (marked where evaluation decides it), whether it fits
    `room`, the headroom, and the largest micro-batch that fits at the same global batch."""
    spec, world = planner.spec, planner.world
    share = per_rank_batch(spec)
    global_batch = share * world
    lines = [f"  fits on {room.described}? per rank, global batch {global_batch} kept:"]
    for strategy in strategies:
        own = strategy == spec.strategy.kind.value
        estimate = planner.estimate(strategy, own_offload=own)
        peak = estimate.device_total
        verdict = (f"fits, {gib(room.bytes_per_rank - peak)} headroom" if peak <= room.bytes_per_rank
                   else f"does not fit ({gib(peak - room.bytes_per_rank)} over)")
        lines.append(f"    {strategy:<6} peak {gib(peak):>11}{decided(estimate)}  {verdict}; "
                     f"{_best(planner, strategy, share, room.bytes_per_rank, own)}")
    return lines


def _best(planner: Planner, strategy: str, share: int, limit: float, own: bool) -> str:
    """The largest micro-batch that fits with its evaluation; where none does only because
    of a given evaluation batch (what evaluation holds does not depend on the micro-batch),
    the largest whose training step fits, and that the evaluation batch does not."""
    largest = planner.largest_micro_batch(strategy, share, limit, own_offload=own)
    if largest is not None:
        return f"largest micro-batch {largest} x {share // largest} accumulation"
    trained = (planner.largest_micro_batch(strategy, share, limit, own_offload=own, evaluation=False)
               if planner.spec.train.per_device_eval_batch_size else None)
    if trained is None:
        return "no micro-batch fits, not even 1"
    return (f"largest micro-batch {trained} x {share // trained} accumulation, but not its evaluation at batch "
            f"{planner.eval_batch()} (train.per_device_eval_batch_size)")


def evaluation_fix(planner: Planner, strategy: str, limit: float, micro_batch: Optional[int] = None) -> str:
    """What makes the run's evaluation fit: the largest evaluation batch that does, or
    model.chunked_loss=true where the chunked head would evaluate (it is off, not refused)."""
    spec, batch = planner.spec, planner.eval_batch(micro_batch)
    estimate = planner.estimate(strategy, micro_batch, eval_batch=batch, bounded_untraced=False)
    chunked = planner.evaluation(batch, numerics(strategy, spec.precision.kind.value)).chunked
    held = "" if chunked else ", the whole logits and the loss's fp32 temporaries"
    largest = planner.largest_eval_batch(strategy, limit, batch, micro_batch)
    fix = ("not even an evaluation batch of 1 fits" if largest is None else
           f"train.per_device_eval_batch_size={largest} fits")
    if not spec.model.chunked_loss:
        fix += " (or model.chunked_loss=true: evaluation through the chunked head, without the whole logits)"
    elif largest is None:
        fix += f"; choose {WAYS_OUT}"
    return f"evaluation at batch {batch} needs {gib(estimate.evaluation_total)}{held}: {fix}"


def fit_fixes(planner: Planner, strategy: str, estimate: MemoryEstimate, limit: float) -> str:
    """What to change: the evaluation batch where evaluation does not fit, a smaller
    micro-batch (more accumulation) where the training step does not. An evaluation batch
    left unset follows the micro-batch: where both are over, a smaller micro-batch that
    fits with its evaluation is the one change."""
    share = per_rank_batch(planner.spec)
    explicit = planner.spec.train.per_device_eval_batch_size is not None
    training_over = estimate.training_total > limit
    fixes = ([evaluation_fix(planner, strategy, limit)]
             if estimate.evaluation_total > limit and (explicit or not training_over) else [])
    if training_over:
        largest = planner.largest_micro_batch(strategy, share, limit, evaluation=not fixes)
        fixes.append(f"no micro-batch fits: choose {WAYS_OUT}" if largest is None else
                     f"train.per_device_batch_size={largest} train.grad_accum_steps={share // largest} keeps the "
                     f"global batch {share * planner.world} and fits")
    return "; ".join(fixes)


def nothing_fits(planner: Planner, strategy: str, share: int, limit: float) -> str:
    """What to change when not even a micro-batch of 1 is predicted to fit: its evaluation's
    batch where evaluation alone does not fit, else another layout (WAYS_OUT)."""
    if planner.estimate(strategy, 1, share).training_total <= limit:
        return evaluation_fix(planner, strategy, limit, 1)
    return f"choose {WAYS_OUT}"


def check_fit(spec: RunSpec, planner: Planner, room: Budget) -> None:
    """Refuse, in one line, a run predicted not to fit (launch.check_fit=false lets it start).
    An elastic run (launch.min_workers) must fit in its smallest group too: sharded states
    (ZeRO, FSDP) are split among fewer ranks there, so each holds more."""
    if not spec.launch.check_fit:
        return
    planned = _check_fit_at(spec, planner, room)
    fewest = spec.launch.min_workers
    if planned and fewest is not None and fewest < planner.world:
        try:
            _check_fit_at(spec, Planner(spec, planner.block_size, fewest, planner.gpu), budget(spec, fewest))
        except UserError as err:
            raise UserError(f"launch.min_workers={fewest}: in a group of {fewest} worker(s), {err.problems[0]} Or "
                            "raise launch.min_workers.") from None


def _check_fit_at(spec: RunSpec, planner: Planner, room: Budget) -> bool:
    """Whether there was a plan to check (refused when it does not fit)."""
    strategy = spec.strategy.kind.value
    try:
        estimate = planner.estimate(strategy)
    except Exception as err:  # a model the fake-tensor trace cannot run must still train
        sys.stderr.write(f"runner: note: no memory plan for this model ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}); the run starts unchecked\n")
        return False
    peak = estimate.device_total
    if peak <= room.bytes_per_rank:
        return True
    raise UserError(f"this run is predicted not to fit: {gib(peak)} per rank{decided(estimate)} under {strategy} at "
                    f"micro-batch {spec.train.per_device_batch_size}, {gib(room.bytes_per_rank)} available on "
                    f"{room.described}; {fit_fixes(planner, strategy, estimate, room.bytes_per_rank)} (dry_run=true "
                    "shows the plan; launch.check_fit=false starts it anyway).")
