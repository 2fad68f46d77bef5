"""Per-rank entry: read the frozen spec, set up in named steps, train, save, close.

Workers never run Hydra: the launcher composed and validated the spec once and
wrote it to run_spec.yaml; every rank reads that same file.

The setup's order is load-bearing, and `train` spells it out:
1. host memory policy     before the model and the first batch are allocated
2. model                  seeded, before the Accelerator: under ZeRO-3 a model built
                          afterwards is initialised inside the engine and differs from DDP's
3. accelerator            from the strategy object (runner/distributed/strategy.py)
4. data and loaders       tokenized once per machine, its local rank 0 first
5. prepare                optimizer, accelerator.prepare, the strategy's own fix-ups, and
                          the check that what is engaged is what the spec asked for
6. plan and trainer       the step count, schedule, banner
7. random state           re-seeded for the loop, then a checkpoint's restored over it:
                          last, so nothing setup drew moves dropout's stream (runner/train/rng.py)
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from runner.components.adapters import ADAPTER_DIRNAME, adapter_dropout, add_adapters, uses_adapters
from runner.components.chunked_loss import ChunkedLoss
from runner.components.compile import compile_layers
from runner.components.chunked_loss import install as install_chunked_loss
from runner.components.liger_loss import gpu_present
from runner.components.instruct import check_packing
from runner.components.data import EpochSampler, PreparedData, collate, collate_for, resolve_block_size
from runner.components.epoch_batches import EpochBatches, WithFillers, masking_fillers
from runner.components.data import prepare as prepare_data
from runner.components.stream import BadRecord, BlockStream, StreamedData, open_stream, training_files
from runner.components.objectives import build_objective
from runner.components.objectives.base import ObjectiveSetup
from runner.components.model import (
    active_dropout,
    build_config,
    build_model,
    build_tokenizer,
    count_parameters,
    count_trainable_parameters,
    layer_class_names,
    layer_parameters,
    max_positions,
)
from runner.components.optim import build_optimizer, build_scheduler, effective_lr, follow_plan
from runner.config.batch import global_batch
from runner.config.errors import USAGE_EXIT_CODE, TrainingStopped
from runner.config.spec import SPEC_FILENAME, DataFormat, RunSpec, flat_spec_dict, load_spec, spec_to_yaml
from runner.distributed.accelerator import build_accelerator, describe, skip_output_upcast, unwrap
from runner.distributed.engagement import check_engaged, check_in_sync, rank_fingerprints
from runner.distributed.process_group import agree_on_spec, init_process_group
from runner.distributed.strategies import build_strategy
from runner.distributed.strategy import Strategy
from runner.distributed.world import planned_world_size
from runner.report.flops import expert_parameters, model_flops_per_token, peak_flops
from runner.report.log import setup_logging
from runner.report.metrics import current_memory_mb, peak_memory_mb, reset_peak_memory, summary_table, write_results
from runner.report.plots import PLOT_FILENAME, plot_loss_curves
from runner.train.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, read_marker
from runner.train.determinism import use_deterministic_kernels
from runner.train.host_memory import release_freed_memory, retain_freed_memory, return_freed_memory
from runner.train.plan import RunPlan, banner, plan_run
from runner.train.ledger import LAUNCH_TIME_ENV, stamp_launch
from runner.train.ledger import report as ledger_report
from runner.train.reshard import load_across, needs_reshard
from runner.train.resume import Recorded, recorded_at_end, resolve
from runner.train.rng import loader_generator, seed_training_stream
from runner.train.signals import EXIT_CODES, Stopped
from runner.train.parts import Engine, LoopSettings, TrainData
from runner.train.trainer import NoStepInPass, NonFiniteLoss, Trainer

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


@dataclass
class Loaders:
    train: DataLoader
    evaluation: DataLoader
    sampler: EpochSampler | BlockStream  # the trainer sets its epoch


def run(spec: Optional[RunSpec]) -> dict[str, Any]:
    """Join the process group (if any), agree on rank 0's spec, train."""
    # The ledger's wall time starts with the launch; a run handed to workers in turn
    # (runner certify) or joined from an outside launch starts it here, for itself.
    owned = LAUNCH_TIME_ENV not in os.environ
    if owned:
        stamp_launch()
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Before the spec is known (a joined follower) the default timeout applies.
            init_process_group(spec.launch.timeout_minutes if spec is not None else 30.0)
            spec = agree_on_spec(spec)
        assert spec is not None, "a single process always has its spec"
        return train(spec)
    finally:
        if owned:
            os.environ.pop(LAUNCH_TIME_ENV, None)


def main(spec_path: str) -> None:
    """Entry for a spawned worker process."""
    # torch.distributed's deprecation notices, once per collective per rank, bury the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    run(load_spec(Path(spec_path)))


def train(spec: RunSpec) -> dict[str, Any]:
    run_dir = Path(spec.run_dir)
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
        train_blocks=0 if streamed else len(data.train), eval_blocks=len(data.validation),
        parameters=count_parameters(unwrap(accelerator, model)),
        trainable_parameters=count_trainable_parameters(unwrap(accelerator, model)),
        precision=f"{spec.precision.kind.value} (Accelerate mixed_precision={accelerator.mixed_precision})",
        device=describe(accelerator)["device"],
        stream=data.source if streamed else "",
    )
    trainer = make_trainer(spec, strategy, accelerator, model, optimizer, train_loader, eval_loader,  # 6
                           loaders.sampler, plan, built, block_size, run_dir, optimizer_in_use,
                           data_record(spec, data))
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
        _close(accelerator)
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
    set_seed(spec.train.seed)
    tokenizer = build_tokenizer(spec.model)
    config = build_config(spec.model)
    model = build_model(spec.model, config, len(tokenizer))
    if uses_adapters(spec.peft):
        model = add_adapters(spec.peft, model, spec.model.gradient_checkpointing)
    chunked, why_not = (install_chunked_loss(model, gpu_kernel=True) if spec.model.chunked_loss
                        else (None, "model.chunked_loss=false"))
    if chunked is not None:
        note = f"output head and loss by {chunked.kernel} (model.chunked_loss): the whole logits are never held"
        if chunked.state.fused is None and gpu_present():
            note += '; pip install "runner[liger]" for Liger\'s fused kernel'
    else:
        note = f"plain (the whole logits at once): {why_not}"
    return Built(tokenizer, config, model, chunked, note)


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


def load_data(spec: RunSpec, accelerator: Accelerator, tokenizer: Any, block_size: int) -> PreparedData | StreamedData:
    if spec.data.streaming:  # this rank's share, read as it trains
        try:
            streamed = open_stream(spec.data, tokenizer, block_size, spec.train.seed,
                                   accelerator.process_index, accelerator.num_processes)
        except BadRecord as err:  # the launcher read these blocks too; a file changed since
            log.error(f"runner: error: {err.line}")
            raise TrainingStopped(USAGE_EXIT_CODE, err.line) from None
        if accelerator.is_main_process:
            log.info(f"data: {streamed.source}; {len(streamed.validation)} eval blocks read in {streamed.seconds:.1f}s")
        return streamed
    # Tokenize once per machine (its local rank 0); the other ranks then read the cache.
    with accelerator.local_main_process_first():
        data = prepare_data(spec.data, tokenizer, block_size)
    if accelerator.is_main_process:
        log.info(f"data: {'reused' if data.cache_hit else 'built'} {data.cache_path} in {data.seconds:.1f}s")
        for split, c in (data.counts or {}).items():
            rows = f"packed into {c['rows']:,} rows of {block_size} (packing efficiency {c['packing_efficiency']:.1%})" \
                if spec.data.packing else f"one a row ({c['rows']:,} rows, padded per batch)"
            log.info(f"data: {split}: {c['examples']:,} examples ({c['truncated']:,} truncated, {c['dropped']:,} dropped "
                     f"as longer than {block_size} tokens), {rows}; {c['trained_tokens']:,} of {c['tokens']:,} tokens "
                     f"trained ({c['trained_share']:.1%})")
            if c.get("no_answer") or c.get("turns_cut"):  # chats: nothing trains after the last answer
                log.info(f"data: {split}: {c['no_answer']:,} chats with no assistant turn left out; "
                         f"{c['turns_cut']:,} cut after their last assistant turn")
    return data


def make_loaders(spec: RunSpec, data: PreparedData | StreamedData, world_size: int) -> Loaders:
    t = spec.train
    pin = torch.cuda.is_available()  # page-locked batches: the non_blocking copy (accelerator.dataloader_config) can overlap
    sampler: EpochSampler | BlockStream
    train_loader: DataLoader
    batches = collate if isinstance(data, StreamedData) else collate_for(spec.data, data.pad_id)
    if isinstance(data, StreamedData):
        from torchdata.stateful_dataloader import StatefulDataLoader

        # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: a warning per loader, nothing to act on
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

        # This rank's own share, not Accelerate's to shard; stateful, so a checkpoint holds
        # its exact position, in its loader workers too.
        sampler = data.train
        train_loader = StatefulDataLoader(
            data.train, batch_size=t.per_device_batch_size, collate_fn=batches, num_workers=t.dataloader_num_workers,
            drop_last=True, generator=loader_generator(t.seed), pin_memory=pin,
        )
    else:
        sampler = EpochSampler(len(data.train), t.seed)  # same order on every rank; Accelerate shards it
        # The epoch's last round completed by fillers, never by duplicates (runner/components/epoch_batches.py).
        train_loader = DataLoader(
            WithFillers(data.train), batch_sampler=EpochBatches(sampler, t.per_device_batch_size, world_size),
            collate_fn=masking_fillers(batches), num_workers=t.dataloader_num_workers,
            generator=loader_generator(t.seed),  # never the global stream dropout draws from (runner/train/rng.py)
            pin_memory=pin,
        )
    evaluation = DataLoader(
        data.validation, batch_size=t.per_device_eval_batch_size or t.per_device_batch_size, shuffle=False,
        collate_fn=batches, num_workers=t.dataloader_num_workers, generator=loader_generator(t.seed), pin_memory=pin,
    )
    return Loaders(train_loader, evaluation, sampler)


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


def data_record(spec: RunSpec, data: PreparedData | StreamedData) -> dict[str, Any]:
    """What a checkpoint's data position indexes, for a resume to check (runner/train/resume.py):
    a stream's files in their order, or the cached blocks' key (tokenizer, block size, the
    files' sha256)."""
    if isinstance(data, StreamedData):
        return {"data_files": training_files(spec.data)}
    return {"data_key": data.cache_path.name}


def make_trainer(spec: RunSpec, strategy: Strategy, accelerator: Accelerator, model: Any, optimizer: Any,
                 train_loader: Any, eval_loader: Any, sampler: EpochSampler | BlockStream, plan: RunPlan, built: Built,
                 block_size: int, run_dir: Path, optimizer_in_use: str, data_record: dict[str, Any]) -> Trainer:
    t, config = spec.train, built.config
    scheduler = build_scheduler(spec.schedule, optimizer, plan.total_steps)
    if accelerator.is_main_process:
        lines = [banner(plan, str(run_dir)), f"  optimizer      {optimizer_in_use}", f"  loss           {built.loss_note}"]
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
        spec.model.compile))
    return Trainer(
        Engine(accelerator, model, optimizer, scheduler, strategy),
        TrainData(train_loader, eval_loader, sampler, stream=isinstance(sampler, BlockStream), record=data_record,
                  counts_real_tokens=spec.data.format is not DataFormat.text),
        plan, objective,
        LoopSettings(
            run_dir, max_grad_norm=spec.optim.max_grad_norm, log_every=t.log_every, eval_every=t.eval_every,
            save_every=t.save_every, keep_checkpoints=t.keep_checkpoints, spec_yaml=spec_to_yaml(spec),
            max_consecutive_skipped_steps=spec.precision.max_consecutive_skipped_steps,
            flops_per_token=model_flops_per_token(config, plan.parameters, block_size,
                                                  expert_parameters(unwrap(accelerator, model)), plan.trainable),
            peak_flops=device_peak * accelerator.num_processes if device_peak else 0.0,  # 0: MFU unknown
            compiled=spec.model.compile),
    )


def restore_random_state(spec: RunSpec, accelerator: Accelerator, trainer: Trainer, run_dir: Path,
                         config: Any) -> Recorded:
    """Each rank's random state: seeded here for the loop, saved with every checkpoint,
    and restored from one after all setup (see runner/train/rng.py). Returns what the
    folder already holds for the last step when the resume lands on it (no step to run)."""
    seed_training_stream(spec.train.seed)
    resume_from = _resume_point(spec, run_dir)
    recorded = Recorded()
    if resume_from is not None:
        meta = load_resume_point(spec, accelerator, trainer, resume_from)
        trainer.restore(meta, resume_from)
        if trainer.state.step >= trainer.plan.total_steps:  # rank 0's reading, so every rank skips the same collectives
            found = [recorded_at_end(run_dir, trainer.state.step, load_spec(resume_from / SPEC_FILENAME), spec,
                                     trainer.plan.eval_blocks) if accelerator.is_main_process else None]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(found, src=0)
            recorded = found[0]
            trainer.final_eval = recorded.evaluation
        if accelerator.is_main_process:
            log.info(f"resumed from {resume_from} at step {trainer.state.step}")
            note = inexact_layout_note(meta, trainer.plan, {**active_dropout(config), **adapter_dropout(spec.peft)})
            if note:
                log.warning(f"runner: note: {note}")
            if recorded.note(trainer.state.step):
                log.info(recorded.note(trainer.state.step))
    if accelerator.is_main_process:
        # Lines past the step this run starts from are logged again: after a resume, or
        # after a restart (launch.max_restarts) of an attempt that died before its first
        # checkpoint. metrics.jsonl then holds each step once.
        truncate_metrics(run_dir / "metrics.jsonl", trainer.state.step,
                         final_eval_again=trainer.state.step >= trainer.plan.total_steps and recorded.evaluation is None)
    return recorded


def load_resume_point(spec: RunSpec, accelerator: Accelerator, trainer: Trainer, checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's states into this run: through Accelerate's load_state in the layout
    and strategy that wrote it, else read across (runner/train/reshard.py; the launcher
    has already refused what cannot be)."""
    old = load_spec(checkpoint / SPEC_FILENAME)
    old_world = int(read_marker(checkpoint).get("world_size", accelerator.num_processes))
    if accelerator.is_main_process and old.strategy.kind != spec.strategy.kind:
        log.warning(f"runner: note: the strategy changed ({old.strategy.kind.value} -> {spec.strategy.kind.value}): "
                    "it sums in another order, so the continuation matches an uninterrupted run within float "
                    "rounding, not bit for bit.")
    if not needs_reshard(old.strategy.kind.value, spec.strategy.kind.value, old_world, accelerator.num_processes):
        meta = load_checkpoint(accelerator, checkpoint)
    else:
        if accelerator.is_main_process:
            log.info(f"resume: reading {checkpoint.name} of {old_world} processes under {old.strategy.kind.value} into "
                     f"{accelerator.num_processes} under {spec.strategy.kind.value} (runner/train/reshard.py)")
        meta = load_across(accelerator, checkpoint, old.strategy.kind.value, spec.strategy.kind.value, trainer.model,
                           trainer.optimizer, trainer.scheduler, spec.optim.weight_decay, trainer.run_dir)
    follow_plan(trainer.scheduler)  # the loaded rate is the checkpoint's plan's; the steps ahead follow this run's
    return meta


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


def finish(spec: RunSpec, strategy: Strategy, accelerator: Accelerator, trainer: Trainer, model: Any, tokenizer: Any,
           data: PreparedData | StreamedData, run_dir: Path, before_model_mb: float, train_results: dict[str, Any],
           eval_results: dict[str, float], recorded: Optional[Recorded] = None) -> dict[str, Any]:
    """Check the ranks agree, checkpoint the final state, save model/ and the results,
    except what a resume at the last step found written (`recorded`)."""
    recorded = recorded or Recorded()
    fingerprints = rank_fingerprints(accelerator, model, strategy)
    check_in_sync(fingerprints)  # a silent fallback to unsynchronised copies ends here
    train_results["rank_param_fingerprints"] = fingerprints
    peaks, befores = memory_per_rank(accelerator, before_model_mb)
    train_results["peak_memory_mb_per_rank"], train_results["host_memory_before_model_mb_per_rank"] = peaks, befores
    train_results["peak_memory_mb"] = max(train_results["peak_memory_mb_per_rank"])
    plan = trainer.plan
    train_results.update(total_parameters=plan.parameters, trainable_parameters=plan.trainable,
                         trainable_ratio=round(plan.trainable / max(plan.parameters, 1), 6))
    train_results.update(trainer.compile_results())
    if spec.train.save_every and trainer.last_checkpoint != checkpoint_dir(run_dir, trainer.state.step):
        trainer.save_checkpoint()  # the final state is always resumable
    started = time.perf_counter()
    if not recorded.outputs:
        save_outputs(spec, strategy, accelerator, model, tokenizer, run_dir)
    trainer.ledger.add("checkpoint_saves", time.perf_counter() - started)  # model/ (or adapter/)
    results: dict[str, Any] = {}
    if accelerator.is_main_process and recorded.results:
        results = json.loads((run_dir / "all_results.json").read_text())  # as written at this step, left as it is
    elif accelerator.is_main_process:
        train_results["goodput"] = ledger_report(trainer.ledger, time.time() - trainer.ledger.launch,
                                                 trainer.state.step, spec.train.save_every, spec.launch.mtbf_hours)
        train_results["train_samples_total"] = None if isinstance(data, StreamedData) else len(data.train)
        train_results["data_seconds"] = round(data.seconds, 3)  # tokenize + group, or read the cache
        if isinstance(data, PreparedData) and data.counts:  # instruction formats: examples, rows, trained tokens
            train_results["instruction_data"] = data.counts
        results = write_results(run_dir, train_results, eval_results or None)
        plot_loss_curves(run_dir / "metrics.jsonl", run_dir / PLOT_FILENAME, title=f"{spec.name}: {run_dir.name}")
        log.info(summary_table(results, run_dir))
    # Only on success: after a failure, exit at once (no barrier) so the launcher sees
    # it and stops the other ranks, which may be stuck in a collective.
    _close(accelerator)
    return results


def memory_per_rank(accelerator: Accelerator, before_model_mb: float) -> tuple[list[float], list[float]]:
    """Every rank's peak memory (CUDA max reserved on a GPU, peak RSS on a CPU) and the host
    memory it held before building the model, in MB, gathered (a collective: all ranks call it)."""
    memory = accelerator.gather(torch.tensor([[peak_memory_mb(accelerator.device), before_model_mb]], device=accelerator.device))
    return [round(float(v), 1) for v in memory[:, 0].cpu()], [round(float(v), 1) for v in memory[:, 1].cpu()]


def save_outputs(spec: RunSpec, strategy: Strategy, accelerator: Accelerator, model: Any, tokenizer: Any,
                 run_dir: Path) -> Path:
    """model/: save_pretrained + tokenizer, loadable by AutoModelForCausalLM; fp32 weights
    whatever the strategy (under ZeRO, its fp32 master weights gathered from every rank).
    With adapters: adapter/ (peft's save_pretrained: the adapters and modules_to_save
    only, loadable by PeftModel.from_pretrained), and model/ only with peft.save_merged."""
    adapters = uses_adapters(spec.peft)
    out = run_dir / (ADAPTER_DIRNAME if adapters else "model")
    state_dict = strategy.full_state_dict(accelerator, model)  # every rank calls: a collective
    if accelerator.is_main_process:
        unwrap(accelerator, model).save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out)
        if adapters and spec.peft.save_merged:
            with strategy.alone(accelerator):  # this rank alone: no collective (ZeRO-3's hung)
                save_merged_model(spec, out, run_dir / "model", tokenizer)
    accelerator.wait_for_everyone()
    return out


def save_merged_model(spec: RunSpec, adapter_dir: Path, out: Path, tokenizer: Any) -> None:
    """model/: the pretrained base, read again (it was frozen, so it is what trained), with
    the saved adapters merged into its weights by peft: a plain Hugging Face model."""
    from peft import PeftModel

    base = build_model(replace(spec.model, gradient_checkpointing=False), build_config(spec.model), len(tokenizer))
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _close(accelerator: Accelerator) -> None:
    """Leave together: a barrier, then tear the process group down, so no rank exits
    while another still talks to it (seen as rare aborts at exit under ZeRO-3)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            accelerator.end_training()  # destroys the process group
            if dist.is_initialized():
                dist.destroy_process_group()
    else:
        accelerator.end_training()


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
    run logs on, as metrics.jsonl is cut back (truncate_metrics).
    """
    return {"tensorboard": {"purge_step": start_step + 1}}


def _resume_point(spec: RunSpec, run_dir: Path) -> Optional[Path]:
    """resume=auto|PATH, or after a crash restart (launch.max_restarts) the newest checkpoint."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return latest_checkpoint(run_dir)
    return resolve(spec, run_dir)


def inexact_layout_note(meta: dict[str, Any], plan: RunPlan, dropout: dict[str, float]) -> Optional[str]:
    """Why a resume in another layout cannot be exact, when dropout is on: each rank
    draws masks for its own micro-batch shape, so another per-rank batch draws other
    masks (the samples, the global batch and the math are still the same)."""
    saved = (int(meta.get("world_size", plan.world_size)), int(meta.get("per_device_batch_size", plan.per_device_batch_size)),
             int(meta.get("grad_accum_steps", plan.grad_accum_steps)))
    now = (plan.world_size, plan.per_device_batch_size, plan.grad_accum_steps)
    if saved == now or not dropout:
        return None
    shown = ", ".join(f"{k}={v:g}" for k, v in sorted(dropout.items()))
    return (f"the layout changed ({'x'.join(map(str, saved))} -> {'x'.join(map(str, now))}, processes x per-device batch x "
            f"accumulation) with dropout on ({shown}): the dropout masks differ from an uninterrupted run's, so this "
            "continuation is statistically equivalent, not exact. Keep the layout for an exact resume.")


def truncate_metrics(path: Path, step: int, final_eval_again: bool = False) -> None:
    """Drop lines logged after the checkpoint: the resumed run logs those steps again.
    `final_eval_again`: the checkpoint is the last step, whose evaluation (logged after
    the checkpoint was written) the resumed run repeats."""
    if not path.exists():
        return

    def kept(line: str) -> bool:
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by kill -9 mid-write
            return False
        if final_eval_again and "eval_loss" in row and row.get("step", 0) >= step:
            return False
        return row.get("step", 0) <= step

    keep = [line for line in path.read_text().splitlines() if line.strip() and kept(line)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
