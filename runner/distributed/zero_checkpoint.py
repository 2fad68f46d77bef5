"""ZeRO's state by parameter, in and out: DeepSpeed's tensor-fragment API and the private
attributes it needs, for runner/distributed/deepspeed.py's `ZeroStrategy`.

Out: each rank's pieces of each parameter (`zero3_parameter_pieces`, for fingerprints),
model/ from ZeRO's fp32 master weights (`zero_fp32_state_dict`), and a checkpoint's
portable state (`convert_zero`, `read_universal`). A ZeRO checkpoint holds each rank's
partitions of DeepSpeed's flat fp32 groups and Adam moments
(`pytorch_model/zero_pp_rank_R_*`), which Accelerate's load_state reads back only at the
world size that wrote them; across, DeepSpeed's universal-checkpoint converter
(`ds_to_universal`) merges the partitions per parameter.

In: the exact initial fp32 weights (`set_zero_master_weights`), and a portable state
(`set_zero`) through `safe_set_full_fp32_param` / `safe_set_full_optimizer_state`, each
rank taking its partition of the full tensors.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from runner.config.errors import UserError
from runner.distributed.patches import ZERO2_LINK_READ_ACROSS_STATE, engaged
from runner.distributed.portable import PortableState, one_step
from runner.distributed.strategy import innermost_optimizer


# ---------------------------------------------------------------------- the model's weights
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


def zero_fp32_state_dict(engine: Any, keep: bool) -> dict[str, Any]:
    """The full model in fp32 from ZeRO's master weights (not the 16-bit working copy a
    bf16/fp16 engine holds), so model/ matches what ddp saves. A collective: every rank
    calls it, parameters in the same order; only a rank with `keep` (the one that writes)
    holds the host copy, so the others never carry a second full model. One parameter is
    gathered at a time (safe_get_full_fp32_param all-gathers its fp32 partitions) and
    copied to the host before the next: never the whole model on the device."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    full: dict[int, Any] = {}
    state: dict[str, Any] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in full:  # tied weights (GPT-2's lm_head and wte) gathered once
            full[id(p)] = _host_copy(safe_get_full_fp32_param(p), p, keep)
        state[name] = full[id(p)]
    if not keep:
        return {}
    persistent = set(module.state_dict().keys())  # buffers as state_dict() has them
    for name, buffer in module.named_buffers():
        if name in persistent:
            state[name] = buffer.detach().float().cpu() if buffer.is_floating_point() else buffer.detach().cpu()
    return state


def _host_copy(gathered: Any, param: Any, keep: bool) -> Any:
    """The host copy of one gathered fp32 parameter (None unless `keep`). A function of
    its own so that the gathered tensor is freed on return, before the next parameter
    is gathered: held in the caller's loop variable, each one stayed alive through the
    next one's gather, two parameters on the device at once (tests/train/test_finish.py)."""
    if not keep:
        return None
    return (param.detach() if gathered is None else gathered).float().cpu().clone()


def zero3_parameter_pieces(model: Any) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each ZeRO-3 parameter's pieces on this rank, gathering nothing: its partition
    (`ds_tensor`, DeepSpeed's padding at the end of the last rank's cut off) and, when
    the rank holds it whole (a persistent parameter, or one still gathered), the whole
    parameter (see rank_fingerprints)."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p in model.parameters():
        partition = p.ds_tensor.reshape(-1)
        start = dist.get_rank(group=p.ds_process_group) * partition.numel()
        valid = max(0, min(partition.numel(), p.ds_numel - start))
        whole = p.data if p.ds_status == ZeroParamStatus.AVAILABLE else None
        yield partition.narrow(0, 0, valid), whole


# ---------------------------------------------------------------------- a checkpoint read across
def read_across_refusal(stage: int) -> Optional[str]:
    """Setting a portable state into ZeRO-2 calls a private DeepSpeed method (see
    `_materialise_zero_state`), fenced by version: on another version it is refused."""
    if stage != 2 or engaged(ZERO2_LINK_READ_ACROSS_STATE):
        return None
    return (f"resuming under zero2 from another layout or strategy needs DeepSpeed "
            f"{', '.join(ZERO2_LINK_READ_ACROSS_STATE.verified)} (runner/distributed/patches.py): resume under "
            f"strategy=zero3, ddp or fsdp")


def convert_zero(checkpoint: Path, scratch: Path) -> None:
    """DeepSpeed's universal checkpoint of a ZeRO checkpoint, in `scratch/universal` (main
    process only). The converter asks for the `universal_checkpoint_info` a Megatron
    client stores (an empty one serves a plain model): given to a copy of the small
    model-state files, the shards themselves are linked, not copied."""
    source = checkpoint / "pytorch_model"
    given = scratch / "zero_input"
    given.mkdir(parents=True)
    for file in source.iterdir():
        if file.name.endswith("model_states.pt"):
            state = torch.load(file, map_location="cpu", weights_only=False)
            state.setdefault("universal_checkpoint_info", {})
            torch.save(state, given / file.name)
        else:
            (given / file.name).symlink_to(file.resolve())
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(given),
         "--output_folder", str(scratch / "universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"],
        capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        raise UserError(f"checkpoint {checkpoint}: DeepSpeed's universal-checkpoint conversion failed ({last[0]}). "
                        "Resume it in its own layout, or start a new run.")


def read_universal(scratch: Path, names: list[str]) -> PortableState:
    """convert_zero's folder: universal/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt, a tensor
    or {'param': tensor} (flattened under ZeRO-3), and the step per parameter (zero2) or in
    the optimizer's common state (zero3)."""
    universal = scratch / "universal"
    root = universal / "zero"

    def tensor(name: str, what: str) -> torch.Tensor:
        value = torch.load(root / name / f"{what}.pt", map_location="cpu", weights_only=False)
        return (value["param"] if isinstance(value, dict) else value).detach().float()

    missing = [n for n in names if not (root / n).is_dir()]
    if missing:
        raise UserError(f"checkpoint: the universal conversion has no {missing[:3]} ({len(missing)} missing): it was "
                        "not written for this model. Resume it with its own spec, or start a new run.")
    weights = {n: tensor(n, "fp32") for n in names}
    steps = [torch.load(root / n / "step.pt", weights_only=False) for n in names if (root / n / "step.pt").exists()]
    if not steps:
        common = torch.load(root / "optimizer_state.pt", map_location="cpu", weights_only=False)
        steps = [s["step"] for s in common["optimizer_state_dict"]["state"].values() if "step" in s]
    return PortableState(weights, {n: tensor(n, "exp_avg") for n in names}, {n: tensor(n, "exp_avg_sq") for n in names},
                         one_step([{"step": s} for s in steps], universal))


def _zero_flat_partitions(optimizer: Any, inner: Any) -> list[torch.Tensor]:
    """The flat fp32 partitions AdamW steps under ZeRO: ZeRO-3 keeps them itself (its
    AdamW's param_groups hold none between steps), ZeRO-1/2 in AdamW's groups."""
    zero = optimizer
    while zero is not None and not hasattr(zero, "fp32_partitioned_groups_flat"):
        zero = getattr(zero, "optimizer", None)
    if zero is not None:
        return list(zero.fp32_partitioned_groups_flat)
    return [flat for group in inner.param_groups for flat in group["params"]]


def _materialise_zero_state(optimizer: Any, inner: Any, flats: list[torch.Tensor], step: float) -> None:
    """AdamW's state for each of ZeRO's flat partitions, before the first step creates it
    (torch creates it lazily), so the fragment API has moments to write into. ZeRO-1/2
    link each parameter's fragment to that state on their first step; that link is
    made here (DeepSpeed's `_lazy_init_hp_params_optimizer_state`, a private method:
    fenced by version in runner/distributed/patches.py)."""
    on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
    for flat in flats:
        if not inner.state.get(flat):
            inner.state[flat] = {
                "step": torch.tensor(step, dtype=torch.float32, device=flat.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format)}
    zero = optimizer
    while zero is not None and not hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero = getattr(zero, "optimizer", None)
    if zero is not None:  # ZeRO-1/2 (ZeRO-3 reads the optimizer's state directly); read_across_refusal refused others
        assert engaged(ZERO2_LINK_READ_ACROSS_STATE), "refused before launch on an unverified DeepSpeed"
        zero._lazy_init_hp_params_optimizer_state()


def set_zero(state: PortableState, module: torch.nn.Module, optimizer: Any, names: list[str],
             groups: list[dict[str, Any]], stage3: bool) -> None:
    """Into ZeRO's partitions: the fp32 master weights and AdamW moments through DeepSpeed's
    tensor-fragment API (each rank takes its partition of the full tensor), the working
    weights (bf16/fp16, or fp32) from the master, and the step count into every flat
    group's state (the partitions of one group share it)."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    inner = innermost_optimizer(optimizer)
    params = dict(module.named_parameters())
    flats = _zero_flat_partitions(optimizer, inner)
    _materialise_zero_state(optimizer, inner, flats, state.step)

    def full(name: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        p = params[name]
        return values[name].reshape(p.ds_shape if stage3 else p.shape).to(p.device)

    for name in names:
        safe_set_full_fp32_param(params[name], full(name, state.weights))
        safe_set_full_optimizer_state(params[name], full(name, state.exp_avg), "exp_avg")
        safe_set_full_optimizer_state(params[name], full(name, state.exp_avg_sq), "exp_avg_sq")
    trained = [params[n] for n in names]
    # The working copy the forward reads: under ZeRO-3 partitioned, so gathered, set on
    # rank 0 and partitioned again on leaving (a collective); under ZeRO-2 whole on each rank.
    with deepspeed.zero.GatheredParameters(trained, modifier_rank=0, enabled=stage3), torch.no_grad():
        for name in names:
            params[name].data.copy_(state.weights[name].reshape(params[name].shape).to(params[name].dtype))
    for group, settings in zip(inner.param_groups, groups):
        group["lr"] = settings["lr"]
    for flat in flats:  # the partitions of one group share the step count
        held = inner.state[flat]
        held["step"] = torch.tensor(state.step, dtype=held["step"].dtype, device=held["step"].device) \
            if torch.is_tensor(held["step"]) else state.step
