"""The batch arithmetic of a run, computed once and shown in the start banner."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from runner.config.spec import RunSpec, TrainSpec


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

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.world_size * self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.block_size

    @property
    def epochs(self) -> float:
        return self.total_steps / max(self.steps_per_epoch, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "global_batch_size": self.global_batch_size, "tokens_per_step": self.tokens_per_step}


def batches_per_rank(n_blocks: int, per_device_batch_size: int, world_size: int) -> int:
    """Accelerate shards whole batches round-robin and pads the last round (even_batches)."""
    return math.ceil(math.ceil(n_blocks / per_device_batch_size) / world_size)


def steps_per_epoch(batches_per_rank: int, grad_accum_steps: int) -> int:
    """Optimizer steps in one pass: the last, short accumulation still steps
    (Accelerate syncs at the end of the dataloader), as run_clm_no_trainer counts."""
    return math.ceil(batches_per_rank / grad_accum_steps)


def total_steps(max_steps: int | None, num_epochs: float, per_epoch: int) -> int:
    return max_steps if max_steps is not None else max(1, math.ceil(num_epochs * per_epoch))


def global_batch(train: "TrainSpec", world_size: int) -> int:
    """Sequences per optimizer step: per device x processes x accumulation."""
    return train.per_device_batch_size * world_size * train.grad_accum_steps


def plan_run(
    spec: "RunSpec",
    world_size: int,
    *,
    batches_per_rank: int,
    block_size: int,
    train_blocks: int,
    eval_blocks: int,
    parameters: int,
    precision: str,
    device: str,
) -> RunPlan:
    """The plan from the spec and what only the caller knows: the worker's prepared
    loader and model, or the dry run's estimates of them."""
    from runner.components.optim import effective_lr

    t = spec.train
    per_epoch = steps_per_epoch(batches_per_rank, t.grad_accum_steps)
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
    )


def banner(plan: RunPlan, run_dir: str) -> str:
    p = plan
    lines = [
        "runner: starting",
        f"  run folder     {run_dir}",
        f"  strategy       {p.strategy} on {p.world_size} process(es), device {p.device}, precision {p.precision}",
        f"  model          {p.parameters:,} parameters",
        f"  data           {p.train_blocks:,} train / {p.eval_blocks:,} eval blocks of {p.block_size} tokens",
        f"  global batch   {p.global_batch_size} = {p.per_device_batch_size} per device x {p.world_size} process(es)"
        f" x {p.grad_accum_steps} accumulation",
        f"  tokens/step    {p.tokens_per_step:,} = {p.global_batch_size} x {p.block_size}",
        f"  steps          {p.total_steps:,} ({p.epochs:.2f} epochs of {p.steps_per_epoch:,} steps),"
        f" {p.total_steps * p.tokens_per_step:,} tokens",
        f"  learning rate  {p.lr:g} configured, {p.effective_lr:g} in effect"
        + (f" ({p.lr_rule} scaling to global batch {p.global_batch_size})" if p.lr_rule != "none" else ""),
    ]
    return "\n".join(lines)


# The strategies the dry run compares and bench/strategy_memory.py measures; which of
# them shard gradients with optimizer state, and parameters too. A new strategy is one
# name here (and its buffers in _buffers).
COMPARED_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
SHARDS_GRADS_AND_OPTIMIZER = frozenset({"zero2", "zero3", "fsdp"})
SHARDS_PARAMS = frozenset({"zero3", "fsdp"})
ZERO = frozenset({"zero2", "zero3"})  # DeepSpeed: 16-bit working weights under bf16/fp16
# A GPT-2 block's weights in units of hidden²: attention 4h² (qkv 3h², projection h²), MLP 8h².
GPT2_LAYER_WEIGHTS = 12


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for model states (activations excluded), ZeRO paper arithmetic,
    plus the strategy's working buffers."""

    params: float
    grads: float
    optimizer: float
    offloaded: float  # moved to host memory by the offload options
    buffers: float = 0.0  # DDP's gradient buckets; ZeRO's reduce bucket and gathered parameters; FSDP's gathered units

    @property
    def device_total(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers


def _outside_layers(n: float, hidden_size: int, layers: int) -> float:
    """Parameters outside the transformer layers (GPT-2: the embeddings and final norm),
    each layer taken as GPT2_LAYER_WEIGHTS h² weights."""
    return max(n - layers * GPT2_LAYER_WEIGHTS * hidden_size * hidden_size, 0.0)


def _fsdp_buffers(n: float, compute_bytes: float, hidden_size: int, layers: int) -> float:
    """FSDP2 (runner/distributed/fsdp.py wraps each transformer layer and the root): the root's
    parameters (embeddings, final norm: all outside the layers) stay gathered through
    the step, at most two layers are gathered at once (the one computing and the one
    prefetched), both at the compute precision, and one layer's gradients wait in fp32
    for their reduce-scatter. A layer is taken as GPT-2's 12 h² weights."""
    layer = GPT2_LAYER_WEIGHTS * hidden_size * hidden_size
    return (_outside_layers(n, hidden_size, layers) + 2 * layer) * compute_bytes + layer * 4.0


def _buffers(n: float, strategy: str, weight_bytes: float, grad_bytes: float, hidden_size: Optional[int],
             layers: Optional[int] = None) -> float:
    """Working memory beyond the states, in bytes.

    ddp: torch's DDP reduces gradients through buckets that are a second copy of every
    gradient (Accelerate leaves gradient_as_bucket_view off). ZeRO: the reduce bucket
    (runner/accel.zero_sizes), and under ZeRO-3 the gathered parameters: a parameter is
    kept gathered while it is reused within one prefetch bucket (the reuse distance),
    so about a bucket is live, plus a parameter larger than a bucket gathered alone:
    GPT-2's embedding, taken as everything outside the layers when `layers` is known
    (the whole model otherwise), at the working precision. Unknown width (hidden_size
    None): ZeRO's buffers are left out."""
    if strategy == "ddp":
        return n * grad_bytes
    if strategy not in ZERO or not hidden_size:
        return 0.0
    from runner.distributed.accelerator import zero_sizes

    stage = 3 if strategy in SHARDS_PARAMS else 2
    sizes = zero_sizes(stage, hidden_size)
    total = sizes["reduce_bucket_size"] * grad_bytes
    if stage == 3:
        largest = _outside_layers(n, hidden_size, layers) if layers else n
        total += (largest + sizes["stage3_prefetch_bucket_size"]) * weight_bytes
    return float(total)


def estimate_memory(
    n_params: int, strategy: str, precision: str, world_size: int, offload_optimizer: bool = False, offload_params: bool = False,
    hidden_size: Optional[int] = None,
    layers: Optional[int] = None,
) -> MemoryEstimate:
    """Per-rank bytes for parameters, gradients and AdamW state, and working buffers.

    DDP with Accelerate's autocast keeps fp32 weights and gradients whatever the
    precision: 4 + 4 bytes, plus Adam's two fp32 moments, 8: 16 bytes per parameter.
    DeepSpeed with bf16/fp16 keeps 16-bit weights and gradients (2 + 2) and an fp32
    master copy with the moments (12); in fp32, 4 + 4 + 8. ZeRO-2 divides gradients
    and optimizer state by the world size, ZeRO-3 the weights too; offload moves the
    optimizer state (and, for ZeRO-3, the weights) to host memory. hidden_size (the
    model's width) sizes ZeRO's buffers (_buffers). fsdp (FSDP2) keeps fp32 shards of
    all three whatever the precision (its mixed precision casts a gathered copy), and
    its CPU offload moves all three to the host; its buffers need `layers` as well.
    """
    n, w = float(n_params), max(world_size, 1)
    half = precision in ("bf16", "fp16") and strategy in ZERO
    weight_bytes, grad_bytes, optim_bytes = (2.0, 2.0, 12.0) if half else (4.0, 4.0, 8.0)
    params, grads, optimizer = n * weight_bytes, n * grad_bytes, n * optim_bytes
    if strategy in SHARDS_GRADS_AND_OPTIMIZER:
        grads, optimizer = grads / w, optimizer / w
    if strategy in SHARDS_PARAMS:
        params = params / w
    offloaded = 0.0
    if offload_optimizer and strategy in ZERO:
        offloaded += optimizer
        optimizer = 0.0
    if offload_params and strategy == "fsdp":
        offloaded += params + grads + optimizer
        params = grads = optimizer = 0.0
    elif offload_params and strategy in SHARDS_PARAMS:
        offloaded += params
        params = 0.0
    if strategy == "fsdp":
        compute_bytes = 2.0 if precision in ("bf16", "fp16") else 4.0
        buffers = _fsdp_buffers(n, compute_bytes, hidden_size, layers) if hidden_size and layers else 0.0
    else:
        buffers = _buffers(n, strategy, weight_bytes, grad_bytes, hidden_size, layers)
    return MemoryEstimate(params, grads, optimizer, offloaded, buffers)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


def dry_run_report(plan: RunPlan, estimate: MemoryEstimate, comparison: dict[str, MemoryEstimate]) -> str:
    p = plan
    lines = [
        "runner: dry run (nothing trained, no run folder written)",
        f"  world size      {p.world_size} ({p.strategy}, precision {p.precision}, device {p.device})",
        f"  global batch    {p.global_batch_size} = {p.per_device_batch_size} per device x {p.world_size} process(es)"
        f" x {p.grad_accum_steps} accumulation",
        f"  tokens/step     {p.tokens_per_step:,} = {p.global_batch_size} x {p.block_size}",
        f"  steps           {p.total_steps:,} ({p.epochs:.2f} epochs of {p.steps_per_epoch:,} steps over "
        f"{p.train_blocks:,} blocks)",
        f"  tokens          {p.total_steps * p.tokens_per_step:,}",
        f"  parameters      {p.parameters:,}",
        f"  learning rate   {p.lr:g} configured, {p.effective_lr:g} in effect",
        "  memory per rank (model states; activations come on top):",
        f"    parameters    {_gib(estimate.params)}",
        f"    gradients     {_gib(estimate.grads)}",
        f"    optimizer     {_gib(estimate.optimizer)}",
        f"    buffers       {_gib(estimate.buffers)}  (DDP's gradient buckets; ZeRO's reduce bucket and gathered parameters; FSDP's gathered root and layers)",
        f"    total         {_gib(estimate.device_total)}"
        + (f"  (+ {_gib(estimate.offloaded)} offloaded to host memory)" if estimate.offloaded else ""),
        "  per rank under each strategy: "
        + " | ".join(f"{name} {_gib(est.device_total)}" for name, est in comparison.items()),
    ]
    return "\n".join(lines)
