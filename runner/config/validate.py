"""Cross-field validation of a RunSpec: every problem at once, each naming its fix.

The schema (runner/config/spec.py) already rejected unknown keys and wrong types at
compose time; these are the checks that need several fields, the machine, or the
files on disk. Runs in the launcher only, before a run folder is touched.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from runner.components.data_checks import check_data_files
from runner.config.errors import UserError
from runner.config.spec import PrecisionKind, RunSpec, StrategyKind

if TYPE_CHECKING:
    from runner.components.data import PreparedData


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
    _positive(p, t.num_epochs, "train.num_epochs")  # also when max_steps wins: a bad value is refused, not ignored
    if not 0 <= t.seed < 2**32:  # numpy's seed range
        p.append(f"train.seed={t.seed} must be in 0..2**32-1. Set train.seed=<a whole number >= 0>.")
    for key in ("log_every", "eval_every", "save_every"):
        _positive(p, getattr(t, key), f"train.{key}", allow_zero=True)
    _positive(p, t.keep_checkpoints, "train.keep_checkpoints")
    _positive(p, t.dataloader_num_workers, "train.dataloader_num_workers", allow_zero=True)
    _positive(p, spec.optim.lr, "optim.lr")
    _positive(p, spec.optim.weight_decay, "optim.weight_decay", allow_zero=True)
    _positive(p, spec.optim.max_grad_norm, "optim.max_grad_norm", allow_zero=True)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(spec.optim, key) < 1.0:
            p.append(f"optim.{key}={getattr(spec.optim, key)} must be in [0, 1) (AdamW's decay rate; 0.9 / 0.999 are usual).")
    _positive(p, spec.optim.eps, "optim.eps")
    _positive(p, spec.optim.reference_global_batch, "optim.reference_global_batch")
    if spec.optim.scale_lr.value != "none" and not spec.optim.reference_global_batch:
        p.append(
            f"optim.scale_lr={spec.optim.scale_lr.value} needs the batch the lr was tuned at: "
            "set optim.reference_global_batch=<global batch>."
        )
    _positive(p, spec.precision.max_consecutive_skipped_steps, "precision.max_consecutive_skipped_steps")
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
    if not 0 < d.validation_split_percentage < 100:  # also with a validation file: refused, not ignored
        problems.append(f"data.validation_split_percentage={d.validation_split_percentage} must be 1-99.")
    if d.dataset_config_name and not d.dataset_name:
        problems.append(f"data.dataset_config_name={d.dataset_config_name} is a hub dataset's configuration, but "
                        "data.dataset_name is not set: set data.dataset_name=NAME or data.dataset_config_name=null.")
    if d.text_column is not None and any(str(f).endswith((".txt", ".txt.gz")) for f in (d.train_file, d.validation_file) if f):
        problems.append(f"data.text_column={d.text_column}: a .txt file has one column, `text`; data.text_column "
                        "is for .json/.jsonl/.csv files. Set data.text_column=null.")
    if d.cache_dir is not None:
        problems += _check_cache_dir(d.cache_dir)
    if d.train_file:
        problems += check_data_files(d)
    elif d.dataset_name and not d.dataset_name.startswith(("/", ".", "~")):
        from runner.components.model import hub_reachable

        if not _dataset_cached(d.dataset_name) and not hub_reachable():
            problems.append(
                f"data.dataset_name='{d.dataset_name}' is not in the local datasets cache and the hub is "
                "unreachable. Use local files (data.train_file=/path/train.txt) or recipe=gpt2_clm_tiny."
            )
    return problems


def _check_cache_dir(cache_dir: str) -> list[str]:
    """The folder must be, or be creatable as, a writable directory."""
    import os

    path = Path(cache_dir).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if (path.exists() and not path.is_dir()) or not existing.is_dir() or not os.access(existing, os.W_OK):
        return [f"data.cache_dir={cache_dir} is not a writable folder (nor creatable as one). Set data.cache_dir to a "
                "folder you can write, or data.cache_dir=null for the default."]
    return []


def _dataset_cached(name: str) -> bool:
    import os

    root = Path(os.environ.get("HF_DATASETS_CACHE", Path.home() / ".cache" / "huggingface" / "datasets"))
    return any(root.glob(f"{name.replace('/', '___')}*"))


def check_model(spec: RunSpec) -> list[str]:
    from runner.components.model import build_config, check_sources, max_positions

    problems = check_sources(spec.model) + _empty_model_folders(spec)
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


def _empty_model_folders(spec: RunSpec) -> list[str]:
    """A local folder given as the model or tokenizer must hold one (save_pretrained's files)."""
    from runner.components.model import tokenizer_source

    m, problems = spec.model, []
    wanted = (
        (m.name_or_path, "model.name_or_path", "model", ("config.json",)),
        (tokenizer_source(m), "model.tokenizer_name" if m.tokenizer_name else "model.name_or_path", "tokenizer",
         ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")),
    )
    for value, override, what, files in wanted:
        folder = Path(str(value)).expanduser() if value else None
        if folder is not None and folder.is_dir() and not any((folder / f).is_file() for f in files):
            problems.append(f"{override}='{value}' is a folder with no {what} in it (none of {', '.join(files)}). "
                            f"Point {override} at a folder written by save_pretrained.")
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
    return problems


def check_launch(spec: RunSpec) -> list[str]:
    """launch.* is read before the rest is validated (it decides the world size the batch
    arithmetic is checked at), so the launcher runs this first; it is in CHECKS too."""
    launch, problems = spec.launch, []
    nproc = launch.nproc_per_node
    if nproc != "auto" and (not nproc.isdigit() or int(nproc) < 1):
        problems.append(f"launch.nproc_per_node={nproc} must be 'auto' or a whole number >= 1.")
    _positive(problems, launch.nnodes, "launch.nnodes")
    _positive(problems, launch.max_restarts, "launch.max_restarts", allow_zero=True)
    _positive(problems, launch.timeout_minutes, "launch.timeout_minutes")
    _positive(problems, launch.rdzv_timeout, "launch.rdzv_timeout")
    if not 0 <= launch.node_rank < max(launch.nnodes, 1):
        problems.append(f"launch.node_rank={launch.node_rank} must be in 0..launch.nnodes-1.")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        problems.append("launch.nnodes>1 needs launch.rdzv_endpoint=HOST:PORT (node 0's address), the same on every node.")
    if launch.rdzv_endpoint is not None:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"launch.rdzv_endpoint={launch.rdzv_endpoint} must be HOST:PORT, e.g. 10.0.0.1:29500.")
    return problems


def check_names(spec: RunSpec) -> list[str]:
    """The run's name is a folder name (outputs/<name>/...) and the trackers' project."""
    if not spec.name.strip() or "/" in spec.name or spec.name in (".", ".."):
        return [f"name='{spec.name}' must be a non-empty folder name without '/'. Set name=my_run."]
    return []


def check_strategy(spec: RunSpec) -> list[str]:
    """Strategy settings that would be accepted and then do nothing are refused."""
    st, p = spec.strategy, []
    kind = st.kind.value
    if st.offload_optimizer.value != "none" and st.kind is StrategyKind.fsdp:
        p.append(f"strategy.offload_optimizer={st.offload_optimizer.value}: FSDP2 offloads the optimizer state only "
                 "together with the parameters. Use strategy.offload_params=cpu (parameters, gradients and the "
                 "optimizer step on the CPU), or strategy=zero2 strategy.offload_optimizer=cpu.")
    elif st.offload_optimizer.value != "none" and st.kind not in (StrategyKind.zero2, StrategyKind.zero3):
        p.append(f"strategy.offload_optimizer={st.offload_optimizer.value} needs ZeRO: use strategy=zero2 or zero3 "
                 "(or strategy.offload_optimizer=none).")
    if not st.reshard_after_forward and st.kind is not StrategyKind.fsdp:
        p.append(f"strategy.reshard_after_forward=false is an FSDP2 setting, not one of strategy={kind}. Use "
                 "strategy=fsdp, or remove the override.")
    if st.offload_params.value != "none" and st.kind not in (StrategyKind.zero3, StrategyKind.fsdp):
        p.append(f"strategy.offload_params={st.offload_params.value}: only ZeRO-3 partitions (and so offloads) the "
                 f"parameters, not strategy={kind}. Use strategy=zero3 or fsdp, or strategy.offload_params=none "
                 "(strategy.offload_optimizer=cpu offloads the optimizer state under zero2).")
    if st.config_file and not Path(st.config_file).expanduser().is_file():
        p.append(f"strategy.config_file: no such file '{st.config_file}'. Give the YAML that `accelerate config` wrote.")
    return p


def check_fsdp(spec: RunSpec) -> list[str]:
    """What strategy=fsdp cannot do here, refused before any worker starts (the world
    size is checked in validate(), which knows it)."""
    import torch

    from runner.distributed.fsdp import LAYER_CLASSES

    if spec.strategy.kind is not StrategyKind.fsdp:
        return []
    p = []
    if spec.strategy.offload_params.value != "none" and not torch.cuda.is_available():
        p.append("strategy.offload_params=cpu under strategy=fsdp moves parameters from the GPU to host memory; on a "
                 "CPU-only machine they are there already. Set strategy.offload_params=none.")
    if spec.model.compile:
        p.append("model.compile=true with strategy=fsdp is not supported yet (Accelerate compiles the model before "
                 "fully_shard, which runner's engagement check and unwrap do not handle). Use model.compile=false, "
                 "or strategy=ddp / zero2 with model.compile=true.")
    if spec.model.name_or_path is None and spec.model.model_type not in LAYER_CLASSES:
        p.append(f"strategy=fsdp wraps each transformer layer of {', '.join(LAYER_CLASSES)} models; "
                 f"model.model_type={spec.model.model_type} has no known layer class. Use strategy=zero3 or ddp.")
    return p


def check_fsdp_world_size(spec: RunSpec, world_size: Optional[int]) -> list[str]:
    """FSDP shards over a process group: at one process Accelerate builds none, and
    FSDP2 would not engage (runner never falls back silently)."""
    if spec.strategy.kind is StrategyKind.fsdp and world_size == 1:
        return ["strategy=fsdp shards the model over 2 or more processes; this run has 1. Set "
                "launch.nproc_per_node=2 (or more), or use strategy=ddp for one process."]
    return []


def check_sweep(spec: RunSpec) -> list[str]:
    """sweep.parity_baseline's form; which job it names is checked when the sweep ends."""
    from runner.sweep.parity import setting_problems

    return setting_problems(spec.sweep.parity_baseline)


def check_accelerate_environment(spec: RunSpec) -> list[str]:
    """An outer `accelerate launch` passes its settings as ACCELERATE_* variables. Accelerate
    lets ACCELERATE_GRADIENT_ACCUMULATION_STEPS override the value runner passes, and ignores
    ACCELERATE_MIXED_PRECISION for it: either way one of the two settings would silently lose."""
    import os

    from runner.distributed.accelerator import MIXED_PRECISION

    p = []
    accum = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if accum is not None and accum != str(spec.train.grad_accum_steps):
        p.append(f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={accum} (from an outer accelerate launch) contradicts "
                 f"train.grad_accum_steps={spec.train.grad_accum_steps}: set train.grad_accum_steps={accum} and drop the "
                 "launcher's --gradient_accumulation_steps (or unset the variable).")
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if mixed is not None and mixed.lower() != MIXED_PRECISION[spec.precision.kind]:
        names = {v: k.value for k, v in MIXED_PRECISION.items()}
        p.append(f"ACCELERATE_MIXED_PRECISION={mixed} (from an outer accelerate launch) contradicts "
                 f"precision={spec.precision.kind.value}: set precision={names.get(mixed.lower(), '...')} and drop the "
                 "launcher's --mixed_precision (or unset the variable).")
    return p


def check_gpu_precision(spec: RunSpec) -> list[str]:
    """bf16 needs an Ampere or newer GPU (compute capability 8.0+) on every visible device.
    torch.cuda.is_bf16_supported() also counts emulation, which runs bf16 on a V100 or
    T4 many times slower than fp16, so the capability is what is checked."""
    import torch

    if spec.precision.kind is not PrecisionKind.bf16 or not torch.cuda.is_available():
        return []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 0):
            name = torch.cuda.get_device_name(index)
            return [
                f"precision=bf16 needs an Ampere or newer GPU (compute capability 8.0+); {name} is {major}.{minor} "
                "and would only emulate bf16, slowly. Use precision=fp16 (loss scaling) or precision=fp32."
            ]
    return []


def check_zero_save(spec: RunSpec) -> list[str]:
    """model/ is always written as full fp32 weights gathered from ZeRO's master copy
    (runner/distributed/accelerator.py zero_fp32_state_dict), so the 16-bit gather cannot be turned off;
    refused here rather than found out after training."""
    if spec.strategy.kind is StrategyKind.zero3 and not spec.strategy.zero3_save_16bit_model:
        return [
            "strategy.zero3_save_16bit_model=false is not supported: runner always writes model/ as full fp32 "
            "weights gathered from every rank. Remove the override (or set strategy.zero3_save_16bit_model=true)."
        ]
    return []


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


CHECKS: tuple[Callable[[RunSpec], list[str]], ...] = (
    check_names, check_numbers, check_launch, check_strategy, check_accelerate_environment, check_machine,
    check_gpu_precision, check_zero_save, check_fsdp, check_data_source, check_model, check_sweep,
)


def validate(spec: RunSpec, world_size: Optional[int] = 1) -> None:
    """Raise one UserError listing every problem found. world_size None: launch.* is
    invalid, so the world size (and the accumulation derived from it) is unknown."""
    problems: list[str] = derive_accumulation(spec, world_size) if world_size is not None else []
    problems += check_fsdp_world_size(spec, world_size)
    for check in CHECKS:
        problems += check(spec)
    if problems:
        raise UserError(problems)


def check_blocks(spec: RunSpec) -> "PreparedData":
    """Tokenize and group the data now, in the launcher: data that yields no training
    or evaluation block is refused before any worker starts, and workers then read
    the same on-disk cache."""
    from runner.components.data import prepare, resolve_block_size
    from runner.components.model import build_config, build_tokenizer, max_positions

    tokenizer = build_tokenizer(spec.model)
    block_size = resolve_block_size(spec.data, max_positions(build_config(spec.model)), tokenizer.model_max_length)
    return prepare(spec.data, tokenizer, block_size)
