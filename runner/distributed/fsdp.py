"""strategy=fsdp: PyTorch FSDP2 (`fully_shard`) through Accelerate's FSDP plugin.

Four jobs, three about what Accelerate builds for FSDP2: the plugin from the spec, the
one step Accelerate does not take on a CPU (`engage_on_cpu`), and the check after
`prepare()` that FSDP2 really wraps the model as asked (`engagement_problems`). The
fourth is its checkpoint format read across (`FSDPStrategy.read_portable`,
`set_portable`): each rank's shards as a DCP checkpoint (`pytorch_model_fsdp_0/`,
`optimizer_0/`, keyed by parameter name), read whole with torch's `dcp_to_torch_save`
and set through torch's state-dict API for FSDP2, each rank keeping its own shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from runner.config.spec import OffloadDevice, PrecisionKind, PrecisionSpec, StrategySpec
from runner.distributed.patches import FSDP2_ON_CPU, engaged
from runner.distributed.portable import PortableState, adam_state, one_step, only
from runner.distributed.strategy import Strategy, innermost_optimizer

# Each FSDP unit wraps one of the model's own transformer layers (Accelerate's
# transformer_based_wrap over the classes transformers names in the model's
# _no_split_modules: runner/components/model.py layer_class_names); the root is always
# wrapped too. A model naming none would be sharded as one unit (correct, but its whole
# parameters gathered at once), so it is refused before launch (launch/preflight.py).

LOW_PRECISION = {PrecisionKind.bf16: "bfloat16", PrecisionKind.fp16: "float16"}


def mixed_precision_policy(precision: PrecisionSpec) -> Any:
    """FSDP2's policy: parameters gathered (and computed) in bf16/fp16, gradients
    reduce-scattered in fp32 and kept on fp32 sharded master weights. Accelerate's own
    default reduces in the low dtype too, which rounds every gradient sum to 8 bits of
    mantissa under bf16. None under fp32 (FSDP2's default: no casting at all)."""
    if precision.kind not in LOW_PRECISION:
        return None
    return MixedPrecisionPolicy(param_dtype=getattr(torch, LOW_PRECISION[precision.kind]), reduce_dtype=torch.float32)


def fsdp_plugin(strategy: StrategySpec, precision: PrecisionSpec, layer_classes: Sequence[str]) -> Any:
    """Accelerate's FSDP2 plugin with every field the spec decides set explicitly (left
    unset, the plugin reads FSDP_* environment variables, which an outer launch may set)."""
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=strategy.reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(layer_classes),
        # Checkpoints: each rank writes its own shards (torch.distributed.checkpoint).
        state_dict_type="SHARDED_STATE_DICT",
        # Every rank builds the same seeded model, so nothing needs broadcasting from rank 0.
        cpu_ram_efficient_loading=False,
        cpu_offload=strategy.offload_params is OffloadDevice.cpu,
        # model.gradient_checkpointing is transformers' own (runner/components/model.py), as under ddp.
        activation_checkpointing=False,
        mixed_precision_policy=mixed_precision_policy(precision),
    )


def engage_on_cpu(accelerator: "Accelerator", plugin: Any) -> None:
    """Make Accelerate's state FSDP on a CPU, as its own GPU branch does.

    AcceleratorState switches to DistributedType.FSDP only for accelerator process
    groups (MULTI_GPU, MULTI_XPU, ...), never MULTI_CPU, although FSDP2 trains on CPU
    with gloo. These are the assignments that branch makes (accelerate/state.py); from
    here on prepare(), clip_grad_norm_, get_state_dict and save_state/load_state run
    Accelerate's FSDP2 code, the same as on a GPU. PartialState keeps its own copy of
    the type, which every AcceleratorState() re-reads, so both are set.
    """
    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP or not engaged(FSDP2_ON_CPU):
        return  # a GPU: Accelerate did it (or an unverified Accelerate: the engagement check refuses)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def engagement_problems(accelerator: "Accelerator", model: Any, strategy: StrategySpec, precision: PrecisionSpec,
                        layer_classes: Sequence[str]) -> list[str]:
    """What differs between the FSDP2 wrapping in effect and the spec: FSDP2 engaged in
    Accelerate, the root and every transformer layer an FSDPModule, the reshard setting
    and the mixed-precision policy of each layer, CPU offload."""
    if not accelerator.is_fsdp2:
        return [f"expected FSDP2, Accelerate runs {accelerator.state.distributed_type}"]
    if not isinstance(model, FSDPModule):
        return [f"expected the model sharded by FSDP2 (fully_shard), got {type(model).__name__}"]
    problems: list[str] = []
    # fully_shard swaps each wrapped module's class for a subclass (GPT2Block -> FSDPGPT2Block).
    # The classes the accelerator was built with; else (a check on its own) the model's list.
    layer_classes = list(layer_classes) or list(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in layer_classes for c in type(m).__mro__)]
    unwrapped = [i for i, m in enumerate(layers) if not isinstance(m, FSDPModule)]
    if not layers or unwrapped:
        problems.append(f"transformer layers not each an FSDP unit: {len(layers)} found, unwrapped {unwrapped}")
    wanted_dtype = getattr(torch, LOW_PRECISION[precision.kind]) if precision.kind in LOW_PRECISION else None
    for layer in (m for m in layers if isinstance(m, FSDPModule)):
        group = layer._get_fsdp_state()._fsdp_param_group
        resharding = group.post_forward_mesh_info is not None  # None: parameters stay gathered after forward
        if resharding != strategy.reshard_after_forward:
            problems.append(f"reshard_after_forward is {resharding}, expected {strategy.reshard_after_forward}")
        # Each parameter's resolved policy: torch 2.15 keeps it per parameter only (FSDPParam's,
        # which 2.13 has as well), no longer on the group.
        for policy in {fsdp_param.mp_policy for fsdp_param in group.fsdp_params}:
            if policy.param_dtype != wanted_dtype or (wanted_dtype is not None and policy.reduce_dtype != torch.float32):
                problems.append(f"mixed precision policy is {policy}, expected parameters in {wanted_dtype} and "
                                "gradients reduced in fp32")
                break
        offloaded = isinstance(group.offload_policy, CPUOffloadPolicy)
        if offloaded != (strategy.offload_params is OffloadDevice.cpu):
            problems.append(f"CPU offload is {offloaded}, expected strategy.offload_params={strategy.offload_params.value}")
        if problems:
            break  # every layer is wrapped alike: the first tells it
    return problems


class FSDPStrategy(Strategy):
    """PyTorch FSDP2 through Accelerate's plugin; on a CPU, engaged by runner (engage_on_cpu).
    Its gradients are DTensor shards: the base class's norm completes them across ranks."""

    def __init__(self, spec: StrategySpec, precision: PrecisionSpec) -> None:
        super().__init__(spec, precision)
        self.plugin: Any = None
        self.layer_classes: list[str] = []  # the model's own, given with the accelerator options

    def needs_process_group(self) -> bool:
        return True  # fully_shard needs a device mesh over a process group, even of one rank

    def precision_policy(self) -> str:
        kind = self.precision.kind
        if kind not in LOW_PRECISION:
            return super().precision_policy()
        scaling = "; dynamic loss scaling (GradScaler)" if kind is PrecisionKind.fp16 else ""
        return (f"FSDP2 MixedPrecisionPolicy: parameters gathered and computed in {kind.value} (param_dtype), under "
                f"autocast; gradients reduce-scattered in fp32 onto fp32 sharded weights and AdamW state{scaling}")

    def accelerator_options(self, *, cuda: bool, grad_accum_steps: int, max_grad_norm: float,
                            per_device_batch_size: int, world_size: int, hidden_size: Optional[int],
                            model_type: str, layer_parameters: int | None = None,
                            layer_classes: Sequence[str] = ()) -> dict[str, Any]:
        # cpu=True on a CPU: Accelerate then builds a gloo group, which engage_on_cpu turns into FSDP.
        if not layer_classes:
            raise ValueError(f"strategy=fsdp: the {model_type} model names no transformer-layer class to wrap "
                             "(_no_split_modules); launch/preflight.py refuses it before this")
        self.layer_classes = list(layer_classes)
        self.plugin = fsdp_plugin(self.spec, self.precision, self.layer_classes)
        return {"cpu": not cuda, "fsdp_plugin": self.plugin}

    def after_accelerator(self, accelerator: "Accelerator") -> None:
        if not torch.cuda.is_available():
            engage_on_cpu(accelerator, self.plugin)

    def engagement_problems(self, accelerator: "Accelerator", model: Any, planned_world_size: int) -> list[str]:
        return engagement_problems(accelerator, model, self.spec, self.precision, self.layer_classes)

    def after_evaluation(self, model: Any) -> None:
        reshard(model)

    def frozen_copy(self, accelerator: Accelerator, build: Callable[[], torch.nn.Module]) -> Any:
        """The copy sharded as the policy is: Accelerate's own FSDP2 preparation (each
        transformer layer, the embeddings and head, then the root, `fully_shard` with the
        plugin's mesh, reshard and mixed-precision policy), without an optimizer. A forward
        leaves the root's units gathered (no backward reshards them): `after_evaluation`
        after each one."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, build().requires_grad_(False)).eval()

    def parameter_pieces(self, model: Any) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        reshard(model)  # the sharded DTensors registered again, nothing left whole
        for p in model.parameters():
            # A DTensor: this rank's shard (FSDP2's local tensor has no padding). A plain
            # parameter (one fully_shard does not manage) is held whole on every rank.
            yield (p.to_local(), None) if isinstance(p, DTensor) else (None, p)

    def full_state_dict(self, accelerator: Accelerator, model: Any) -> dict[str, Any]:
        # Accelerate's get_model_state_dict(full_state_dict=True, cpu_offload=True): one
        # parameter gathered at a time (DTensor.full_tensor), copied to rank 0's CPU, the
        # gathered tensor freed before the next; the other ranks keep nothing.
        reshard(model)
        state = accelerator.get_state_dict(model)
        # Tied weights (GPT-2's lm_head and wte: one parameter, two names) come back as two
        # gathered copies, which save_pretrained cannot tell are tied: model/ held the
        # embedding twice, unlike ddp's. Both names point at one tensor, as in the model.
        first: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            owner = first.setdefault(id(param), name)
            if owner != name and owner in state and name in state:
                state[name] = state[owner]
        return state

    # A DCP checkpoint is resharded by torch.distributed.checkpoint.load itself (Accelerate's
    # load_state), each rank reading only the pieces of its new shards: no gather.
    def prepare_portable(self, checkpoint: Path, scratch: Path) -> None:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        # every rank's shards reassembled into whole tensors, once (the main process)
        dcp_to_torch_save(str(checkpoint / "pytorch_model_fsdp_0"), str(scratch / "model.pt"))
        dcp_to_torch_save(str(checkpoint / "optimizer_0"), str(scratch / "optimizer.pt"))

    def read_portable(self, checkpoint: Path, names: list[str], scratch: Path) -> PortableState:
        model = torch.load(scratch / "model.pt", map_location="cpu", weights_only=False)["model"]
        optim = torch.load(scratch / "optimizer.pt", map_location="cpu", weights_only=False)["optimizer"]["state"]
        state = {n: optim[n] for n in names if n in optim}
        return PortableState(only(names, model, "model", checkpoint),
                             only(names, {n: s["exp_avg"] for n, s in state.items()}, "optimizer", checkpoint),
                             only(names, {n: s["exp_avg_sq"] for n, s in state.items()}, "optimizer", checkpoint),
                             one_step(state.values(), checkpoint))

    def set_portable(self, state: PortableState, model: torch.nn.Module, optimizer: Any, names: list[str],
                     groups: list[dict[str, Any]]) -> None:
        """Full tensors in, each rank keeping its own shard (torch's state-dict API for FSDP2)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        inner = innermost_optimizer(optimizer)
        params = dict(model.named_parameters())
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, {n: state.weights[n].view(params[n].shape) for n in names}, options=options)
        by_param = {id(params[n]): n for n in names}
        fqn_groups = [[by_param[id(p)] for p in group["params"]] for group in inner.param_groups]
        set_optimizer_state_dict(model, inner, {
            "state": {n: adam_state(state, n, params[n]) for n in names},
            "param_groups": [{**g, "params": fqns} for g, fqns in zip(groups, fqn_groups)],
        }, options=options)


def reshard(model: Any) -> None:
    """Free every FSDP unit's gathered parameters, keeping only each rank's shards.

    An evaluation is forward passes with no backward, and FSDP2 reshards in forward only
    the units with reshard_after_forward=true, never the root (its embeddings, the
    largest parameters of a GPT-2): after the run's final evaluation they stayed whole
    on every rank through the fingerprint and the save, and with
    strategy.reshard_after_forward=false the whole model did."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
