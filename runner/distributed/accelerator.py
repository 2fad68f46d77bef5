"""The only module that knows Accelerate's and DeepSpeed's knobs (FSDP2's: runner/distributed/fsdp.py).

Builds the Accelerator from the strategy and precision sub-specs, and checks after
`prepare()` that what is engaged is what was asked for: Accelerate falls back
silently on CPU (for example to unsynchronised copies), and we never do.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from runner.config.spec import PrecisionKind, PrecisionSpec, RunSpec, StrategyKind, StrategySpec

if TYPE_CHECKING:
    from accelerate import Accelerator

MIXED_PRECISION = {PrecisionKind.fp32: "no", PrecisionKind.bf16: "bf16", PrecisionKind.fp16: "fp16"}
ZERO_STAGE = {StrategyKind.zero2: 2, StrategyKind.zero3: 3}


class EngagementError(RuntimeError):
    """What Accelerate engaged differs from the spec."""


def is_zero(strategy: StrategySpec) -> bool:
    return strategy.kind in ZERO_STAGE


# fp16 loss scaling under ZeRO, matched to torch's GradScaler (what ddp uses): start at
# 2**16, halve on every overflow (hysteresis 1), double after 2000 clean steps.
# DeepSpeed's own defaults differ (window 1000, hysteresis 2).
DEEPSPEED_FP16 = {"initial_scale_power": 16, "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1}


def zero_sizes(stage: int, hidden_size: int) -> dict[str, int]:
    """ZeRO's bucket and residency sizes from the model's width, in elements.

    DeepSpeed's fixed defaults are sized for billions of parameters: a 5e8-element
    reduce bucket (2 GB in fp32, filled with every gradient of a smaller model before
    it is reduced), a 5e7 prefetch and 1e9 for live parameters and reuse distance,
    which under ZeRO-3 keep every gathered parameter of a model under 1e9 parameters
    resident from forward through backward: the full model on every rank, the
    opposite of ZeRO-3. Accelerate's "auto" rule sets the first three from the hidden
    size (reduce bucket = hidden², prefetch = 0.9 hidden², parameters under 10 hidden
    elements stay unpartitioned); runner uses it, and bounds the prefetch by the same
    measure: at most one prefetch bucket's worth of parameters live. The reuse distance
    is one prefetch bucket too: DeepSpeed's 1e9 keeps every parameter gathered in
    forward until backward, the whole model on each rank at the end of forward (on
    GPT-2 small x 2: peak 2.55 GB, 0.79 of ddp; with one bucket 2.22 GB, 0.69).
    Measured in bench/README.md (strategy_memory.py)."""
    hidden2 = hidden_size * hidden_size
    sizes = {"reduce_bucket_size": hidden2}
    if stage == 3:
        prefetch = int(0.9 * hidden2)
        sizes.update({
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": prefetch,
            "stage3_max_reuse_distance": prefetch,
        })
    return sizes


def deepspeed_config(
    strategy: StrategySpec,
    precision: PrecisionSpec,
    grad_accum_steps: int,
    max_grad_norm: float,
    per_device_batch_size: int,
    world_size: int,
    hidden_size: Optional[int] = None,
) -> dict[str, Any]:
    """The complete DeepSpeed config for a ZeRO strategy, every value explicit.

    Accelerate's plugin leaves "auto" placeholders and fills them in prepare() from its
    own defaults; one of those is gradient_clipping=1.0, so ZeRO clipped even with
    optim.max_grad_norm=0 while ddp did not. Here nothing is left to fill: clipping 0
    means 0 (DeepSpeed's "no clipping"), and the precision sections are ours. Bucket
    sizes come from the model's `hidden_size` (zero_sizes); without one (a model config
    that names no width) DeepSpeed's own defaults apply.
    """
    stage = ZERO_STAGE[strategy.kind]
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": strategy.offload_optimizer.value},
        **(zero_sizes(stage, hidden_size) if hidden_size else {}),
    }
    if stage == 3:
        zero["offload_param"] = {"device": strategy.offload_params.value}
        zero["stage3_gather_16bit_weights_on_model_save"] = strategy.zero3_save_16bit_model
    return {
        "train_micro_batch_size_per_gpu": per_device_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        # DeepSpeed checks train = micro x accumulation x world size at initialize().
        "train_batch_size": per_device_batch_size * grad_accum_steps * world_size,
        "gradient_clipping": float(max_grad_norm),
        "zero_optimization": zero,
        "fp16": {"enabled": precision.kind is PrecisionKind.fp16, **DEEPSPEED_FP16},
        "bf16": {"enabled": precision.kind is PrecisionKind.bf16},
        "zero_allow_untested_optimizer": True,  # runner's torch AdamW (client optimizer)
    }


def deepspeed_plugin(config: dict[str, Any]) -> Any:
    """Accelerate's plugin around our complete config (it fills only "auto" values, and
    there are none)."""
    from accelerate import DeepSpeedPlugin

    return DeepSpeedPlugin(
        hf_ds_config=config,
        zero3_init_flag=False,  # the model is built (seeded) before the engine, as under DDP
    )


def dataloader_config(cuda: bool) -> Any:
    """On a GPU, batches are copied host-to-device with non_blocking=True, from pinned
    memory (worker._loaders sets pin_memory): the copy overlaps the previous step
    instead of making the host wait. On a CPU there is no copy to overlap."""
    from accelerate.utils import DataLoaderConfiguration

    return DataLoaderConfiguration(non_blocking=cuda)


def build_accelerator(
    strategy: StrategySpec,
    precision: PrecisionSpec,
    grad_accum_steps: int,
    max_grad_norm: float,
    compile_model: bool = False,
    timeout_minutes: float = 30.0,
    tracking: str = "none",
    logging_dir: Optional[str] = None,
    per_device_batch_size: Optional[int] = None,
    model_type: str = "gpt2",
    hidden_size: Optional[int] = None,
) -> "Accelerator":
    """per_device_batch_size is DeepSpeed's micro batch: required under ZeRO, unused
    otherwise; hidden_size (the model's width) sizes ZeRO's buckets (zero_sizes).
    model_type picks the transformer layer FSDP2 wraps (runner/distributed/fsdp.py): used under fsdp only."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    cuda = torch.cuda.is_available()
    handlers: list[Any] = []
    plugin = None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if is_zero(strategy):
        if per_device_batch_size is None:
            raise ValueError("a ZeRO strategy needs per_device_batch_size for DeepSpeed's config")
        config = deepspeed_config(
            strategy, precision, grad_accum_steps, max_grad_norm, per_device_batch_size, world_size, hidden_size
        )
        plugin = deepspeed_plugin(config)
    fsdp = None
    if strategy.kind is StrategyKind.fsdp:
        from runner.distributed.fsdp import fsdp_plugin

        fsdp = fsdp_plugin(strategy, precision, model_type)
    if plugin is not None or fsdp is not None or world_size > 1:
        # Passing a backend makes Accelerate initialise a process group: only when distributed.
        backend = "nccl" if cuda else "gloo"
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timedelta(minutes=timeout_minutes)))
    accelerator = Accelerator(
        dataloader_config=dataloader_config(cuda),
        # DDP and FSDP on CPU need cpu=True (else two unsynchronised copies, or no
        # distributed state at all); DeepSpeed on CPU needs cpu=False with a gloo process group.
        cpu=(not cuda) and plugin is None,
        mixed_precision=MIXED_PRECISION[precision.kind],
        gradient_accumulation_steps=grad_accum_steps,
        deepspeed_plugin=plugin,
        fsdp_plugin=fsdp,
        kwargs_handlers=handlers,
        # torch.compile applied by prepare(); unwrap_model strips it again for saving.
        dynamo_backend="inductor" if compile_model else None,
        log_with=None if tracking == "none" else tracking,
        project_config=ProjectConfiguration(logging_dir=logging_dir) if logging_dir else None,
    )
    if fsdp is not None and not cuda:
        from runner.distributed.fsdp import engage_on_cpu

        engage_on_cpu(accelerator, fsdp)
    return accelerator


def describe(accelerator: "Accelerator") -> dict[str, Any]:
    """What is in effect, for the banner and checks."""
    state = accelerator.state
    return {
        "world_size": accelerator.num_processes,
        "device": str(accelerator.device),
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "mixed_precision": accelerator.mixed_precision,
        "backend": getattr(state, "backend", None),
    }


def innermost_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's wrapper and, under DeepSpeed, ZeRO's."""
    inner = optimizer
    while hasattr(inner, "optimizer"):  # AcceleratedOptimizer, DeepSpeed's wrapper, its ZeRO optimizer
        inner = inner.optimizer
    return inner


def expected_optimizer(strategy: StrategySpec, fused: bool) -> str:
    """The optimizer the run will step: Accelerate swaps torch's AdamW for DeepSpeedCPUAdam
    under ZeRO optimizer offload (the update runs on the CPU; optim.fused does not apply)."""
    if is_zero(strategy) and strategy.offload_optimizer.value != "none":
        return "DeepSpeedCPUAdam"
    return f"AdamW ({'fused' if fused else 'foreach'})"


def spec_notes(spec: RunSpec) -> list[str]:
    """What DeepSpeed will do with a spec that its keys do not say, for run_spec.yaml."""
    expected = expected_optimizer(spec.strategy, spec.optim.fused)
    if expected == "DeepSpeedCPUAdam":
        dropped = "; optim.fused does not apply" if spec.optim.fused else ""
        return [f"optimizer: {expected} (DeepSpeed replaces torch's AdamW under strategy.offload_optimizer=cpu{dropped})"]
    return []


def engaged_optimizer(optimizer: Any) -> str:
    inner = innermost_optimizer(optimizer)
    name = type(inner).__name__
    if name == "AdamW":
        return f"AdamW ({'fused' if inner.param_groups[0].get('fused') else 'foreach'})"
    return name


def check_engaged(accelerator: "Accelerator", model: Any, optimizer: Any, spec: RunSpec, planned_world_size: int) -> str:
    """Fail loudly when what Accelerate / DeepSpeed built is not what the launcher planned:
    world size, strategy and ZeRO stage, offload devices, gradient accumulation (which an
    outer `accelerate launch` can override through ACCELERATE_* variables), mixed
    precision, and the optimizer class in use. Returns that optimizer, for the banner."""
    from accelerate.utils import DistributedType

    strategy, precision, accum = spec.strategy, spec.precision, spec.train.grad_accum_steps
    problems: list[str] = []
    if accelerator.num_processes != planned_world_size:
        problems.append(f"world size is {accelerator.num_processes}, the launcher planned {planned_world_size}")
    if accelerator.mixed_precision != MIXED_PRECISION[precision.kind]:
        problems.append(f"mixed precision is {accelerator.mixed_precision}, expected {MIXED_PRECISION[precision.kind]}")
    if accelerator.gradient_accumulation_steps != accum:
        problems.append(f"gradient accumulation is {accelerator.gradient_accumulation_steps} steps, expected {accum}")
    kind = accelerator.state.distributed_type
    if is_zero(strategy):
        stage = ZERO_STAGE[strategy.kind]
        engaged = getattr(model, "zero_optimization_stage", None)
        if kind != DistributedType.DEEPSPEED or not callable(engaged) or engaged() != stage:
            problems.append(f"expected a DeepSpeed ZeRO-{stage} engine, got {type(model).__name__} ({kind})")
        else:
            if model.gradient_accumulation_steps() != accum:
                problems.append(f"DeepSpeed accumulates {model.gradient_accumulation_steps()} steps, expected {accum}")
            for name, wanted, config in (
                ("offload_optimizer", strategy.offload_optimizer.value, model.zero_offload_optimizer()),
                ("offload_params", strategy.offload_params.value, model.zero_offload_param()),
            ):
                device = offload_device(config)
                if device != wanted:
                    problems.append(f"DeepSpeed offloads {name} to {device}, expected {wanted}")
    elif strategy.kind is StrategyKind.fsdp:
        from runner.distributed.fsdp import engagement_problems

        problems += engagement_problems(accelerator, model, strategy, precision)
    elif planned_world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
        if not isinstance(inner, DistributedDataParallel):
            problems.append(f"expected DistributedDataParallel, got {type(inner).__name__} ({kind})")
    if spec.model.compile and not is_zero(strategy) and not hasattr(model, "_orig_mod"):
        problems.append(f"model.compile=true but the model is not compiled ({type(model).__name__})")
    in_use, wanted_optimizer = engaged_optimizer(optimizer), expected_optimizer(strategy, spec.optim.fused)
    if in_use != wanted_optimizer:
        problems.append(f"the optimizer in use is {in_use}, expected {wanted_optimizer}")
    if problems:
        raise EngagementError("strategy not engaged as specified: " + "; ".join(problems))
    return in_use


def backward(accelerator: "Accelerator", loss: Any) -> None:
    """Accelerate's backward without DeepSpeed's optimizer step.

    Under DeepSpeed, `accelerator.backward` also runs `engine.step()` at the end of an
    accumulation window, so anything checked after it (the non-finite guard) would be
    checked after the update. Here the engine only runs backward, as Accelerate's
    wrapper does (accumulation boundary first); `optimizer_step` then steps it.
    """
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        accelerator.backward(loss)
        return
    wrapped.engine.set_gradient_accumulation_boundary(is_boundary=accelerator.sync_gradients)
    wrapped.engine.backward(loss)


def optimizer_step(accelerator: "Accelerator", optimizer: Any) -> None:
    """The optimizer step of an accumulation window (called only when it closes)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        optimizer.step()
    else:
        wrapped.engine.step()  # clips (gradient_clipping), steps or skips on overflow, zeroes
        optimizer.step()  # Accelerate's DeepSpeed wrapper: a no-op, but the lr scheduler sees its step
        release_gradient_partition(wrapped.engine)


def offload_device(config: Any) -> str:
    """The device of a DeepSpeed offload config (engine.zero_offload_optimizer() /
    zero_offload_param()): "none" when there is none."""
    device = getattr(config, "device", None)
    # An enum in older DeepSpeed, a plain string (use_enum_values) in 0.19.
    return str(getattr(device, "value", device) or "none")


def _gradient_partition(engine: Any) -> Any:
    """ZeRO-3's flat fp32 gradient partition when runner may release it between steps;
    None under ZeRO-1/2, or when an offload moves it (DeepSpeed then swaps its `.data`)."""
    zero = getattr(engine, "optimizer", None)
    flat = getattr(zero, "grad_partitions_flat_buffer", None)
    offloaded = {offload_device(engine.zero_offload_optimizer()), offload_device(engine.zero_offload_param())}
    if flat is None or offloaded != {"none"}:
        return None
    return flat


# DeepSpeed's per-parameter views of the flat partition (a name-mangled private dict of
# DeepSpeedZeroOptimizer_Stage3; partition_grads writes each reduced gradient through it).
_GRAD_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def release_gradient_partition(engine: Any) -> None:
    """Free ZeRO-3's gradient partition once the optimizer has stepped, until the end of
    the next backward.

    DeepSpeed allocates every rank's partition of the gradients (fp32, a quarter of the
    model states at 2 ranks) once and keeps it for the whole run, though it only holds
    data from the first gradient reduced in an accumulation window to the step that
    closes it. ZeRO-3 peaks at the start of backward, where every layer's activations,
    the gathered tied embedding and its full-size gradient are live: the partition
    there, kept or reallocated by the first reduced gradient, was 237 MB of that peak on
    GPT-2 small x 2 in fp32 (bench/README.md). FSDP2 frees its gradients at zero_grad
    for the same reason.

    The storage is emptied in place, so DeepSpeed's views of it stay valid. In the next
    window's first backward (DeepSpeed copies, not adds, each reduced gradient then),
    each parameter's reduced gradient goes to a tensor of its own, allocated as the
    backward frees activations; the backward's epilogue reallocates the partition,
    zeroed, moves them in and points DeepSpeed's views back (`restore_gradient_partition`).
    Any other use of the empty partition fails loudly instead of reading stale values."""
    flat = _gradient_partition(engine)
    if flat is None:
        return
    zero = engine.optimizer
    if not getattr(zero, "_runner_defers_grad_partition", False):
        _defer_gradient_partition(engine)
    flat.untyped_storage().resize_(0)


def _defer_gradient_partition(engine: Any) -> None:
    """Route DeepSpeed's writes into a released partition to per-parameter tensors, and
    reallocate it at the end of backward (see release_gradient_partition)."""
    import torch

    zero = engine.optimizer
    write, close = zero.partition_grads, zero.independent_gradient_partition_epilogue
    views = getattr(zero, _GRAD_VIEWS, None)  # None: another DeepSpeed; reallocate at the first write
    zero._runner_staged_grads = {}  # ds_id -> DeepSpeed's view of the partition, while staged

    def partition_grads(params: list, grad_partitions: list) -> Any:
        flat = zero.grad_partitions_flat_buffer
        if views is not None and zero.micro_step_id == 0 and flat.untyped_storage().nbytes() == 0:
            for param in params:
                if param.ds_id not in zero._runner_staged_grads:
                    zero._runner_staged_grads[param.ds_id] = views[param.ds_id]
                    # Zeroed: DeepSpeed skips a rank's all-padding partitions and writes only
                    # the real part of a padded one; the rest must read 0 as it did before.
                    views[param.ds_id] = torch.zeros_like(views[param.ds_id])
        else:
            restore_gradient_partition(engine)
        return write(params, grad_partitions)

    def epilogue() -> None:
        close()
        if zero._runner_staged_grads:
            restore_gradient_partition(engine)
            close()  # again, with nothing left to reduce: its per-group gradient lists now point into the partition

    zero.partition_grads = partition_grads
    zero.independent_gradient_partition_epilogue = epilogue
    zero._runner_defers_grad_partition = True


def restore_gradient_partition(engine: Any) -> None:
    """Reallocate, zeroed, ZeRO-3's gradient partition if `release_gradient_partition`
    freed it, moving in the gradients staged since; a no-op otherwise."""
    flat = _gradient_partition(engine)
    if flat is None or flat.untyped_storage().nbytes() != 0:
        return
    flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    flat.zero_()
    zero = engine.optimizer
    staged = getattr(zero, "_runner_staged_grads", {})
    views = getattr(zero, _GRAD_VIEWS, {})
    for ds_id, view in staged.items():
        view.copy_(views[ds_id])
        views[ds_id] = view
    staged.clear()


def global_grad_norm(accelerator: "Accelerator", model: Any, max_grad_norm: float) -> Any:
    """The global gradient norm before the optimizer step (a 0-d float64 tensor; not read
    on the host).

    Clips to `max_grad_norm` when it is > 0. Under DDP the gradients are already
    all-reduced, so the local norm is the global one; under fp16 they are unscaled first.
    Under DeepSpeed each rank holds a partition: the ZeRO optimizer's own norm (what its
    step computes again before clipping) all-reduces the partitions' norms. DeepSpeed
    reports an inf/NaN norm as -1; it is returned as inf. Under fsdp the gradients are
    FSDP2's reduce-scattered DTensor shards: the norm over them is partial per rank and
    is completed across ranks (an all-reduce), then the shards are clipped with it.

    The norm is runner's own (`grad_norm`), not Accelerate's / torch's clip_grad_norm_:
    torch's float32 L2 norm kernel on a CPU sums the squares in float32 without
    cascading, and on a large tensor loses the small ones (pytorch/pytorch#169237,
    #151761). On the micro GPT-2 of tests/test_multiprocess.py, whose norm is mostly the
    50257 x 32 embedding gradient, it read 1.4e-5 low at step 1 and 5.4e-4 low at step 12;
    FSDP2's two half shards lost about half as much, so fsdp and one process disagreed by
    up to 2.7e-4 while their gradients agreed to 1e-7. Each square is accumulated in
    float64 instead, as DeepSpeed's ZeRO does for its own norm (get_norm_dtype): every
    strategy now reports the norm of the gradients it holds.
    """
    import math

    import torch

    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        zero = wrapped.engine.optimizer
        if hasattr(zero, "scaled_global_norm"):  # ZeRO-1/2
            scaled = zero.scaled_global_norm()
        else:  # ZeRO-3
            from deepspeed.runtime.utils import combine_grad_norm_groups

            scaled = combine_grad_norm_groups(zero._get_norm_groups())
        scaled = torch.as_tensor(scaled, dtype=torch.float32)
        return torch.where(scaled < 0, torch.full_like(scaled, math.inf), scaled / float(zero.loss_scale))
    accelerator.unscale_gradients()  # fp16: the true gradients' norm (and what is clipped); a no-op otherwise
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), dtype=torch.float64)
    total = grad_norm([p.grad for p in params])
    if max_grad_norm > 0:
        by_mesh: dict[Any, list[Any]] = {}
        for p in params:  # a DTensor gradient is clipped by a norm placed on its own mesh
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for mesh, group in by_mesh.items():
            # float32, the dtype torch's own clip multiplies the gradients by (foreach kernels)
            norm = total.to(device=group[0].grad.device, dtype=torch.float32)
            if mesh is not None:
                from torch.distributed.tensor import DTensor

                norm = DTensor.from_local(norm, mesh)
            torch.nn.utils.clip_grads_with_norm_(group, max_grad_norm, norm)
    return total


# Elements of one gradient cast to float64 at a time. torch's vector_norm(dtype=float64)
# casts its whole input first: on GPT-2's 38.6M-element embedding gradient that is a
# 295 MB copy at the step's memory peak, on a GPU as on a CPU. Chunks of 4M (32 MB) keep
# the exact sum at a few kernels per large gradient.
NORM_CHUNK_ELEMENTS = 1 << 22


def grad_norm(grads: list[Any]) -> Any:
    """The L2 norm of all `grads` as one vector, each square accumulated in float64 (a
    0-d float64 tensor). DTensor gradients (FSDP2's shards) are summed per device mesh
    and completed across its ranks; plain ones are local (already all-reduced under DDP)."""
    import torch

    by_layout: dict[Any, list[Any]] = {}
    for g in grads:
        layout = (getattr(g, "device_mesh", None), tuple(getattr(g, "placements", ())))
        by_layout.setdefault(layout, []).append(g)
    device = grads[0].device
    squares = []
    for (mesh, placements), group in by_layout.items():
        local = [g.to_local() if mesh is not None else g for g in group]
        total = torch.stack([_sum_of_squares(g) for g in local]).sum()
        if mesh is not None:  # each rank summed its own shard: add them up over the sharded mesh dims
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.placement_types import Partial, Replicate

            partial = [Partial("sum") if p.is_shard() else Replicate() for p in placements]
            total = DTensor.from_local(total, mesh, partial).full_tensor()
        squares.append(total.to(device))
    return torch.stack(squares).sum().sqrt()


def _sum_of_squares(g: Any) -> Any:
    """The sum of `g`'s squares in float64, cast a bounded chunk at a time."""
    import torch

    flat = g.reshape(-1)
    chunks = flat.split(NORM_CHUNK_ELEMENTS) if flat.numel() else [flat]
    return torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64).square() for c in chunks]).sum()


def _full(value: Any) -> Any:
    """A plain tensor from a norm over FSDP2's sharded (DTensor) gradients: the norm of
    each rank's shard combined over all ranks (an all-reduce), so every rank holds the
    global norm. A plain tensor is returned as it is."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def unwrap(accelerator: "Accelerator", model: Any) -> Any:
    """The bare model under DDP / DeepSpeed / torch.compile, leaving `model` intact.

    Accelerate's default (keep_torch_compile=True) re-points the compiled wrapper at the
    bare model (`compiled._orig_mod = bare`): on torch.compile over DDP, that silently
    removes DDP from the model being trained, and the ranks drift apart.
    """
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def skip_output_upcast(accelerator: "Accelerator", model: Any) -> bool:
    """Keep Accelerate's autocast on the forward but drop its cast of every output to fp32.

    Under bf16/fp16 Accelerate wraps forward so that all outputs come back in fp32, for
    losses computed outside the model. runner's loss comes from inside the model, which
    computes it in fp32 already, so the wrapper only copies the logits: batch x block x
    vocabulary values (400 MB a step at 8 x 128 x 50k) that nothing reads in training.
    Measured on the tiny recipe in bf16 on a CPU: bench/README.md. Returns True when the
    wrapper was found and removed; False (nothing changed) under fp32, DeepSpeed, or an
    Accelerate whose wrapper looks different.
    """
    from types import MethodType

    from accelerate.utils.operations import ConvertOutputsToFp32

    base = unwrap(accelerator, model)  # keeps the wrappers; strips DDP / torch.compile
    forward = base.__dict__.get("forward")
    converter = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if not isinstance(converter, ConvertOutputsToFp32):
        return False
    inner = converter.model_forward  # the autocast-wrapped forward
    # Accelerate wrapped either the unbound function (rebind it) or a bound callable.
    base.forward = MethodType(inner, base) if hasattr(forward, "__func__") else inner
    return True


def release_gathered_parameters(model: Any) -> None:
    """Under ZeRO-3, wait for every parameter DeepSpeed is still gathering and partition
    every gathered one again; a no-op for any other model.

    An evaluation is forward passes with no backward. With a reuse distance smaller
    than the model (zero_sizes), DeepSpeed prefetches along the trace it recorded in
    training, and an evaluation whose last batch is short ends with parameters still in
    flight: the next gather of the full model (the final save) then fails with "Cannot
    partition a param in flight" (2 ranks, 13 eval blocks of batch 4)."""
    empty = getattr(model, "empty_partition_cache", None)  # DeepSpeedEngine; acts under ZeRO-3 only
    if callable(empty):
        empty()


def rank_fingerprints(accelerator: "Accelerator", model: Any, strategy: StrategySpec) -> list[float]:
    """Sum of every parameter, one per rank: after a step all ranks must hold the same model.
    Under ZeRO-3 and fsdp each rank holds a shard, so the full parameters are gathered first."""
    import contextlib

    import torch

    params = list(model.parameters())
    gather: Any = contextlib.nullcontext()
    if strategy.kind is StrategyKind.zero3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        # fsdp: a DTensor's sum is partial per rank; _full all-reduces it.
        total = torch.stack([_full(p.detach().double().sum()) for p in params]).sum()
    values = accelerator.gather(total.reshape(1).to(accelerator.device))
    return [float(v) for v in values.cpu()]


def check_in_sync(fingerprints: list[float]) -> None:
    first = fingerprints[0]
    if any(abs(f - first) > 1e-6 * max(1.0, abs(first)) for f in fingerprints):
        raise EngagementError(f"ranks hold different parameters after training: {fingerprints}")


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons, so the next in-process run (a
    sweep's next job) can choose another precision or strategy."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # DeepSpeed caches a clone of the world process group in a module global; once this
    # run's group is destroyed the clone is stale, and the next in-process ZeRO job (a
    # one-process ZeRO sweep) fails in initialize() with "Group ... is not registered".
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._WORLD_GROUP = None


def fp32_copy(model: Any) -> dict[str, Any]:
    """The model's parameters, copied, before a ZeRO engine casts them to bf16/fp16 in
    place (host memory: one fp32 copy of the model, freed once the engine holds them)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def set_zero_master_weights(engine: Any, weights: dict[str, Any]) -> None:
    """Give ZeRO's fp32 master weights the exact initial values.

    DeepSpeed casts the module to bf16/fp16 first and builds its fp32 master copy from
    that, so every initial weight is rounded to 16 bits, where ddp starts from the fp32
    values. Each rank sets its own partition from the full tensor; under ZeRO-3 that is
    local, under ZeRO-2 too (no collective)."""
    from deepspeed.utils import safe_set_full_fp32_param

    for name, p in engine.module.named_parameters():
        safe_set_full_fp32_param(p, weights[name].to(p.device))


def share_zero3_fp32_master(engine: Any) -> int:
    """Under ZeRO-3 in fp32, make the optimizer's fp32 partition the working partition
    itself instead of a second copy of it; returns the bytes freed (0: nothing to share).

    When the working weights are already fp32 on the optimizer's device, DeepSpeed
    means to skip its master copy, but it compares `tensor.device == "cpu"` (or
    "cuda:0"), a torch.device against a string, which is never equal: every rank then
    keeps two fp32 copies of its partition (measured in bench/README.md). The step
    copies the master partition into the working one after each update, a copy onto
    itself once they share storage, so the math is unchanged. Only a bit-equal copy of
    the same shape, dtype and device is shared."""
    import torch

    zero = getattr(engine, "optimizer", None)
    working = getattr(zero, "fp16_partitioned_groups_flat", None)
    master = getattr(zero, "fp32_partitioned_groups_flat", None)
    if not working or not master or len(working) != len(master):
        return 0
    freed = 0
    for low, high in zip(working, master):
        if low is None or high.numel() == 0 or high.data_ptr() == low.data_ptr():
            continue
        if (low.dtype, low.device, low.shape) != (high.dtype, high.device, high.shape) or not torch.equal(low, high):
            continue
        freed += high.numel() * high.element_size()
        high.data = low.data
    return freed


def zero_fp32_state_dict(engine: Any, keep: bool) -> dict[str, Any]:
    """The full model in fp32 from ZeRO's master weights (not the 16-bit working copy a
    bf16/fp16 engine holds), so model/ matches what ddp saves. A collective: every rank
    calls it, parameters in the same order; only a rank with `keep` (the one that writes)
    holds the host copy, so the others never carry a second full model."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    full: dict[int, Any] = {}
    state: dict[str, Any] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in full:  # tied weights (GPT-2's lm_head and wte) gathered once
            value = safe_get_full_fp32_param(p)
            full[id(p)] = (p.detach() if value is None else value).float().cpu().clone() if keep else None
        state[name] = full[id(p)]
    if not keep:
        return {}
    persistent = set(module.state_dict().keys())  # buffers as state_dict() has them
    for name, buffer in module.named_buffers():
        if name in persistent:
            state[name] = buffer.detach().float().cpu() if buffer.is_floating_point() else buffer.detach().cpu()
    return state
