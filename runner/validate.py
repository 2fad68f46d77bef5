"""Cross-field validation of a RunSpec: every problem at once, each naming its fix.

The schema (runner/spec.py) already rejected unknown keys and wrong types at
compose time; these are the checks that need several fields, the machine, or the
files on disk. Runs in the launcher only, before a run folder is touched.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Callable

from runner.data_checks import check_data_files
from runner.errors import UserError
from runner.spec import PrecisionKind, RunSpec, StrategyKind

if TYPE_CHECKING:
    from runner.data import PreparedData


def _positive(problems: list[str], value: object, key: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        problems.append(f"{key}={value} must be {bound}. Set {key}=<a number {bound}>.")


def check_numbers(spec: RunSpec) -> list[str]:
    p: list[str] = []
    t = spec.train
    _positive(p, t.per_device_batch_size, "train.per_device_batch_size")
    _positive(p, t.per_device_eval_batch_size, "train.per_device_eval_batch_size")
    _positive(p, t.grad_accum_steps, "train.grad_accum_steps")
    _positive(p, t.max_steps, "train.max_steps")
    if t.max_steps is None:
        _positive(p, t.num_epochs, "train.num_epochs")
    for key in ("log_every", "eval_every", "save_every"):
        _positive(p, getattr(t, key), f"train.{key}", allow_zero=True)
    _positive(p, t.keep_checkpoints, "train.keep_checkpoints")
    _positive(p, t.dataloader_num_workers, "train.dataloader_num_workers", allow_zero=True)
    _positive(p, spec.optim.lr, "optim.lr")
    _positive(p, spec.optim.weight_decay, "optim.weight_decay", allow_zero=True)
    _positive(p, spec.optim.max_grad_norm, "optim.max_grad_norm", allow_zero=True)
    _positive(p, spec.optim.reference_global_batch, "optim.reference_global_batch")
    if spec.optim.scale_lr.value != "none" and not spec.optim.reference_global_batch:
        p.append(
            f"optim.scale_lr={spec.optim.scale_lr.value} needs the batch the lr was tuned at: "
            "set optim.reference_global_batch=<global batch>."
        )
    _positive(p, spec.schedule.warmup_steps, "schedule.warmup_steps", allow_zero=True)
    if not 0.0 <= spec.schedule.warmup_ratio < 1.0:
        p.append(f"schedule.warmup_ratio={spec.schedule.warmup_ratio} must be in [0, 1).")
    d = spec.data
    _positive(p, d.block_size, "data.block_size")
    _positive(p, d.max_train_samples, "data.max_train_samples")
    _positive(p, d.max_eval_samples, "data.max_eval_samples")
    _positive(p, d.preprocessing_num_workers, "data.preprocessing_num_workers")
    return p


def check_data_source(spec: RunSpec) -> list[str]:
    d = spec.data
    if d.dataset_name and d.train_file:
        return ["set either data.dataset_name or data.train_file, not both (data.dataset_name=null or data.train_file=null)."]
    if not d.dataset_name and not d.train_file:
        return ["no training data: set data.train_file=/path/to/train.txt (or data.dataset_name=NAME), or use recipe=gpt2_clm_tiny."]
    problems: list[str] = []
    if not d.validation_file and not 0 < d.validation_split_percentage < 100:
        problems.append(
            f"data.validation_split_percentage={d.validation_split_percentage} must be 1-99 when "
            "there is no validation file (or set data.validation_file=...)."
        )
    if d.train_file:
        problems += check_data_files(d)
    elif d.dataset_name and not d.dataset_name.startswith(("/", ".", "~")):
        from runner.model import hub_reachable

        if not _dataset_cached(d.dataset_name) and not hub_reachable():
            problems.append(
                f"data.dataset_name='{d.dataset_name}' is not in the local datasets cache and the hub is "
                "unreachable. Use local files (data.train_file=/path/train.txt) or recipe=gpt2_clm_tiny."
            )
    return problems


def _dataset_cached(name: str) -> bool:
    import os
    from pathlib import Path

    root = Path(os.environ.get("HF_DATASETS_CACHE", Path.home() / ".cache" / "huggingface" / "datasets"))
    return any(root.glob(f"{name.replace('/', '___')}*"))


def check_model(spec: RunSpec) -> list[str]:
    from runner.model import build_config, check_sources, max_positions

    problems = check_sources(spec.model)
    if problems:
        return problems
    try:
        config = build_config(spec.model)
    except UserError as err:
        return err.problems
    except OSError as err:
        return [f"model.name_or_path='{spec.model.name_or_path}': cannot read its config ({str(err).splitlines()[0]})."]
    positions = max_positions(config)
    block = spec.data.block_size
    if block is not None and positions is not None and block > positions:
        problems.append(
            f"data.block_size={block} is larger than the model's {positions} positions. "
            f"Set data.block_size={positions} or less (or raise n_positions in model.config_overrides)."
        )
    return problems


def check_machine(spec: RunSpec) -> list[str]:
    """Strategy packages and precision support on this machine."""
    import torch

    problems: list[str] = []
    if spec.strategy.kind in (StrategyKind.zero2, StrategyKind.zero3) and importlib.util.find_spec("deepspeed") is None:
        problems.append(
            f"strategy={spec.strategy.kind.value} needs DeepSpeed, which is not installed. Install it with "
            "`pip install --no-build-isolation 'runner[deepspeed]'`, or use strategy=ddp."
        )
    tracker_module = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}.get(spec.tracking.value)
    if tracker_module and importlib.util.find_spec(tracker_module) is None:
        problems.append(
            f"tracking={spec.tracking.value} needs the {tracker_module} package: pip install {tracker_module} "
            "(or tracking=none)."
        )
    cuda = torch.cuda.is_available()
    if spec.precision.kind is PrecisionKind.fp16 and not cuda:
        problems.append(
            "precision=fp16 needs a GPU: on a CPU Accelerate would silently compute in fp32. "
            "Use precision=bf16 (real bf16 autocast on CPU) or precision=fp32."
        )
    if spec.precision.kind is PrecisionKind.bf16 and cuda and not torch.cuda.is_bf16_supported():
        problems.append("precision=bf16: this GPU has no bf16 support. Use precision=fp16 or precision=fp32.")
    nproc = spec.launch.nproc_per_node
    if nproc != "auto" and (not nproc.isdigit() or int(nproc) < 1):
        problems.append(f"launch.nproc_per_node={nproc} must be 'auto' or a whole number >= 1.")
    _positive(problems, spec.launch.nnodes, "launch.nnodes")
    _positive(problems, spec.launch.timeout_minutes, "launch.timeout_minutes")
    _positive(problems, spec.launch.rdzv_timeout, "launch.rdzv_timeout")
    if not 0 <= spec.launch.node_rank < max(spec.launch.nnodes, 1):
        problems.append(f"launch.node_rank={spec.launch.node_rank} must be in 0..launch.nnodes-1.")
    if spec.launch.nnodes > 1 and not spec.launch.rdzv_endpoint:
        problems.append("launch.nnodes>1 needs launch.rdzv_endpoint=HOST:PORT (node 0's address), the same on every node.")
    return problems


def derive_accumulation(spec: RunSpec, world_size: int) -> list[str]:
    """train.global_batch_size -> train.grad_accum_steps (written into the frozen spec)."""
    t = spec.train
    if t.global_batch_size is None:
        return []
    per_step = t.per_device_batch_size * world_size
    if t.global_batch_size <= 0 or per_step <= 0 or t.global_batch_size % per_step:
        return [
            f"train.global_batch_size={t.global_batch_size} is not a multiple of per_device_batch_size x world size "
            f"= {t.per_device_batch_size} x {world_size} = {per_step}. Change train.global_batch_size, "
            "train.per_device_batch_size or launch.nproc_per_node."
        ]
    derived = t.global_batch_size // per_step
    if t.grad_accum_steps not in (1, derived):
        return [
            f"train.grad_accum_steps={t.grad_accum_steps} contradicts train.global_batch_size={t.global_batch_size} "
            f"(which needs {derived}). Set only one of them."
        ]
    t.grad_accum_steps = derived
    return []


CHECKS: tuple[Callable[[RunSpec], list[str]], ...] = (check_numbers, check_machine, check_data_source, check_model)


def validate(spec: RunSpec, world_size: int = 1) -> None:
    """Raise one UserError listing every problem found."""
    problems: list[str] = derive_accumulation(spec, world_size)
    for check in CHECKS:
        problems += check(spec)
    if problems:
        raise UserError(problems)


def check_blocks(spec: RunSpec) -> "PreparedData":
    """Tokenize and group the data now, in the launcher: data that yields no training
    or evaluation block is refused before any worker starts, and workers then read
    the same on-disk cache."""
    from runner.data import prepare, resolve_block_size
    from runner.model import build_config, build_tokenizer, max_positions

    tokenizer = build_tokenizer(spec.model)
    block_size = resolve_block_size(spec.data, max_positions(build_config(spec.model)), tokenizer.model_max_length)
    return prepare(spec.data, tokenizer, block_size)
