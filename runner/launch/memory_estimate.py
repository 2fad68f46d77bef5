"""Per-rank memory of model states and strategy buffers, by the ZeRO paper's arithmetic
(what `dry_run=true` prints and bench/strategy_memory.py sets beside what it measures)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol

from runner.distributed.deepspeed import GPT2_LAYER_WEIGHTS, zero_sizes

# The strategies the dry run compares and bench/strategy_memory.py measures; which of
# them shard gradients with optimizer state, and parameters too. A new strategy is one
# name here (and its buffers in _buffers).
COMPARED_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
SHARDS_GRADS_AND_OPTIMIZER = frozenset({"zero2", "zero3", "fsdp"})
SHARDS_PARAMS = frozenset({"zero3", "fsdp"})
ZERO = frozenset({"zero2", "zero3"})  # DeepSpeed: 16-bit working weights under bf16/fp16


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for model states (activations excluded), ZeRO paper arithmetic,
    plus the strategy's working buffers."""

    params: float
    grads: float
    optimizer: float
    offloaded: float  # moved to host memory by the offload options
    buffers: float = 0.0  # DDP's gradient buckets; ZeRO's reduce bucket and gathered parameters; FSDP's gathered units
    # One micro-batch's activations, with the gradients backward holds alongside them at
    # their peak beyond `grads_at_rest` (with_activations); 0 when not traced.
    activations: float = 0.0
    grads_at_rest: Optional[float] = None  # gradients held before backward starts; None: all of `grads`
    # A frozen reference's weights (preference.reference=frozen): sharded as the policy's are,
    # with no gradients, optimizer state or buffers at the step's peak.
    reference: float = 0.0
    # One evaluation batch's forward and scores (with_evaluation), and the gradients still
    # allocated while it runs; None when not traced (below the training step's: fit.Planner).
    evaluation: Optional[float] = None
    grads_in_evaluation: float = 0.0
    # Online RL's sampling (train.objective=grpo), between steps: one group's KV cache and
    # its logits (generation_bytes); 0 for the other objectives.
    generation: float = 0.0
    grads_in_generation: float = 0.0

    @property
    def states_total(self) -> float:
        """Parameters, gradients, optimizer state and buffers: the model's states alone."""
        return self.params + self.grads + self.optimizer + self.buffers + self.reference

    @property
    def training_total(self) -> float:
        """The training step's peak: the states, and at backward's peak the activations
        beside the gradients held then, whichever is more (the optimizer step holds every
        gradient and no activation)."""
        at_rest = self.grads if self.grads_at_rest is None else self.grads_at_rest
        held = self.params + self.reference + self.optimizer + self.buffers
        return held + max(self.grads, at_rest + self.activations)

    @property
    def evaluation_total(self) -> float:
        """Evaluation's peak: what stays allocated between steps (weights, optimizer state,
        buffers, the gradients a strategy keeps) and one evaluation batch's forward."""
        held = self.params + self.reference + self.optimizer + self.buffers
        return held + self.grads_in_evaluation + (self.evaluation or 0.0)

    @property
    def generation_total(self) -> float:
        """Sampling's peak: what stays allocated between steps and one group's KV cache and logits."""
        held = self.params + self.reference + self.optimizer + self.buffers
        return held + self.grads_in_generation + self.generation if self.generation else 0.0

    @property
    def device_total(self) -> float:
        """The rank's peak: the training step's, the evaluation's or sampling's, whichever is more."""
        return max(self.training_total, self.evaluation_total, self.generation_total)

    @property
    def decided_by(self) -> str:
        """Which of them is the peak (a word for the plan's lines)."""
        peaks = {"training step": self.training_total, "evaluation": self.evaluation_total,
                 "generation": self.generation_total}
        return max(peaks, key=lambda name: peaks[name])


class Traced(Protocol):
    """One micro-batch's forward and backward traced (runner.components.step_trace.StepTrace)."""

    grad_bytes: int
    largest_parameter: int

    def peak_with_gradients(self, gradient_share: float, unreduced: float = 0.0) -> float: ...


def with_activations(estimate: MemoryEstimate, traced: Traced, strategy: str, world_size: int,
                     grad_accum_steps: int = 1) -> MemoryEstimate:
    """The estimate with a traced micro-batch's activations on top, and the gradients
    each strategy keeps while backward runs:

    - ddp: every gradient stays where backward writes it (its buckets are a second copy,
      in `buffers`);
    - zero2 / zero3: DeepSpeed reduces each gradient with its bucket (in `buffers`), but
      a parameter larger than the bucket (the output head, the embedding) waits at full
      size; zero2 keeps its gradient partition throughout, zero3 (runner's deferred
      partition, runner/distributed/deepspeed.py) only from the end of backward;
    - fsdp: each layer's gradients are reduce-scattered into fp32 shards as backward
      leaves it (the unsharded layer is in `buffers`); the root's (embeddings, output
      head) wait at full size for the end of backward.

    With accumulation, the gradients of the window's first micro-batch are all held while
    the next one runs."""
    w = max(world_size, 1)
    largest = float(traced.largest_parameter * traced.grad_bytes)
    unreduced = 0.0 if grad_accum_steps > 1 or strategy == "ddp" or not estimate.grads else largest
    if grad_accum_steps > 1:
        at_rest, share = estimate.grads, 0.0
    elif strategy == "ddp":
        at_rest, share = 0.0, 1.0
    elif strategy == "fsdp":
        at_rest, share = 0.0, (4.0 / traced.grad_bytes) / w if estimate.grads else 0.0
    elif strategy == "zero2":
        at_rest, share = estimate.grads, 0.0
    else:
        at_rest, share = 0.0, 0.0
    activations = float(traced.peak_with_gradients(share, unreduced))
    return replace(estimate, activations=activations, grads_at_rest=at_rest)


def generation_bytes(config: Any, sequences: int, length: int, bytes_per_value: int = 4) -> float:
    """One group's sampling (runner/components/generation.py): the KV cache of `sequences`
    rows of `length` tokens (keys and values, every layer, its key-value heads: grouped-query
    attention's fewer), and the last position's logits with their log-softmax and
    probabilities, in fp32 (the sampling pass runs the model's own weights, outside autocast)."""
    layers = int(getattr(config, "num_hidden_layers"))
    heads = int(getattr(config, "num_attention_heads"))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(getattr(config, "hidden_size")) // heads)
    cache = 2 * layers * sequences * length * kv_heads * head_dim * bytes_per_value
    logits = 3 * sequences * int(getattr(config, "vocab_size")) * 4
    return float(cache + logits)


def with_generation(estimate: MemoryEstimate, generation: float, strategy: str) -> MemoryEstimate:
    """The estimate with one group's sampling (generation_bytes) between steps, the
    gradients allocated then counted as with_evaluation counts them."""
    return replace(estimate, generation=float(generation), grads_in_generation=estimate.grads if strategy in ZERO else 0.0)


def with_evaluation(estimate: MemoryEstimate, evaluation: float, strategy: str) -> MemoryEstimate:
    """The estimate with one evaluation batch's traced peak (`evaluation` bytes: the
    activations and temporaries of its forward and scores) and the gradients allocated
    while it runs. Evaluation follows an optimizer step, after the trainer's
    zero_grad(set_to_none=True): torch's own `.grad` is freed then (ddp, fsdp; DDP's
    buckets stay, in `buffers`), while DeepSpeed keeps its flat gradient partitions
    allocated for the run's life (ZeRO-3's grad_partitions_flat_buffer; ZeRO-2's counted
    so too, as its training plan holds it throughout): counted under zero2 and zero3."""
    held = estimate.grads if strategy in ZERO else 0.0
    return replace(estimate, evaluation=float(evaluation), grads_in_evaluation=held)


def _layer(hidden_size: int, layer_parameters: Optional[int]) -> float:
    """One transformer layer's parameters: counted on the model (any architecture:
    grouped-query attention, gated MLPs, every expert of a mixture, which all sit in
    memory), else taken as GPT-2's GPT2_LAYER_WEIGHTS h²."""
    return float(layer_parameters) if layer_parameters else float(GPT2_LAYER_WEIGHTS * hidden_size * hidden_size)


def _outside_layers(n: float, layer: float, layers: int) -> float:
    """Parameters outside the transformer layers: the embeddings, an untied output head,
    the final norm."""
    return max(n - layers * layer, 0.0)


def _fsdp_buffers(n: float, compute_bytes: float, layer: float, layers: int) -> float:
    """FSDP2 (runner/distributed/fsdp.py wraps each transformer layer and the root): the root's
    parameters (embeddings, final norm: all outside the layers) stay gathered through
    the step, at most two layers are gathered at once (the one computing and the one
    prefetched), both at the compute precision, and one layer's gradients wait in fp32
    for their reduce-scatter."""
    return (_outside_layers(n, layer, layers) + 2 * layer) * compute_bytes + layer * 4.0


def _buffers(n: float, strategy: str, weight_bytes: float, grad_bytes: float, hidden_size: Optional[int],
             layers: Optional[int] = None, cuda: bool = False, layer_parameters: Optional[int] = None,
             trainable: Optional[float] = None) -> float:
    """Working memory beyond the states, in bytes.

    ddp: torch's DDP reduces gradients through buckets that are a second copy of every
    gradient (Accelerate leaves gradient_as_bucket_view off). ZeRO: the reduce bucket
    (runner/distributed/deepspeed.py zero_sizes), and under ZeRO-3 the gathered parameters: a parameter is
    kept gathered while it is reused within one prefetch bucket (the reuse distance),
    so about a bucket is live (on a GPU, a layer computing and one prefetched), plus a
    parameter larger than a bucket gathered alone:
    GPT-2's embedding, taken as everything outside the layers when `layers` is known
    (the whole model otherwise), at the working precision. Unknown width (hidden_size
    None): ZeRO's buffers are left out."""
    if strategy == "ddp":  # buckets hold only what has a gradient
        return (n if trainable is None else trainable) * grad_bytes
    if strategy not in ZERO or not hidden_size:
        return 0.0
    stage = 3 if strategy in SHARDS_PARAMS else 2
    sizes = zero_sizes(stage, hidden_size, cuda, layer_parameters)
    total = sizes["reduce_bucket_size"] * grad_bytes
    if stage == 3:
        largest = _outside_layers(n, _layer(hidden_size, layer_parameters), layers) if layers else n
        total += (largest + sizes["stage3_max_live_parameters"]) * weight_bytes
    return float(total)


def estimate_memory(
    n_params: int, strategy: str, precision: str, world_size: int, offload_optimizer: bool = False, offload_params: bool = False,
    hidden_size: Optional[int] = None,
    layers: Optional[int] = None,
    cuda: bool = False,
    layer_parameters: Optional[int] = None,
    trainable: Optional[int] = None,
    reference: int = 0,
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
    `cuda`: ZeRO-3's residency as sized on a GPU (two layers live, zero_sizes).
    `layer_parameters`: one transformer layer's parameters, counted on the model (else
    GPT-2's 12 h²): what FSDP2 gathers at a time, and what lies outside the layers.
    `trainable`: the parameters the optimizer updates (adapters on a frozen base, peft=lora);
    only they have gradients, Adam's moments and ZeRO's fp32 master copy (None: all).
    `reference`: the parameters of a frozen reference (preference.reference=frozen), held
    as the policy's weights are (ZeRO's working precision; fp32 under ddp and fsdp),
    divided by the world size under zero3 and fsdp and offloaded with them; no gradients
    or optimizer state, and its gathered shards are freed after each of its forwards.
    """
    n, w = float(n_params), max(world_size, 1)
    t = float(n_params if trainable is None else trainable)
    half = precision in ("bf16", "fp16") and strategy in ZERO
    weight_bytes, grad_bytes, optim_bytes = (2.0, 2.0, 12.0) if half else (4.0, 4.0, 8.0)
    params, grads, optimizer = n * weight_bytes, t * grad_bytes, t * optim_bytes
    if strategy in SHARDS_GRADS_AND_OPTIMIZER:
        grads, optimizer = grads / w, optimizer / w
    if strategy in SHARDS_PARAMS:
        params = params / w
    offloaded = 0.0
    frozen = float(reference) * weight_bytes / (w if strategy in SHARDS_PARAMS else 1)
    if offload_optimizer and strategy in ZERO:
        offloaded += optimizer
        optimizer = 0.0
    if offload_params and strategy == "fsdp":
        offloaded += params + grads + optimizer
        params = grads = optimizer = 0.0
    elif offload_params and strategy in SHARDS_PARAMS:
        offloaded += params
        params = 0.0
    if offload_params and strategy in SHARDS_PARAMS:
        offloaded, frozen = offloaded + frozen, 0.0
    if strategy == "fsdp":
        compute_bytes = 2.0 if precision in ("bf16", "fp16") else 4.0
        buffers = (_fsdp_buffers(n, compute_bytes, _layer(hidden_size, layer_parameters), layers)
                   if hidden_size and layers else 0.0)
    else:
        buffers = _buffers(n, strategy, weight_bytes, grad_bytes, hidden_size, layers, cuda, layer_parameters, t)
    return MemoryEstimate(params, grads, optimizer, offloaded, buffers, reference=frozen)
