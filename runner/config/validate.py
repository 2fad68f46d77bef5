"""Pure validation of a RunSpec: the cross-field checks, every problem at once, each naming its fix.

The schema (runner/config/spec.py) already rejected unknown keys and wrong types at
compose time. These checks read the spec alone: no files, no network, no probing of
the machine, no change to the spec. What needs the machine, the model or the data is
the launcher's pre-flight (runner/launch/preflight.py), which reports its problems
together with these.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Callable, Optional

from runner.config.rl_checks import check_rl
from runner.config.batch import accumulation_for
from runner.config.mixture import SINGLE_SOURCE, row_format, source_names, source_specs
from runner.config.spec import (DataFormat, DataSpec, LaunchEngine, LaunchSpec, ObjectiveKind, PeftKind, PreferenceLoss,
                                PreferenceSpec, ReferenceMode, RunSpec, StrategyKind)


def _positive(problems: list[str], value: object, key: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        problems.append(f"{key}={value} must be {bound}. Set {key}=<a number {bound}>.")


def check_numbers(spec: RunSpec) -> list[str]:
    p: list[str] = []
    t = spec.train
    b = t.per_device_batch_size  # a whole number or auto (settled by the launcher, runner/launch/auto_batch.py)
    if b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
        p.append(f"train.per_device_batch_size={b} must be a whole number > 0 or auto. "
                 "Set train.per_device_batch_size=<a number > 0> or train.per_device_batch_size=auto.")
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


def check_mixture(spec: RunSpec) -> list[str]:
    """data.mixture: the weights, what a mixture cannot do yet, and each source checked as
    a run of it alone would be (its problems prefixed with the source)."""
    d, p = spec.data, []
    _positive(p, d.mixture_seed, "data.mixture_seed", allow_zero=True)
    if d.mixture is None:
        return p
    if not d.mixture:
        return [*p, "data.mixture is an empty list: give its sources, or set data.mixture=null."]
    beside = [f"data.{key}" for key in SINGLE_SOURCE if getattr(d, key)]
    if beside:
        p.append(f"data.mixture names the sources; {', '.join(beside)} would be one more: set "
                 f"{' '.join(f'{key}=null' for key in beside)} (or make it a source of the mixture).")
    names = source_names(d)
    weights = [float(source.weight) for source in d.mixture]
    for name, weight in zip(names, weights):
        if not math.isfinite(weight) or weight < 0:
            p.append(f"data.mixture: source {name} has weight {weight}: a weight is a finite number >= 0.")
    if all(weight == 0 for weight in weights):
        p.append("data.mixture: every weight is 0, so nothing could be sampled: give a source a weight > 0.")
    sources = source_specs(d)
    formats = {source.format for source in sources}
    for alone, what in ((DataFormat.preference, "preference pairs train a preference objective"),
                        (DataFormat.prompts, "prompts train online RL (objective=grpo)")):
        if alone in formats and len(formats) > 1:
            p.append(f"data.mixture: {what} and mix with nothing else; these sources are "
                     f"{', '.join(sorted(f.value for f in formats))}. Make every source format={alone.value}, or "
                     "leave them out.")
    for name, source in zip(names, sources):
        if source.format is DataFormat.text and row_format(d) is not DataFormat.text:
            # the instruction settings are the instruction sources'; its blocks train whole
            source = replace(source, packing=False, train_on_prompt=False, too_long=DataSpec().too_long)
        alone = replace(spec, data=source)
        p += [f"data.mixture: source {name}: {problem}" for problem in check_data_source(alone) + check_format(alone)]
    return p


def check_data_source(spec: RunSpec) -> list[str]:
    """Where the data comes from, as the fields say (the files themselves: launch/preflight.py)."""
    d = spec.data
    if d.mixture is not None:
        return []  # check_mixture checks each source
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
    defaults = DataSpec()
    for key, value in (("train_split", d.train_split), ("validation_split", d.validation_split)):
        if not d.dataset_name and value != getattr(defaults, key):
            problems.append(f"data.{key}={value} names a hub dataset's split, but data.dataset_name is not set: "
                            "data.train_file is the training data, and data.validation_file (else "
                            f"data.validation_split_percentage of it) the validation data. Remove data.{key}.")
    if d.text_column is not None and any(str(f).endswith((".txt", ".txt.gz")) for f in (d.train_file, d.validation_file) if f):
        problems.append(f"data.text_column={d.text_column}: a .txt file has one column, `text`; data.text_column "
                        "is for .json/.jsonl/.csv files. Set data.text_column=null.")
    return problems


def check_streaming(spec: RunSpec) -> list[str]:
    """What a stream (data.streaming=true) needs, and the cached path's settings it cannot honour."""
    d, p = spec.data, []
    _positive(p, d.validation_blocks, "data.validation_blocks")
    _positive(p, d.shuffle_buffer, "data.shuffle_buffer", allow_zero=True)
    if not d.streaming:
        if d.validation_blocks is not None:
            p.append(f"data.validation_blocks={d.validation_blocks} is for data.streaming=true; the cached path holds out "
                     "data.validation_split_percentage. Set data.validation_blocks=null, or data.streaming=true.")
        return p
    if spec.train.max_steps is None:
        p.append("data.streaming=true reads a stream of unknown length, so train.num_epochs cannot be turned into "
                 "steps: set train.max_steps=N.")
    if d.preprocessing_num_workers is not None:
        p.append("data.preprocessing_num_workers is for the cached path; a stream tokenizes on the fly in its "
                 "loader. Set data.preprocessing_num_workers=null (train.dataloader_num_workers moves the "
                 "tokenizing off the training process).")
    return p


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
    _positive(problems, launch.mtbf_hours, "launch.mtbf_hours")  # None (no suggestion) passes
    if not 0 <= launch.node_rank < max(launch.nnodes, 1):
        problems.append(f"launch.node_rank={launch.node_rank} must be in 0..launch.nnodes-1.")
    if launch.engine is LaunchEngine.ray:
        problems += _ray_launch_problems(launch)
    elif launch.ray_address != "auto":
        problems.append(f"launch.ray_address={launch.ray_address} is read only under launch.engine=ray: add "
                        "launch.engine=ray, or remove launch.ray_address.")
    if launch.nnodes > 1 and not launch.rdzv_endpoint and launch.engine is not LaunchEngine.ray:
        problems.append("launch.nnodes>1 needs launch.rdzv_endpoint=HOST:PORT (node 0's address), the same on every node.")
    if launch.rdzv_endpoint is not None and host_port(launch.rdzv_endpoint) is None:
        problems.append(f"launch.rdzv_endpoint={launch.rdzv_endpoint} must be HOST:PORT, e.g. 10.0.0.1:29500.")
    return problems


def host_port(address: str) -> Optional[tuple[str, int]]:
    """A HOST:PORT address as (host, port), the port in 1..65535; None when it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _ray_launch_problems(launch: LaunchSpec) -> list[str]:
    """launch.engine=ray: Ray places every worker itself, so the torch rendezvous's per-node
    settings would be ignored (each node started with its own command would start a run
    of its own); they are refused instead."""
    problems = []
    if launch.node_rank != 0 or launch.rdzv_endpoint is not None:
        problems.append(
            "launch.engine=ray places the workers itself (launch.nnodes x launch.nproc_per_node of them, on the "
            "cluster's nodes): run the command once, on one machine, without launch.node_rank and "
            "launch.rdzv_endpoint (those are the torch rendezvous's, launch.engine=local).")
    address = launch.ray_address
    if address != "auto" and host_port(address.removeprefix("ray://")) is None:
        problems.append(f"launch.ray_address={address} must be auto, HOST:PORT or ray://HOST:PORT (the Ray head's "
                        "address, as `ray start --head` prints it), e.g. launch.ray_address=10.0.0.1:6379.")
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
    return p


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


def check_fsdp_world_size(spec: RunSpec, world_size: Optional[int]) -> list[str]:
    """FSDP shards over a process group: at one process Accelerate builds none, and
    FSDP2 would not engage (runner never falls back silently)."""
    if spec.strategy.kind is StrategyKind.fsdp and world_size == 1:
        return ["strategy=fsdp shards the model over 2 or more processes; this run has 1. Set "
                "launch.nproc_per_node=2 (or more), or use strategy=ddp for one process."]
    return []


def check_format(spec: RunSpec) -> list[str]:
    """Instruction formats' settings, and what they cannot do yet."""
    d, p = spec.data, []
    if d.mixture is not None:
        return []  # check_mixture checks each source
    if d.format is DataFormat.text:
        defaults = DataSpec()
        set_here = [k for k, v in (("data.packing", d.packing), ("data.train_on_prompt", d.train_on_prompt),
                                   ("data.chat_template", d.chat_template),
                                   ("data.prompt_field", d.prompt_field != defaults.prompt_field),
                                   ("data.completion_field", d.completion_field != defaults.completion_field),
                                   ("data.messages_field", d.messages_field != defaults.messages_field),
                                   ("data.chosen_field", d.chosen_field != defaults.chosen_field),
                                   ("data.rejected_field", d.rejected_field != defaults.rejected_field),
                                   ("data.too_long", d.too_long is not defaults.too_long)) if v]
        if set_here:
            p.append(f"{', '.join(set_here)} set with data.format=text (run_clm's raw text, grouped into blocks): "
                     "set data.format=prompt_completion, chat or preference, or remove them.")
        return p
    if d.chat_template and d.format not in (DataFormat.chat, DataFormat.preference):
        p.append(f"data.chat_template is for data.format=chat or preference, not {d.format.value}: set "
                 "data.chat_template=null.")
    # run_clm's settings that an instruction format has no use for: refused, not ignored
    # (data.preprocessing_num_workers is honoured: the records' tokenization runs on that many)
    if d.text_column is not None:
        fields = {DataFormat.prompt_completion: "data.prompt_field and data.completion_field",
                  DataFormat.chat: "data.messages_field",
                  DataFormat.preference: "data.prompt_field, data.chosen_field and data.rejected_field"}[d.format]
        p.append(f"data.text_column={d.text_column} is for data.format=text; data.format={d.format.value} reads "
                 f"{fields}. Set data.text_column=null (and name the records' fields there).")
    if d.keep_linebreaks is not DataSpec().keep_linebreaks:
        p.append(f"data.keep_linebreaks={str(d.keep_linebreaks).lower()} is for .txt files (data.format=text); "
                 f"data.format={d.format.value} reads JSON records, whose text keeps its line breaks. Remove the "
                 "override.")
    if d.streaming:
        p.append(f"data.format={d.format.value} reads its examples into the cache; data.streaming=true is for "
                 "data.format=text so far. Set data.streaming=false.")
    json_files = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
    others = [f for f in (d.train_file, d.validation_file) if f and not str(f).endswith(json_files)]
    if others:
        p.append(f"data.format={d.format.value} reads .json or .jsonl records (optionally .gz); {others[0]} is not "
                 "one. Convert it, or set data.format=text.")
    return p


def check_peft(spec: RunSpec) -> list[str]:
    """Adapters need a pretrained base, sane sizes, and settings that do something."""
    pe, p = spec.peft, []
    # also under peft=none: a bad value is refused, not ignored
    if isinstance(pe.rank, bool) or pe.rank < 1:
        p.append(f"peft.rank={pe.rank} must be a whole number >= 1 (8 or 16 are usual).")
    if not pe.alpha > 0:
        p.append(f"peft.alpha={pe.alpha} must be > 0 (the update is scaled by alpha / rank; 2 x rank is usual).")
    if not 0.0 <= pe.dropout < 1.0:
        p.append(f"peft.dropout={pe.dropout} must be in [0, 1).")
    if pe.kind is PeftKind.none:
        set_here = [k for k, v in (("peft.target_modules", pe.target_modules), ("peft.modules_to_save", pe.modules_to_save),
                                   ("peft.save_merged", pe.save_merged)) if v]
        if set_here:
            p.append(f"{', '.join(set_here)} set without adapters (peft=none trains every weight): add peft=lora "
                     "(or peft=dora), or remove them.")
        return p
    if not spec.model.name_or_path:
        p.append(f"peft={pe.kind.value} fine-tunes a pretrained model, but model.name_or_path is null (a model built "
                 "from scratch: random weights, and adapters on a random base learn nothing useful). Set "
                 "model.name_or_path=<a hub id or a saved model folder, e.g. a run's model/>, or peft=none.")
    if pe.target_modules is not None and not pe.target_modules:
        p.append("peft.target_modules=[] adapts nothing: name layers (e.g. [q_proj,v_proj]) or set "
                 "peft.target_modules=null (every linear layer of the blocks).")
    return p


def parity_baseline_problems(setting: Optional[str]) -> list[str]:
    """What is wrong with the form of `sweep.parity_baseline` (which job it names is known
    only when the sweep ends)."""
    if setting is None or setting.strip().isdigit():
        return []
    tokens = setting.split()
    if not tokens or not all("=" in t and not t.startswith("=") for t in tokens):
        return [f"sweep.parity_baseline='{setting}' must be a job index (0, 1, ...) or overrides of one job, "
                "e.g. 'sweep.parity_baseline=\"strategy=ddp\"'."]
    return []


def check_sweep(spec: RunSpec) -> list[str]:
    return parity_baseline_problems(spec.sweep.parity_baseline)


REFERENCE_FREE = (PreferenceLoss.simpo, PreferenceLoss.orpo)


def reference_mode(spec: RunSpec) -> ReferenceMode:
    """preference.reference as the run uses it (null: none for a reference-free loss;
    adapter_off with peft, the base model under the adapters; else precomputed, which
    holds no second copy of the model under any strategy)."""
    pref = spec.preference
    if pref.reference is not None:
        return pref.reference
    if pref.loss_type in REFERENCE_FREE:
        return ReferenceMode.none
    return ReferenceMode.adapter_off if spec.peft.kind is not PeftKind.none else ReferenceMode.precomputed


def check_preference(spec: RunSpec) -> list[str]:
    """train.objective=dpo and data.format=preference go together; the loss's settings."""
    pref, p = spec.preference, []
    dpo, pairs = spec.train.objective is ObjectiveKind.dpo, row_format(spec.data) is DataFormat.preference
    if dpo != pairs:
        p.append("train.objective=dpo trains on data.format=preference (a prompt, a chosen and a rejected answer), "
                 "and only it does: use objective=dpo with preference data, or neither." if dpo else
                 "data.format=preference is trained by train.objective=dpo: add objective=dpo.")
    _positive(p, pref.beta, "preference.beta")
    _positive(p, pref.gamma, "preference.gamma", allow_zero=True)
    if not 0.0 <= pref.label_smoothing < 0.5:
        p.append(f"preference.label_smoothing={pref.label_smoothing} must be in [0, 0.5) (the share of pairs "
                 "assumed mislabelled).")
    elif pref.label_smoothing and pref.loss_type not in (PreferenceLoss.sigmoid, PreferenceLoss.simpo):
        p.append(f"preference.label_smoothing is for loss_type=sigmoid or simpo, not {pref.loss_type.value}: set "
                 "preference.label_smoothing=0.")
    defaults = PreferenceSpec()
    if pref.gamma != defaults.gamma and pref.loss_type is not PreferenceLoss.simpo:
        p.append(f"preference.gamma is SimPO's margin, not {pref.loss_type.value}'s: set preference.loss_type=simpo "
                 "or remove preference.gamma.")
    mode = reference_mode(spec)
    if pref.loss_type in REFERENCE_FREE and mode is not ReferenceMode.none:
        p.append(f"preference.loss_type={pref.loss_type.value} is reference-free: set preference.reference=none "
                 "(or null).")
    if pref.loss_type not in REFERENCE_FREE and mode is ReferenceMode.none:
        p.append(f"preference.loss_type={pref.loss_type.value} compares against a reference model: set "
                 "preference.reference=frozen, precomputed or (with peft) adapter_off.")
    if mode is ReferenceMode.adapter_off and spec.peft.kind is PeftKind.none:
        p.append("preference.reference=adapter_off is the model with its adapters disabled, and this run has none: "
                 "set peft=lora (or dora), or preference.reference=frozen or precomputed.")
    if not dpo and pref != defaults:
        p.append("preference.* is set but train.objective is not dpo: add objective=dpo, or remove them.")
    return p


EVAL_DTYPES = ("auto", "float32", "bfloat16", "float16")
EVAL_DEVICE = re.compile(r"(cpu|mps|(cuda|xpu|npu)(:\d+)?)")


def check_eval(spec: RunSpec) -> list[str]:
    """eval.*'s own values, whether or not eval.tasks names any (the tasks themselves are
    looked up where lm-eval is: runner/report/benchmarks.py)."""
    wanted, p = spec.eval, []
    _positive(p, wanted.batch_size, "eval.batch_size")
    _positive(p, wanted.limit, "eval.limit")
    _positive(p, wanted.num_fewshot, "eval.num_fewshot", allow_zero=True)
    if wanted.dtype not in EVAL_DTYPES:
        p.append(f"eval.dtype={wanted.dtype}: choose one of {', '.join(EVAL_DTYPES)}.")
    if wanted.device is not None and not EVAL_DEVICE.fullmatch(wanted.device):
        p.append(f"eval.device={wanted.device}: give cpu, cuda, cuda:N (or null: the first GPU when one is visible).")
    return p


CHECKS: tuple[Callable[[RunSpec], list[str]], ...] = (
    check_names, check_numbers, check_launch, check_strategy, check_zero_save, check_mixture, check_data_source, check_streaming,
    check_format, check_preference, check_peft, check_sweep, check_eval,
)


def spec_problems(spec: RunSpec, world_size: Optional[int] = 1) -> list[str]:
    """Every problem the spec's own fields show, each naming its fix. world_size None:
    launch.* is invalid, so the world size (and the batch arithmetic at it) is unknown."""
    problems: list[str] = accumulation_for(spec.train, world_size)[1] if world_size is not None else []
    problems += check_fsdp_world_size(spec, world_size)
    problems += check_rl(spec, world_size)
    for check in CHECKS:
        problems += check(spec)
    return problems
