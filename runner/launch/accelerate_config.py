"""Read an accelerate config YAML (what `accelerate config` writes) into the run spec.

Users arrive with `accelerate launch --config_file deepspeed_zero2.yaml run_clm.py`.
`strategy=accelerate_config strategy.config_file=deepspeed_zero2.yaml` gives the
same run: each key either maps onto a spec field (ACCELERATE_KEYS, also the table
in docs/strategies.md, 'Coming from accelerate launch') or gets a note saying why it
is not honoured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from runner.components.model import build_config, build_meta_model, layer_class_names
from runner.config.errors import UserError
from runner.config.spec import OffloadDevice, PrecisionKind, RunSpec, StrategyKind

# accelerate config key -> the runner override that does the same.
ACCELERATE_KEYS: dict[str, str] = {
    "distributed_type: MULTI_GPU / MULTI_CPU / NO": "strategy=ddp",
    "distributed_type: DEEPSPEED + zero_stage: 2": "strategy=zero2",
    "distributed_type: DEEPSPEED + zero_stage: 3": "strategy=zero3",
    "distributed_type: FSDP + fsdp_version: 2": "strategy=fsdp",
    "mixed_precision: no / bf16 / fp16": "precision=fp32 / bf16 / fp16",
    "num_processes (all machines)": "launch.nproc_per_node (per machine) x launch.nnodes",
    "num_machines": "launch.nnodes",
    "machine_rank": "launch.node_rank",
    "main_process_ip + main_process_port": "launch.rdzv_endpoint=IP:PORT",
    "deepspeed_config.gradient_accumulation_steps": "train.grad_accum_steps",
    "deepspeed_config.gradient_clipping": "optim.max_grad_norm",
    "deepspeed_config.offload_optimizer_device": "strategy.offload_optimizer",
    "deepspeed_config.offload_param_device": "strategy.offload_params",
    "deepspeed_config.zero3_save_16bit_model": "strategy.zero3_save_16bit_model",
    "fsdp_config.fsdp_reshard_after_forward": "strategy.reshard_after_forward",
    "fsdp_config.fsdp_offload_params: true / false": "strategy.offload_params=cpu / none",
    "fsdp_config.fsdp_activation_checkpointing": "model.gradient_checkpointing",
    "fsdp_config.fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP": "(always: each of the model's own transformer layers, e.g. GPT2Block, and the root)",
    "fsdp_config.fsdp_state_dict_type": "(always: checkpoints sharded per rank, model/ the full gathered model)",
}

# run_clm.py / HF Trainer flag -> the runner override that does the same (the table in docs/strategies.md).
RUN_CLM_FLAGS: dict[str, str] = {
    "--model_name_or_path": "model.name_or_path",
    "--model_type": "model.model_type",
    "--config_overrides": "model.config_overrides",
    "--tokenizer_name": "model.tokenizer_name",
    "--dataset_name / --dataset_config_name": "data.dataset_name / data.dataset_config_name",
    "--train_file / --validation_file": "data.train_file / data.validation_file",
    "--validation_split_percentage": "data.validation_split_percentage",
    "--block_size": "data.block_size",
    "--keep_linebreaks": "data.keep_linebreaks",
    "--max_train_samples / --max_eval_samples": "data.max_train_samples / data.max_eval_samples",
    "--preprocessing_num_workers": "data.preprocessing_num_workers",
    "--per_device_train_batch_size": "train.per_device_batch_size",
    "--per_device_eval_batch_size": "train.per_device_eval_batch_size",
    "--gradient_accumulation_steps": "train.grad_accum_steps",
    "--num_train_epochs / --max_steps": "train.num_epochs / train.max_steps",
    "--seed": "train.seed",
    "--logging_steps / --eval_steps / --save_steps": "train.log_every / train.eval_every / train.save_every",
    "--save_total_limit": "train.keep_checkpoints",
    "--learning_rate / --weight_decay / --max_grad_norm": "optim.lr / optim.weight_decay / optim.max_grad_norm",
    "--lr_scheduler_type / --warmup_steps / --warmup_ratio": "schedule=linear (or cosine, constant) / schedule.warmup_steps / schedule.warmup_ratio",
    "--bf16 / --fp16": "precision=bf16 / precision=fp16",
    "--gradient_checkpointing": "model.gradient_checkpointing=true",
    "--torch_compile": "model.compile=true",
    "--output_dir / --overwrite_output_dir": "hydra.run.dir=DIR / overwrite=true",
    "--resume_from_checkpoint": "resume=PATH (or resume=auto)",
    "--deepspeed ds_config.json": "strategy=zero2 or strategy=zero3 (+ strategy.offload_optimizer / offload_params)",
}

# Keys that need no action here, with the reason a user might want to know.
_NOTED: dict[str, str] = {
    "gpu_ids": "choose GPUs with CUDA_VISIBLE_DEVICES",
    "use_cpu": "the runner uses a GPU when there is one, the CPU otherwise",
    "downcast_bf16": "only meaningful on TPUs",
    "dynamo_config": "use model.compile=true",
    "rdzv_backend": "the runner always uses a c10d rendezvous",
    "debug": "not needed",
    "enable_cpu_affinity": "not supported",
    "deepspeed_config.zero3_init_flag": "the model is always built before the engine, so ZeRO-3 starts from the same weights as DDP",
    "deepspeed_config.deepspeed_config_file": "a raw DeepSpeed JSON is not read; give its settings as strategy fields",
    "deepspeed_config.deepspeed_multinode_launcher": "the runner spawns its own workers on each node",
    "fsdp_config.fsdp_cpu_ram_efficient_loading": "every rank builds the same seeded model, so nothing is loaded on rank 0 alone",
    "fsdp_config.fsdp_sync_module_states": "every rank builds the same seeded model, so there is nothing to broadcast",
    "fsdp_config.fsdp_use_orig_params": "FSDP1 only; FSDP2 always trains the original parameters",
    "fsdp_config.fsdp_backward_prefetch": "FSDP1 only; FSDP2 prefetches by itself",
    "fsdp_config.fsdp_forward_prefetch": "FSDP1 only",
    "fsdp_config.fsdp_min_num_params": "the runner wraps each transformer layer, not by size",
}
# FSDP keys read into the spec (the others get a note).
_FSDP_HANDLED = {"fsdp_version", "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_activation_checkpointing",
                 "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_state_dict_type"}
_SILENT = {"compute_environment", "main_training_function", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
           "tpu_name", "tpu_zone", "commands", "command_file", "num_cpu_threads_per_process", "ipex_config", "mpirun_config"}


def _offload(value: Any, key: str) -> OffloadDevice:
    text = str(value or "none").lower()
    if text not in ("none", "cpu"):
        raise UserError(f"accelerate config {key}: {value!r} is not supported; use none or cpu.")
    return OffloadDevice(text)


def _flag(value: Any, key: str) -> bool:
    """A yes/no value as `accelerate config` writes it (a YAML bool), or as a hand-written string."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise UserError(f"accelerate config fsdp_config.{key}: {value!r} is not true or false.")


def _apply_fsdp(spec: RunSpec, fsdp: dict[str, Any], filename: str) -> list[str]:
    """fsdp_config (FSDP2 only) -> strategy=fsdp and its settings; notes on the rest."""
    version = int(fsdp.get("fsdp_version", 1))  # accelerate's default when the key is absent
    if version != 2:
        raise UserError(
            f"accelerate config fsdp_version={version}: the runner runs FSDP2 (fully_shard), not FSDP1, whose "
            "flat parameters it does not support. Set fsdp_version: 2 in the file (FULL_SHARD is "
            "fsdp_reshard_after_forward: true, SHARD_GRAD_OP is false), or use strategy=fsdp directly."
        )
    spec.strategy.kind = StrategyKind.fsdp
    notes: list[str] = []
    if "fsdp_reshard_after_forward" in fsdp:
        spec.strategy.reshard_after_forward = _flag(fsdp["fsdp_reshard_after_forward"], "fsdp_reshard_after_forward")
    if "fsdp_offload_params" in fsdp:
        offload = _flag(fsdp["fsdp_offload_params"], "fsdp_offload_params")
        spec.strategy.offload_params = OffloadDevice.cpu if offload else OffloadDevice.none
    if _flag(fsdp.get("fsdp_activation_checkpointing", False), "fsdp_activation_checkpointing"):
        spec.model.gradient_checkpointing = True
    policy = str(fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        notes.append(f"{filename}: fsdp_config.fsdp_auto_wrap_policy={policy} not applied (the runner wraps each "
                     "transformer layer and the root: TRANSFORMER_BASED_WRAP).")
    layers = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if layers and {str(c).strip() for c in str(layers).split(",")} != set(_model_layer_classes(spec)):
        notes.append(f"{filename}: fsdp_config.fsdp_transformer_layer_cls_to_wrap={layers!r} not applied (the runner "
                     "wraps the model's own layer classes, the ones transformers names in its _no_split_modules).")
    state_dict = str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT")).upper()
    if state_dict != "SHARDED_STATE_DICT":
        notes.append(f"{filename}: fsdp_config.fsdp_state_dict_type={state_dict} not applied (checkpoints are always "
                     "sharded per rank, and model/ is always the full gathered model).")
    for key, value in fsdp.items():
        if key in _FSDP_HANDLED:
            continue
        reason = _NOTED.get(f"fsdp_config.{key}", "unknown to the runner")
        if value not in (None, False) or f"fsdp_config.{key}" not in _NOTED:
            notes.append(f"{filename}: fsdp_config.{key}={value!r} not applied ({reason}).")
    return notes


def apply_accelerate_config(spec: RunSpec) -> list[str]:
    """Set spec fields from spec.strategy.config_file; returns notes on unhonoured keys."""
    path = Path(str(spec.strategy.config_file)).expanduser()
    if not path.is_file():
        raise UserError(f"strategy.config_file: no such file '{path}'. Give the YAML that `accelerate config` wrote.")
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"strategy.config_file '{path}' is not valid YAML ({err}).") from None
    if not isinstance(cfg, dict):
        raise UserError(f"strategy.config_file '{path}' does not hold a mapping of accelerate settings.")
    notes: list[str] = []
    kind = str(cfg.get("distributed_type", "NO")).upper()
    ds = cfg.get("deepspeed_config") or {}
    if kind in ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU"):
        spec.strategy.kind = StrategyKind.ddp
    elif kind == "DEEPSPEED":
        stage = int(ds.get("zero_stage", 2))
        if stage not in (2, 3):
            raise UserError(f"accelerate config zero_stage={stage}: the runner offers ZeRO stages 2 and 3 (strategy=zero2|zero3).")
        spec.strategy.kind = StrategyKind.zero2 if stage == 2 else StrategyKind.zero3
        spec.strategy.offload_optimizer = _offload(ds.get("offload_optimizer_device"), "offload_optimizer_device")
        spec.strategy.offload_params = _offload(ds.get("offload_param_device"), "offload_param_device")
        if "zero3_save_16bit_model" in ds:
            spec.strategy.zero3_save_16bit_model = bool(ds["zero3_save_16bit_model"])
        if "gradient_accumulation_steps" in ds:
            spec.train.grad_accum_steps = int(ds["gradient_accumulation_steps"])
        if "gradient_clipping" in ds:
            spec.optim.max_grad_norm = float(ds["gradient_clipping"])
    elif kind == "FSDP":
        notes += _apply_fsdp(spec, cfg.get("fsdp_config") or {}, path.name)
    else:
        raise UserError(
            f"accelerate config distributed_type={kind} is not offered: use MULTI_GPU, DEEPSPEED or FSDP "
            "(strategy=ddp|zero2|zero3|fsdp)."
        )

    precision = str(cfg.get("mixed_precision", "no")).lower()
    mapping = {"no": PrecisionKind.fp32, "bf16": PrecisionKind.bf16, "fp16": PrecisionKind.fp16}
    if precision not in mapping:
        raise UserError(f"accelerate config mixed_precision={precision} is not supported; use no, bf16 or fp16.")
    spec.precision.kind = mapping[precision]

    machines = int(cfg.get("num_machines", 1))
    processes = int(cfg.get("num_processes", 1))
    if processes % machines:
        raise UserError(f"accelerate config num_processes={processes} does not divide over num_machines={machines}.")
    spec.launch.nnodes = machines
    spec.launch.nproc_per_node = str(processes // machines)
    spec.launch.node_rank = int(cfg.get("machine_rank", 0))
    if cfg.get("main_process_ip"):
        spec.launch.rdzv_endpoint = f"{cfg['main_process_ip']}:{cfg.get('main_process_port', 29500)}"

    handled = {"distributed_type", "deepspeed_config", "mixed_precision", "num_machines", "num_processes",
               "machine_rank", "main_process_ip", "main_process_port"}
    handled_ds = {"zero_stage", "offload_optimizer_device", "offload_param_device", "zero3_save_16bit_model",
                  "gradient_accumulation_steps", "gradient_clipping"}
    for key, value in cfg.items():
        if key in handled or key in _SILENT or key.startswith(("fsdp", "megatron", "tpu")):
            continue
        reason = _NOTED.get(key, "unknown to the runner")
        if value not in (None, False, "no", "all", [], {}) or key not in _NOTED:
            notes.append(f"{path.name}: {key}={value!r} not applied ({reason}).")
    for key, value in ds.items():
        if key not in handled_ds:
            reason = _NOTED.get(f"deepspeed_config.{key}", "unknown to the runner")
            notes.append(f"{path.name}: deepspeed_config.{key}={value!r} not applied ({reason}).")
    return notes


def _model_layer_classes(spec: Any) -> list[str]:
    """The layer classes runner's FSDP wraps for this spec's model (built on the meta
    device); empty when the model cannot be built (preflight says why)."""
    try:
        with torch.device("meta"):
            return layer_class_names(build_meta_model(build_config(spec.model)))
    except Exception:  # noqa: BLE001 - reported by the model checks, with the reason
        return []
