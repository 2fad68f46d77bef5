"""The launcher's pre-flight: what the spec asks of this machine, the model and the data.

Pure checks of the spec's fields are runner/config/validate.py; these read files,
probe the machine (CUDA, installed packages), build the model's config, and finally
tokenize the data (`prepare_data`), so that every problem is reported at once, before
a run folder is touched or a worker starts.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runner.components.adapters import add_adapters, uses_adapters
from runner.components.data.checks import check_data_files as check_files
from runner.components.data.prepare import PreparedData, prepare, resolve_block_size
from runner.components.data.prompts import prepare_prompts
from runner.components.data.stream import BadRecord, StreamedData, check_stream_files, first_step, open_stream
from runner.components.model import (
    build_config,
    build_meta_model,
    build_tokenizer,
    check_sources,
    hub_reachable,
    layer_class_names,
    max_positions,
    probe_model,
    tokenizer_source,
)
from runner.config.errors import UserError
from runner.config.spec import DataFormat, LaunchEngine, PrecisionKind, RunSpec, StrategyKind
from runner.config.validate import spec_problems
from runner.distributed.strategy import MIXED_PRECISION
from runner.launch.elastic import elastic_problems
from runner.report.benchmarks import check as check_benchmarks
from runner.train.checkpoint import is_complete
from runner.train.resume import not_a_checkpoint


def check_data_files(spec: RunSpec) -> list[str]:
    """The data's files, cache folder, or hub dataset are there to be read (a mixture's:
    each source's, its problems naming it)."""
    d, problems = spec.data, []
    if d.mixture:
        from dataclasses import replace

        from runner.config.mixture import source_names, source_specs

        for name, source in zip(source_names(d), source_specs(d)):
            problems += [f"data.mixture: source {name}: {p}" for p in check_data_files(replace(spec, data=source))]
        return problems
    if d.cache_dir is not None:
        problems += _check_cache_dir(d.cache_dir)
    if d.train_file and d.streaming:  # a stream is not read through here: its bad records are named mid-stream
        problems += check_stream_files(d.train_file, "data.train_file")
        problems += check_stream_files(d.validation_file, "data.validation_file") if d.validation_file else []
    elif d.train_file:
        problems += check_files(d)
    elif d.dataset_name and not d.dataset_name.startswith(("/", ".", "~")):
        if not _dataset_cached(d.dataset_name) and not hub_reachable():
            problems.append(
                f"data.dataset_name='{d.dataset_name}' is not in the local datasets cache and the hub is "
                "unreachable. Use local files (data.train_file=/path/train.txt) or recipe=gpt2_clm_tiny."
            )
    return problems


def check_strategy_file(spec: RunSpec) -> list[str]:
    st = spec.strategy
    if st.config_file and not Path(st.config_file).expanduser().is_file():
        return [f"strategy.config_file: no such file '{st.config_file}'. Give the YAML that `accelerate config` wrote."]
    return []


def _check_cache_dir(cache_dir: str) -> list[str]:
    """The folder must be, or be creatable as, a writable directory."""
    path = Path(cache_dir).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if (path.exists() and not path.is_dir()) or not existing.is_dir() or not os.access(existing, os.W_OK):
        return [f"data.cache_dir={cache_dir} is not a writable folder (nor creatable as one). Set data.cache_dir to a "
                "folder you can write, or data.cache_dir=null for the default."]
    return []


def _dataset_cached(name: str) -> bool:
    root = Path(os.environ.get("HF_DATASETS_CACHE", Path.home() / ".cache" / "huggingface" / "datasets"))
    return any(root.glob(f"{name.replace('/', '___')}*"))


def check_model(spec: RunSpec) -> list[str]:
    problems = check_sources(spec.model) + _empty_model_folders(spec)
    if problems:
        return problems
    try:
        config = build_config(spec.model)
    except UserError as err:
        return err.problems
    except OSError as err:
        return [f"model.name_or_path='{spec.model.name_or_path}': cannot read its config ({str(err).splitlines()[0]})."]
    quantized = getattr(config, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else getattr(quantized, "quant_method", "?")
        bits = ("4-bit" if _quantized_flag(quantized, "load_in_4bit") else
                "8-bit" if _quantized_flag(quantized, "load_in_8bit") else "quantized")
        return [f"model.name_or_path={spec.model.name_or_path} holds {bits} weights (quant_method={method}): runner "
                "trains fp32 weights and cannot train or shard quantized ones (QLoRA needs a CUDA GPU and "
                "bitsandbytes; docs/adapters.md). Use the model's unquantized weights."]
    problems += probe_model(spec.model, config)
    if not problems and uses_adapters(spec.peft):
        problems += adapter_problems(spec, config)
    positions = max_positions(config)
    block = spec.data.block_size
    if block is not None and positions is not None and block > positions:
        problems.append(
            f"data.block_size={block} is larger than the model's {positions} positions. "
            f"Set data.block_size={positions} or less (or raise n_positions in model.config_overrides)."
        )
    return problems


def _quantized_flag(quantized: Any, key: str) -> bool:
    return bool(quantized.get(key) if isinstance(quantized, dict) else getattr(quantized, key, False))


def adapter_problems(spec: RunSpec, config: Any) -> list[str]:
    """The adapters applied to the model built on the meta device (no memory): a target
    list that matches no layer, or that peft cannot adapt, is refused before launch."""
    try:
        with torch.device("meta"):
            add_adapters(spec.peft, build_meta_model(config))
    except UserError as err:
        return err.problems
    return []


def _empty_model_folders(spec: RunSpec) -> list[str]:
    """A local folder given as the model or tokenizer must hold one (save_pretrained's files)."""
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
    if spec.launch.engine is LaunchEngine.ray and importlib.util.find_spec("ray") is None:
        problems.append('launch.engine=ray needs Ray Train, which is not installed: pip install "runner[ray]" '
                        "(or launch.engine=local).")
    cuda = torch.cuda.is_available()
    if spec.precision.kind is PrecisionKind.fp16 and not cuda:
        problems.append(
            "precision=fp16 needs a GPU: on a CPU Accelerate would silently compute in fp32. "
            "Use precision=bf16 (real bf16 autocast on CPU) or precision=fp32."
        )
    return problems


def fsdp_layer_problems(spec: RunSpec) -> list[str]:
    """strategy=fsdp wraps each of the model's own transformer layers (its
    _no_split_modules classes, read from the model built on the meta device)."""
    try:
        config = build_config(spec.model)
        with torch.device("meta"):
            model = build_meta_model(config)
    except Exception:  # noqa: BLE001 - check_model reports a model that cannot be built, with its reason
        return []
    if layer_class_names(model):
        return []
    return [f"strategy=fsdp wraps each transformer layer of the model in its own FSDP unit, and "
            f"{type(model).__name__} names no layer class to wrap (transformers' _no_split_modules is empty). "
            "Use strategy=zero3 or ddp."]


def check_fsdp(spec: RunSpec) -> list[str]:
    """What strategy=fsdp cannot do here, refused before any worker starts (the world
    size is checked in validate(), which knows it)."""
    if spec.strategy.kind is not StrategyKind.fsdp:
        return []
    p = []
    if spec.strategy.offload_params.value != "none" and not torch.cuda.is_available():
        p.append("strategy.offload_params=cpu under strategy=fsdp moves parameters from the GPU to host memory; on a "
                 "CPU-only machine they are there already. Set strategy.offload_params=none.")
    p += fsdp_layer_problems(spec)
    return p


def check_accelerate_environment(spec: RunSpec) -> list[str]:
    """An outer `accelerate launch` passes its settings as ACCELERATE_* variables. Accelerate
    lets ACCELERATE_GRADIENT_ACCUMULATION_STEPS override the value runner passes, and ignores
    ACCELERATE_MIXED_PRECISION for it: either way one of the two settings would silently lose."""
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


def check_resume_path(spec: RunSpec) -> list[str]:
    """resume=PATH names a complete checkpoint: said with the other problems, before the
    data is tokenized (runner/train/resume.py checks the checkpoint itself later)."""
    if spec.resume in (None, "auto"):
        return []
    path = Path(spec.resume).expanduser().resolve()
    return [] if is_complete(path) else [not_a_checkpoint(spec.resume, path)]


CHECKS: tuple[Callable[[RunSpec], list[str]], ...] = (
    check_strategy_file, check_accelerate_environment, check_machine, check_gpu_precision, check_fsdp,
    check_data_files, check_model, check_resume_path, check_benchmarks,
)


def validate(spec: RunSpec, world_size: Optional[int] = 1) -> None:
    """Raise one UserError listing every problem found, the spec's own (config/validate.py)
    and this machine's, model's and data's. world_size None: launch.* is invalid."""
    problems = spec_problems(spec, world_size) + elastic_problems(spec, world_size)
    for check in CHECKS:
        problems += check(spec)
    if problems:
        raise UserError(problems)


def prepare_data(spec: RunSpec, world_size: int = 1) -> PreparedData | StreamedData:
    """Tokenize and group the data now, in the launcher: data that yields no training
    or evaluation block is refused before any worker starts, and workers then read
    the same on-disk cache. A stream is only opened: its evaluation blocks and each
    rank's first optimizer step of training blocks are read, nothing more."""
    tokenizer = build_tokenizer(spec.model)
    block_size = resolve_block_size(spec.data, max_positions(build_config(spec.model)), tokenizer.model_max_length)
    if spec.data.streaming:
        try:
            streamed = open_stream(spec.data, tokenizer, block_size, spec.train.seed)
        except BadRecord as err:  # in the evaluation blocks: before any worker starts
            raise UserError(err.line) from None
        check_stream_step(spec, world_size, streamed, tokenizer)
        return streamed
    if spec.data.format is DataFormat.prompts:
        prompts = prepare_prompts(spec.data, tokenizer, block_size)
        longest = check_prompt_lengths(spec, prompts, tokenizer)
        # the rows training and the memory plan see: the longest prompt and a whole completion
        return replace(prompts, block_size=longest + spec.rl.max_completion_length)
    return prepare(spec.data, tokenizer, block_size)


def check_prompt_lengths(spec: RunSpec, data: PreparedData, tokenizer: Any) -> int:
    """train.objective=grpo: the rewards build (a regex compiles, a function is there), and
    the longest prompt + rl.max_completion_length fits the model's positions; returns the
    longest prompt's length in tokens."""
    from runner.components.rewards import build_rewards
    from runner.components.rollouts import prompt_tokens

    build_rewards(spec.rl.rewards, spec.rl.max_completion_length)  # a BadReward is a UserError: one line
    positions = max_positions(build_config(spec.model))
    longest = max(len(prompt_tokens(tokenizer, row[spec.data.prompt_field], spec.rl.chat_prompts))
                  for split in (data.train, data.validation) for row in split)
    if positions is not None and longest + spec.rl.max_completion_length > positions:
        raise UserError(f"the longest prompt ({longest} tokens) + rl.max_completion_length="
                        f"{spec.rl.max_completion_length} is longer than the model's {positions} positions: lower "
                        f"rl.max_completion_length to {max(positions - longest, 0)} or less, or shorten the prompts.")
    return longest


def check_stream_step(spec: RunSpec, world_size: int, streamed: StreamedData, tokenizer: Any = None) -> None:
    """Each rank's share of the stream holds one optimizer step (micro-batch x accumulation),
    read now; called again once an auto micro-batch is chosen. `streamed`: rank 0's of one."""
    tokenizer = tokenizer or build_tokenizer(spec.model)
    per_step = spec.train.per_device_batch_size * spec.train.grad_accum_steps
    try:
        for rank in range(world_size):  # each rank's own share: the last is often the shortest
            share = streamed if world_size == 1 else open_stream(
                spec.data, tokenizer, streamed.block_size, spec.train.seed, rank=rank, world_size=world_size)
            first_step(share, spec.data, per_step, rank, world_size)
    except BadRecord as err:  # in the first window: before any worker starts
        raise UserError(err.line) from None
