"""Per-rank entry: read the frozen spec, set up in named steps, train, save, close.

Workers never run Hydra: the launcher composed and validated the spec once and
wrote it to run_spec.yaml; every rank reads that same file.

The setup's order is load-bearing, and `train` spells it out:
1. host memory policy     before the model and the first batch are allocated
2. model                  seeded, before the Accelerator: under ZeRO-3 a model built
                          afterwards is initialised inside the engine and differs from DDP's
3. accelerator            from the strategy object (runner/distributed/strategy.py)
4. data and loaders       tokenized once per machine, its local rank 0 first (runner/train/loaders.py)
5. prepare                optimizer, accelerator.prepare, the strategy's own fix-ups, and
                          the check that what is engaged is what the spec asked for
6. plan and trainer       the step count, schedule, banner
7. random state           re-seeded for the loop, then a checkpoint's restored over it:
                          last, so nothing setup drew moves dropout's stream (runner/train/restore.py)
Then the loop (runner/train/trainer.py) and the end: the ranks agree, model/ and the
results are written, the ranks leave together (runner/train/finish.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator

from runner.components.activations import activation_note
from runner.components.adapters import add_adapters, uses_adapters
from runner.components.chunked_loss import ChunkedLoss
from runner.components.chunked_loss import install as install_chunked_loss
from runner.components.compile import compile_layers
from runner.components.data.epoch_batches import EpochSampler
from runner.components.data.instruct import check_packing
from runner.components.data.prepare import resolve_block_size
from runner.components.data.stream import BadRecord, BlockStream, StreamedData
from runner.components.liger_loss import gpu_present
from runner.components.model import (
    count_parameters,
    count_trainable_parameters,
    disable_dropout,
    layer_class_names,
    layer_parameters,
    max_positions,
    starting_model,
)
from runner.components.objectives import build_objective, objective_class
from runner.components.objectives.base import ObjectiveSetup
from runner.components.objectives.frozen import frozen_reference
from runner.components.objectives.reference import build_reference
from runner.components.optim import build_optimizer, build_scheduler, effective_lr
from runner.config.batch import accumulation_at, global_batch
from runner.config.errors import USAGE_EXIT_CODE, TrainingStopped
from runner.config.mixture import row_format, source_names
from runner.config.spec import DataFormat, ObjectiveKind, RunSpec, flat_spec_dict, load_spec, spec_to_yaml
from runner.distributed.accelerator import build_accelerator, describe, skip_output_upcast, unwrap
from runner.distributed.engagement import check_engaged
from runner.distributed.process_group import agree_on_spec, init_process_group
from runner.distributed.strategies import build_strategy
from runner.distributed.strategy import Strategy
from runner.distributed.world import planned_world_size
from runner.report.flops import expert_parameters, model_flops_per_token, peak_flops
from runner.report.log import setup_logging
from runner.report.metrics import current_memory_mb, reset_peak_memory
from runner.train.checkpoint import latest_checkpoint
from runner.train.determinism import use_deterministic_kernels
from runner.train.finish import close, finish, memory_per_rank
from runner.train.host_memory import release_freed_memory, retain_freed_memory, return_freed_memory
from runner.train.ledger import Ledger, resumed
from runner.train.loaders import Loaders, data_record, load_data, make_loaders
from runner.train.parts import Engine, LoopSettings, TrainData
from runner.train.plan import RunPlan, banner, plan_run
from runner.train.restore import restore_random_state
from runner.train.rl_setup import completions_writer, rl_reference, rollout_parts
from runner.train.signals import EXIT_CODES, Stopped
from runner.train.trainer import NonFiniteLoss, NoStepInPass, Trainer

# train.per_device_batch_size=auto's probe run writes its ranks' memory here (runner/launch/auto_batch.py).
PROBE_FILENAME = "probe_memory.json"

log = logging.getLogger("runner")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than launch.timeout_minutes."""


@dataclass
class Built:
    """What setup step 2 builds before the Accelerator exists."""

    tokenizer: Any
    config: Any
    model: torch.nn.Module
    chunked: Optional[ChunkedLoss] = None  # the head and loss over chunks of tokens (model.chunked_loss)
    loss_note: str = ""  # how the loss is computed, for the banner
    activation_note: str = ""  # the activations model.fused_activations swapped, for the banner


def run(spec: Optional[RunSpec], launched: Optional[float] = None) -> dict[str, Any]:
    """Join the process group (if any), agree on rank 0's spec, train. `launched`: when the
    launch began (runner/launch/start.py), where the goodput ledger's wall time starts; a run
    handed to workers in turn (runner certify) or joined from an outside launch starts it here."""
    launched = time.time() if launched is None else launched
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Before the spec is known (a joined follower) the default timeout applies.
        init_process_group(spec.launch.timeout_minutes if spec is not None else 30.0)
        spec = agree_on_spec(spec)
    assert spec is not None, "a single process always has its spec"
    if spec.launch.min_workers is not None:  # Ray's elastic range: this group's size, the global batch kept
        spec.train.grad_accum_steps = accumulation_at(spec.train, planned_world_size(spec.launch))
    return train(spec, launched)


def main(spec_path: str, launched: Optional[float] = None) -> None:
    """Entry for a spawned worker process."""
    # torch.distributed's deprecation notices, once per collective per rank, bury the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    run(load_spec(Path(spec_path)), launched)


def train(spec: RunSpec, launched: Optional[float] = None) -> dict[str, Any]:
    """Set up in named steps, train, finish. `launched`: the launch's start (None: now)."""
    run_dir = Path(spec.run_dir)
    ledger = resumed(run_dir, time.time() if launched is None else launched, 0)  # a restart carries it on
    use_deterministic_kernels(spec.train.deterministic)  # 1, before anything touches CUDA
    set_host_memory_policy(spec)  # 1
    # This run's own peak, also as the next job of an in-process sweep: what an earlier
    # job freed goes back to the OS first, so it is not counted again.
    release_freed_memory()
    reset_peak_memory()
    # What the process holds before any model state exists (interpreter, libraries):
    # peak memory above it is what training adds (bench/strategy_memory.py reads it).
    before_model_mb = current_memory_mb(None)
    built = build_seeded_model(spec)  # 2
    strategy = build_strategy(spec.strategy, spec.precision)
    accelerator = make_accelerator(spec, strategy, built, run_dir)  # 3
    setup_logging(run_dir, accelerator.is_main_process, accelerator.process_index)
    block_size = resolve_block_size(spec.data, max_positions(built.config), built.tokenizer.model_max_length)
    data = load_data(spec, accelerator, built.tokenizer, block_size)  # 4
    grpo = spec.train.objective.online_rl
    rollouts = None
    if grpo:  # online RL: the loader hands out slots of the rollouts' stream (runner/train/rl_setup.py)
        loaders, rollouts = rollout_parts(spec, accelerator, built.tokenizer, data)
        block_size = rollouts.row_length  # the rows it trains: the plan's tokens and the FLOPs per token
    else:
        loaders = make_loaders(spec, data, accelerator.num_processes)
    model, optimizer, train_loader, eval_loader, optimizer_in_use = prepare_for_training(  # 5
        spec, strategy, accelerator, built.model, loaders)
    if spec.data.packing:  # on the prepared model, every rank: a sharded forward is collective
        check_packing(model, len(built.tokenizer), spec.precision.kind.value,
                      f"{built.config.model_type} model (attn_implementation="
                      f"{getattr(built.config, '_attn_implementation', None) or 'default'})")
        strategy.after_evaluation(model)  # ZeRO-3: release what the probe's forwards gathered
    streamed = isinstance(data, StreamedData)
    plan = plan_run(
        spec, accelerator.num_processes,
        batches_per_rank=0 if streamed else len(train_loader), block_size=block_size,
        train_blocks=0 if streamed else (len(loaders.sampler) if grpo else len(data.train)), eval_blocks=len(data.validation),
        parameters=count_parameters(unwrap(accelerator, model)),
        trainable_parameters=count_trainable_parameters(unwrap(accelerator, model)),
        precision=f"{spec.precision.kind.value} (Accelerate mixed_precision={accelerator.mixed_precision})",
        device=describe(accelerator)["device"],
        stream=data.source if streamed else "",
    )
    # A preference objective's reference, while the model still holds the starting weights
    started = time.time()
    frozen = partial(frozen_reference, spec, strategy, accelerator, built.chunked is not None)  # its own copy
    reference = None if streamed else build_reference(spec, model, unwrap(accelerator, model), accelerator, data, run_dir,
                                                      built.chunked, frozen)
    if grpo:
        reference = rl_reference(spec, frozen)
    elif reference is not None and reference.scored:
        ledger.add("reference", time.time() - started)
    trainer = make_trainer(spec, strategy, accelerator, model, optimizer, train_loader, eval_loader,  # 6
                           loaders.sampler, plan, built, block_size, run_dir, optimizer_in_use,
                           data_record(spec, data), ledger, reference, rollouts)
    if rollouts is not None and accelerator.is_main_process:
        trainer.objective.on_generation = completions_writer(run_dir, rollouts)  # type: ignore[attr-defined]
    recorded = restore_random_state(spec, accelerator, trainer, run_dir, built.config)  # 7
    if spec.tracking.value != "none":
        accelerator.init_trackers(spec.name, config=tracker_hparams(spec), init_kwargs=tracker_kwargs(trainer.state.step))
    train_results, eval_results = fit(spec, accelerator, trainer, run_dir)
    if spec.probe:  # train.per_device_batch_size=auto's probe: its memory is all it leaves
        peaks, befores = memory_per_rank(accelerator, before_model_mb)
        if accelerator.is_main_process:
            (run_dir / PROBE_FILENAME).write_text(json.dumps(
                {"peak_memory_mb_per_rank": peaks, "host_memory_before_model_mb_per_rank": befores,
                 "device": accelerator.device.type}))
        close(accelerator)
        return {}
    return finish(spec, strategy, accelerator, trainer, model, built.tokenizer, data, run_dir, before_model_mb,
                  train_results, eval_results, recorded)


# ---------------------------------------------------------------------- setup steps
def set_host_memory_policy(spec: RunSpec) -> None:
    if spec.launch.retain_freed_memory:
        retain_freed_memory()
    else:
        return_freed_memory()


def build_seeded_model(spec: RunSpec) -> Built:
    """The model, and with peft=lora|dora its adapters (their init is random too, so
    after the seed)."""
    tokenizer, config, model = starting_model(spec.model, spec.train.seed)
    if uses_adapters(spec.peft):
        model = add_adapters(spec.peft, model, spec.model.gradient_checkpointing)
    if (spec.train.objective is ObjectiveKind.dpo and spec.preference.disable_dropout) or (
            spec.train.objective.online_rl and spec.rl.disable_dropout):
        disable_dropout(model)  # TRL's default: the policy's, the adapters' included
    objective = objective_class(spec.train.objective)
    chunked, why_not = (install_chunked_loss(model, gpu_kernel=True) if spec.model.chunked_loss
                        and objective.chunked_head
                        else (None, "model.chunked_loss=false" if not spec.model.chunked_loss else
                              f"train.objective={spec.train.objective.value} scores each sequence from the whole logits"))
    if chunked is not None:
        kernel = objective.chunked_head_kernel or chunked.kernel
        note = f"output head and loss by {kernel} (model.chunked_loss): the whole logits are never held"
        if chunked.state.fused is None and gpu_present() and objective.chunked_head_kernel is None:
            note += '; pip install "runner[liger]" for Liger\'s fused kernel'
    else:
        note = f"plain (the whole logits at once): {why_not}"
    return Built(tokenizer, config, model, chunked, note, activation_note(config, model))


def make_accelerator(spec: RunSpec, strategy: Strategy, built: Built, run_dir: Path) -> Accelerator:
    config = built.config
    return build_accelerator(
        strategy, spec.train.grad_accum_steps, spec.optim.max_grad_norm,
        timeout_minutes=spec.launch.timeout_minutes,
        tracking=spec.tracking.value, logging_dir=str(run_dir / "tensorboard"),
        per_device_batch_size=spec.train.per_device_batch_size, model_type=config.model_type,
        hidden_size=getattr(config, "hidden_size", None),  # GPT-2's n_embd, by transformers' attribute map
        layer_parameters=layer_parameters(built.model),  # ZeRO-3's prefetch on a GPU
        layer_classes=layer_class_names(built.model),  # what FSDP2 wraps
    )


def prepare_for_training(spec: RunSpec, strategy: Strategy, accelerator: Accelerator, model: torch.nn.Module,
            loaders: Loaders) -> tuple[Any, Any, Any, Any, str]:
    """(model, optimizer, train loader, eval loader, the optimizer in use), prepared and checked."""
    lr = effective_lr(spec.optim, global_batch(spec.train, accelerator.num_processes))
    optimizer = build_optimizer(spec.optim, model, lr)
    strategy.before_prepare(model, accelerator)
    if spec.model.compile:  # each layer, in place, before any strategy wraps them
        compile_layers(model, layer_class_names(model))
    if isinstance(loaders.sampler, BlockStream):  # a stream's loader is this rank's own (make_loaders)
        model, optimizer, eval_loader = accelerator.prepare(model, optimizer, loaders.evaluation)
        train_loader = loaders.train
    else:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, loaders.train, loaders.evaluation)
    strategy.after_prepare(accelerator, model)
    skip_output_upcast(accelerator, model)  # the loss is computed in the model, in fp32
    in_use = check_engaged(accelerator, model, optimizer, spec, planned_world_size(spec.launch), strategy)
    return model, optimizer, train_loader, eval_loader, in_use


def make_trainer(spec: RunSpec, strategy: Strategy, accelerator: Accelerator, model: Any, optimizer: Any,
                 train_loader: Any, eval_loader: Any, sampler: EpochSampler | BlockStream, plan: RunPlan, built: Built,
                 block_size: int, run_dir: Path, optimizer_in_use: str, data_record: dict[str, Any],
                 ledger: Ledger, reference: Any = None, rollouts: Any = None) -> Trainer:
    t, config = spec.train, built.config
    scheduler = build_scheduler(spec.schedule, optimizer, plan.total_steps)
    if accelerator.is_main_process:
        lines = [banner(plan, str(run_dir)), f"  optimizer      {optimizer_in_use}", f"  loss           {built.loss_note}"]
        if built.activation_note:
            lines.append(f"  activations    {built.activation_note}")
        if spec.model.compile:
            lines.append(f"  compile        {strategy.compile_note()}")
        lines += [f"  note           {note}" for note in strategy.notes(spec.optim.fused)]  # as in run_spec.yaml
        log.info("\n".join(lines))
    accelerator.register_for_checkpointing(scheduler)  # not prepared (see runner/components/optim.py), so saved explicitly
    device_peak = peak_flops(accelerator.device, spec.precision.kind.value)
    if device_peak is None and accelerator.is_main_process:
        log.warning(f"MFU: unknown ({torch.cuda.get_device_name(accelerator.device)} is not in runner/report/flops.py's peak table)")
    objective = build_objective(spec.train.objective, ObjectiveSetup(
        accelerator.unwrap_model(model), accelerator.num_processes, plan.grad_accum_steps, built.chunked,
        spec.model.compile, preference=spec.preference, reference=reference, rollouts=rollouts))
    return Trainer(
        Engine(accelerator, model, optimizer, scheduler, strategy),
        TrainData(train_loader, eval_loader, sampler, stream=isinstance(sampler, BlockStream), record=data_record,
                  counts_real_tokens=row_format(spec.data) is not DataFormat.text,
                  sources=tuple(source_names(spec.data))),
        plan, objective,
        LoopSettings(
            run_dir, max_grad_norm=spec.optim.max_grad_norm, log_every=t.log_every, eval_every=t.eval_every,
            save_every=t.save_every, keep_checkpoints=t.keep_checkpoints, spec_yaml=spec_to_yaml(spec),
            max_consecutive_skipped_steps=spec.precision.max_consecutive_skipped_steps,
            flops_per_token=model_flops_per_token(config, plan.parameters, block_size,
                                                  expert_parameters(unwrap(accelerator, model)), plan.trainable),
            peak_flops=device_peak * accelerator.num_processes if device_peak else 0.0,  # 0: MFU unknown
            compiled=spec.model.compile),
        ledger=ledger,
    )


# ---------------------------------------------------------------------- the run
def fit(spec: RunSpec, accelerator: Accelerator, trainer: Trainer, run_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """The training loop, with its ways to stop turned into exit codes and messages."""
    try:
        return trainer.fit()
    except Stopped as stop:
        log.warning(
            f"runner: {stop}. Resume with: runner --spec {run_dir / 'run_spec.yaml'} --run-dir {run_dir} --resume auto"
        )
        raise SystemExit(EXIT_CODES.get(stop.signum, 1)) from None
    except NonFiniteLoss as err:
        log.error(f"runner: {err}")
        raise TrainingStopped(3, str(err)) from None
    except NoStepInPass as err:  # the data changed since the launcher's check
        log.error(f"runner: error: {err}")
        raise TrainingStopped(USAGE_EXIT_CODE, str(err)) from None
    except BadRecord as err:  # a stream's record; the last checkpoint is untouched
        last = trainer.last_checkpoint or latest_checkpoint(run_dir)
        log.error(f"runner: error: {err.line} (the last checkpoint, {last or 'none yet'}, is intact)")
        raise TrainingStopped(USAGE_EXIT_CODE, err.line) from None
    except Exception as err:
        if _is_timeout(err):
            raise CollectiveTimeout(
                f"rank {accelerator.process_index} waited more than launch.timeout_minutes={spec.launch.timeout_minutes:g} "
                "for the other ranks in a collective: a rank is stuck or died. See docs/resume-and-faults.md, 'When a run "
                "hangs' (launch.debug=true shows every rank's collectives; raise launch.timeout_minutes if one step "
                "is legitimately that slow)."
            ) from err
        raise


# ---------------------------------------------------------------------- helpers
def _is_timeout(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return "timed out" in text or "timeout" in text or type(err).__name__ == "DistBackendError" and "wait" in text


def tracker_hparams(spec: RunSpec) -> dict[str, Any]:
    """The spec, flattened to the scalar values trackers accept as hyperparameters."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat_spec_dict(spec).items()}


def tracker_kwargs(start_step: int) -> dict[str, dict[str, Any]]:
    """Per-tracker settings for a run that starts at `start_step` (0, or a checkpoint's step).

    TensorBoard keeps every event ever written to the run's folder: the steps an attempt
    logged after its last checkpoint would show twice, the dead attempt's and the resumed
    one's. `purge_step` makes TensorBoard drop earlier events from the first step this
    run logs on, as metrics.jsonl is cut back (runner/train/restore.py, truncate_metrics).
    """
    return {"tensorboard": {"purge_step": start_step + 1}}


