"""strategy=zero2 / zero3: DeepSpeed ZeRO through Accelerate's DeepSpeed plugin. Everything
runner knows of DeepSpeed is in this module, runner/distributed/zero_checkpoint.py and
runner/distributed/zero_patches.py.

The config is complete (nothing left "auto" for Accelerate to fill), the engine steps
only after the non-finite check (`backward` runs the engine's backward alone), the
norm is ZeRO's own over its partitions, and model/ is written from ZeRO's fp32 master
weights. Three changes to DeepSpeed's private state save memory or let a sweep run
several ZeRO jobs in one process (runner/distributed/zero_patches.py); each is fenced by
the versions it was verified on (runner/distributed/patches.py) and otherwise left out.
ZeRO's state by parameter (the exact initial weights, each rank's pieces, model/, a
checkpoint read across) is zero_checkpoint.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from runner.config.batch import global_batch_size
from runner.config.spec import PrecisionKind, PrecisionSpec, StrategyKind, StrategySpec
from runner.distributed.portable import PortableState
from runner.distributed.strategy import Strategy
from runner.distributed.zero_patches import (
    offload_device,
    release_gradient_partition,
    share_zero3_fp32_master,
)
from runner.distributed.zero_checkpoint import (
    convert_zero,
    fp32_copy,
    read_across_refusal,
    read_universal,
    set_zero,
    set_zero_master_weights,
    zero3_parameter_pieces,
    zero_fp32_state_dict,
)

if TYPE_CHECKING:
    from accelerate import Accelerator

ZERO_STAGE = {StrategyKind.zero2: 2, StrategyKind.zero3: 3}


# fp16 loss scaling under ZeRO, matched to torch's GradScaler (what ddp uses): start at
# 2**16, halve on every overflow (hysteresis 1), double after 2000 clean steps.
# DeepSpeed's own defaults differ (window 1000, hysteresis 2).
DEEPSPEED_FP16 = {"initial_scale_power": 16, "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1}


# A GPT-2 transformer layer's weights, in units of h² (attention 4 h², MLP 8 h²; biases
# and norms are O(h)): the per-layer size used when the model's own is not known.
GPT2_LAYER_WEIGHTS = 12


def zero_sizes(stage: int, hidden_size: int, cuda: bool = False, layer_parameters: int | None = None) -> dict[str, int]:
    """ZeRO's bucket and residency sizes from the model's width, in elements.

    DeepSpeed's fixed defaults are sized for billions of parameters: a 5e8-element
    reduce bucket (2 GB in fp32, filled with every gradient of a smaller model before
    it is reduced), a 5e7 prefetch and 1e9 for live parameters and reuse distance,
    which under ZeRO-3 keep every gathered parameter of a model under 1e9 parameters
    resident from forward through backward: the full model on every rank, the
    opposite of ZeRO-3. Accelerate's "auto" rule sets the first three from the hidden
    size (reduce bucket = hidden², prefetch = 0.9 hidden², parameters under 10 hidden
    elements stay unpartitioned); runner uses it.

    On a CPU runner also bounds the live parameters by the prefetch bucket, and the
    reuse distance too: DeepSpeed's 1e9 keeps every parameter gathered in forward until
    backward, the whole model on each rank at the end of forward (on GPT-2 small x 2:
    peak 2.55 GB, 0.79 of ddp; with one bucket 2.22 GB, 0.69). A CPU's gloo collectives
    do not overlap compute anyway, so a smaller prefetch costs nothing there. Measured
    in bench/README.md (strategy_memory.py).

    On a GPU those sizes would leave DeepSpeed no room to prefetch: 0.9 h² is less than
    one layer (GPT-2's is 12 h²), so every layer's all-gather would start only when the
    layer is reached, on the critical path of NCCL's stream instead of overlapping the
    previous layer's compute. There the prefetch bucket is one transformer layer
    (`layer_parameters`, counted on the model; else GPT-2's 12 h²), and the live
    parameters two: the layer computing plus the one prefetched. The reuse distance is
    one layer, so the memory stays bounded by two layers as on a CPU it is by a bucket."""
    hidden2 = hidden_size * hidden_size
    sizes = {"reduce_bucket_size": hidden2}
    if stage == 3:
        if cuda:
            layer = layer_parameters or GPT2_LAYER_WEIGHTS * hidden2
            prefetch, live, reuse = layer, 2 * layer, layer
        else:
            prefetch = live = reuse = int(0.9 * hidden2)
        sizes.update({
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": live,
            "stage3_max_reuse_distance": reuse,
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
    cuda: bool = False,
    layer_parameters: int | None = None,
) -> dict[str, Any]:
    """The complete DeepSpeed config for a ZeRO strategy, every value explicit.

    Accelerate's plugin leaves "auto" placeholders and fills them in prepare() from its
    own defaults; one of those is gradient_clipping=1.0, so ZeRO clipped even with
    optim.max_grad_norm=0 while ddp did not. Here nothing is left to fill: clipping 0
    means 0 (DeepSpeed's "no clipping"), and the precision sections are ours. Bucket
    sizes come from the model's `hidden_size`, the device and, on a GPU, the parameters of
    one transformer layer (zero_sizes); without a width (a model config that names
    none) DeepSpeed's own defaults apply.
    """
    stage = ZERO_STAGE[strategy.kind]
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": strategy.offload_optimizer.value},
        **(zero_sizes(stage, hidden_size, cuda, layer_parameters) if hidden_size else {}),
    }
    if stage == 3:
        zero["offload_param"] = {"device": strategy.offload_params.value}
        zero["stage3_gather_16bit_weights_on_model_save"] = strategy.zero3_save_16bit_model
    return {
        "train_micro_batch_size_per_gpu": per_device_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        # DeepSpeed checks train = micro x accumulation x world size at initialize().
        "train_batch_size": global_batch_size(per_device_batch_size, world_size, grad_accum_steps),
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


def zero_grad_norm(engine: Any) -> torch.Tensor:
    """ZeRO's own global norm over every rank's partition (what its step computes again
    before clipping), unscaled; DeepSpeed reports an inf/NaN norm as -1, returned as inf."""
    zero = engine.optimizer
    if hasattr(zero, "scaled_global_norm"):  # ZeRO-1/2
        scaled = zero.scaled_global_norm()
    else:  # ZeRO-3
        from deepspeed.runtime.utils import combine_grad_norm_groups

        scaled = combine_grad_norm_groups(zero._get_norm_groups())
    scaled = torch.as_tensor(scaled, dtype=torch.float32)
    return torch.where(scaled < 0, torch.full_like(scaled, math.inf), scaled / float(zero.loss_scale))


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO-2 or ZeRO-3."""

    library = "deepspeed"

    def __init__(self, spec: StrategySpec, precision: PrecisionSpec) -> None:
        super().__init__(spec, precision)
        self.stage = ZERO_STAGE[spec.kind]
        self._initial: Optional[dict[str, Any]] = None

    def needs_process_group(self) -> bool:
        return True  # DeepSpeed always wants a process group, even of one

    def offloads_optimizer(self) -> bool:
        return self.spec.offload_optimizer.value != "none"

    def spec_notes(self, fused: bool) -> list[str]:
        if not self.offloads_optimizer():
            return []
        dropped = "; optim.fused does not apply" if fused else ""
        return [f"optimizer: DeepSpeedCPUAdam (DeepSpeed replaces torch's AdamW under strategy.offload_optimizer=cpu{dropped})"]

    def compile_note(self) -> str:
        if self.stage != 3:
            return super().compile_note()
        # Measured: GPT-2 (2 layers) at 2 processes, 47 graph breaks and 51 recompilations,
        # dynamo's limit of 8 reached in DeepSpeed's _pre_backward_module_hook; exact all the same.
        return (super().compile_note() + "; under ZeRO-3 DeepSpeed's parameter hooks on every submodule break each layer's "
                "graph and recompile past dynamo's limit (those parts then run eagerly): exact, but expect little speed; "
                "strategy=fsdp compiles whole layers")

    def precision_policy(self) -> str:
        kind = self.precision.kind
        if kind is PrecisionKind.fp32:
            return super().precision_policy()
        scaling = "; DeepSpeed's dynamic loss scaler" if kind is PrecisionKind.fp16 else ""
        return (f"DeepSpeed {kind.value}: the whole module in {kind.value} (weights, activations, the backward); fp32 "
                f"master weights and AdamW state in ZeRO's partitions{scaling}")

    def accelerator_options(self, *, cuda: bool, grad_accum_steps: int, max_grad_norm: float,
                            per_device_batch_size: int, world_size: int, hidden_size: Optional[int],
                            model_type: str, layer_parameters: int | None = None,
                            layer_classes: Sequence[str] = ()) -> dict[str, Any]:
        # DeepSpeed on CPU needs cpu=False with a gloo process group.
        config = deepspeed_config(self.spec, self.precision, grad_accum_steps, max_grad_norm, per_device_batch_size,
                                  world_size, hidden_size, cuda=cuda, layer_parameters=layer_parameters)
        return {"cpu": False, "deepspeed_plugin": deepspeed_plugin(config)}

    def before_prepare(self, model: torch.nn.Module, accelerator: "Accelerator") -> None:
        # The engine casts the module to bf16/fp16 before it copies its fp32 master weights.
        self._initial = fp32_copy(model) if accelerator.mixed_precision != "no" else None

    def after_prepare(self, accelerator: "Accelerator", model: Any) -> None:
        if self._initial is not None:
            set_zero_master_weights(model, self._initial)  # ZeRO starts from the same fp32 weights as ddp
            self._initial = None
        elif self.stage == 3 and not self.offloads_optimizer():
            share_zero3_fp32_master(model)  # fp32: one copy of each partition, not two

    def engagement_problems(self, accelerator: "Accelerator", model: Any, planned_world_size: int) -> list[str]:
        from accelerate.utils import DistributedType

        kind = accelerator.state.distributed_type
        engaged_stage = getattr(model, "zero_optimization_stage", None)
        if kind != DistributedType.DEEPSPEED or not callable(engaged_stage) or engaged_stage() != self.stage:
            return [f"expected a DeepSpeed ZeRO-{self.stage} engine, got {type(model).__name__} ({kind})"]
        problems = []
        accum = accelerator.gradient_accumulation_steps
        if model.gradient_accumulation_steps() != accum:
            problems.append(f"DeepSpeed accumulates {model.gradient_accumulation_steps()} steps, expected {accum}")
        for name, wanted, config in (
            ("offload_optimizer", self.spec.offload_optimizer.value, model.zero_offload_optimizer()),
            ("offload_params", self.spec.offload_params.value, model.zero_offload_param()),
        ):
            device = offload_device(config)
            if device != wanted:
                problems.append(f"DeepSpeed offloads {name} to {device}, expected {wanted}")
        return problems

    def expected_optimizer(self, fused: bool) -> str:
        # Accelerate swaps torch's AdamW for DeepSpeedCPUAdam under optimizer offload (the
        # update runs on the CPU; optim.fused does not apply).
        return "DeepSpeedCPUAdam" if self.offloads_optimizer() else super().expected_optimizer(fused)

    def backward(self, accelerator: "Accelerator", loss: torch.Tensor) -> None:
        """Accelerate's backward without DeepSpeed's optimizer step.

        `accelerator.backward` also runs `engine.step()` at the end of an accumulation
        window, so anything checked after it (the non-finite guard) would be checked
        after the update. Here the engine only runs backward, as Accelerate's wrapper
        does (accumulation boundary first); `optimizer_step` then steps it."""
        engine = accelerator.deepspeed_engine_wrapped.engine
        engine.set_gradient_accumulation_boundary(is_boundary=accelerator.sync_gradients)
        engine.backward(loss)

    def grad_norm(self, accelerator: "Accelerator", model: Any, max_grad_norm: float) -> torch.Tensor:
        # Clipping is the engine's own (gradient_clipping), inside its step.
        return zero_grad_norm(accelerator.deepspeed_engine_wrapped.engine)

    def found_inf_optimizer(self, optimizer: Any, device: torch.device) -> Optional[torch.optim.Optimizer]:
        return None  # the engine steps its own optimizer: checked on the host before the step

    def optimizer_step(self, accelerator: "Accelerator", optimizer: Any) -> bool:
        engine = accelerator.deepspeed_engine_wrapped.engine
        engine.step()  # clips (gradient_clipping), steps or skips on overflow, zeroes
        optimizer.step()  # Accelerate's DeepSpeed wrapper: a no-op, but the lr scheduler sees its step
        release_gradient_partition(engine)
        return not accelerator.optimizer_step_was_skipped

    def loss_scale(self, accelerator: "Accelerator", model: Any) -> Optional[float]:
        if accelerator.mixed_precision != "fp16":
            return None
        scale = getattr(getattr(model, "optimizer", None), "cur_scale", None)
        return float(scale) if scale is not None else None

    def after_evaluation(self, model: Any) -> None:
        release_gathered_parameters(model)

    def frozen_copy(self, accelerator: "Accelerator", build: Callable[[], torch.nn.Module]) -> Any:
        """ZeRO-3: the copy partitioned by an engine of its own (the run's DeepSpeed config
        without the optimizer's parts, as TRL's prepare_deepspeed does), so no rank holds it
        whole; built with transformers' view of ZeRO-3 off (else from_pretrained/from_config
        would build it under zero.Init, with other initial weights than the policy's), then
        cast and partitioned by the engine. ZeRO-2 does not partition parameters: a whole
        copy on each device, in the dtype the engine runs the policy's module in."""
        if self.stage != 3:
            model = super().frozen_copy(accelerator, build)
            low = {PrecisionKind.bf16: torch.bfloat16, PrecisionKind.fp16: torch.float16}.get(self.precision.kind)
            return model if low is None else model.to(low)
        import copy

        import deepspeed

        with hf_zero3_hidden(accelerator):
            model = build().requires_grad_(False)
        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for training_only in ("optimizer", "scheduler"):
            config.pop(training_only, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval returns None
        return engine

    def parameter_pieces(self, model: Any) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        if self.stage != 3:
            yield from super().parameter_pieces(model)  # ZeRO-2: every rank holds the whole model
            return
        yield from zero3_parameter_pieces(model)

    def full_state_dict(self, accelerator: "Accelerator", model: Any) -> dict[str, Any]:
        return zero_fp32_state_dict(model, keep=accelerator.is_main_process)  # every rank calls: a collective

    def alone(self, accelerator: "Accelerator") -> AbstractContextManager[None]:
        return hf_zero3_hidden(accelerator)

    # A checkpoint read across: runner/distributed/zero_checkpoint.py
    def loads_at_any_world_size(self) -> bool:
        return False  # each rank's partitions of flat groups: Accelerate reads them back at their own world size only

    def read_across_refusal(self) -> Optional[str]:
        return read_across_refusal(self.stage)

    def prepare_portable(self, checkpoint: Path, scratch: Path) -> None:
        convert_zero(checkpoint, scratch)

    def read_portable(self, checkpoint: Path, names: list[str], scratch: Path) -> PortableState:
        return read_universal(scratch, names)

    def set_portable(self, state: PortableState, model: torch.nn.Module, optimizer: Any, names: list[str],
                     groups: list[dict[str, Any]]) -> None:
        set_zero(state, model, optimizer, names, groups, stage3=self.stage == 3)


@contextmanager
def hf_zero3_hidden(accelerator: "Accelerator") -> Iterator[None]:
    """transformers' and peft's view of DeepSpeed turned off for a while, then back on.

    Accelerate registers the run's DeepSpeed config process-wide (transformers'
    HfDeepSpeedConfig). While it says ZeRO-3, `from_pretrained` builds any new model
    under deepspeed.zero.Init (a broadcast per parameter) and peft's merge gathers each
    layer's parameters (GatheredParameters): collectives. Entered by rank 0 alone, for
    a model no engine holds (peft.save_merged's base read again), they waited forever
    for the other ranks, which sat in the barrier after the save."""
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        registered = getattr(accelerator.state.deepspeed_plugin, "dschf", None)  # Accelerate keeps it alive there
        if registered is not None:
            set_hf_deepspeed_config(registered)


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
