"""Per-rank entry: read the frozen spec, build everything, train, save, close.

Workers never run Hydra: the launcher composed and validated the spec once and
wrote it to run_spec.yaml; every rank reads that same file.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.config.spec import OffloadDevice, RunSpec, StrategyKind, load_spec

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger("runner")


def _loaders(spec: RunSpec, data: Any) -> tuple[Any, Any, Any]:
    """(train loader, eval loader, the train sampler whose epoch the trainer sets)."""
    import torch
    from torch.utils.data import DataLoader

    from runner.components.data import EpochSampler, collate
    from runner.train.rng import loader_generator

    t = spec.train
    pin = torch.cuda.is_available()  # page-locked batches: the non_blocking copy (accel.dataloader_config) can overlap
    sampler = EpochSampler(len(data.train), t.seed)  # same order on every rank; Accelerate shards it
    train = DataLoader(
        data.train,
        batch_size=t.per_device_batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=t.dataloader_num_workers,
        drop_last=False,
        generator=loader_generator(t.seed),  # never the global stream dropout draws from (runner/train/rng.py)
        pin_memory=pin,
    )
    evaluation = DataLoader(
        data.validation,
        batch_size=t.per_device_eval_batch_size or t.per_device_batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=t.dataloader_num_workers,
        generator=loader_generator(t.seed),
        pin_memory=pin,
    )
    return train, evaluation, sampler


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than launch.timeout_minutes."""


def _is_timeout(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return "timed out" in text or "timeout" in text or type(err).__name__ == "DistBackendError" and "wait" in text


def tracker_hparams(spec: RunSpec) -> dict[str, Any]:
    """The spec, flattened to the scalar values trackers accept as hyperparameters."""
    from runner.config.spec import flat_spec_dict

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
    from runner.train.checkpoint import latest_checkpoint
    from runner.train.resume import resolve

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return latest_checkpoint(run_dir)
    return resolve(spec, run_dir)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines logged after the checkpoint: the resumed run logs those steps again."""
    import json

    if not path.exists():
        return
    def kept(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except ValueError:  # a line torn by kill -9 mid-write
            return False

    keep = [line for line in path.read_text().splitlines() if line.strip() and kept(line)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def save_outputs(accelerator: "Accelerator", model: Any, tokenizer: Any, run_dir: Path) -> Path:
    """model/: save_pretrained + tokenizer, loadable by AutoModelForCausalLM; fp32 weights
    whatever the strategy (under ZeRO, its fp32 master weights gathered from every rank)."""
    from accelerate.utils import DistributedType

    from runner.distributed.accelerator import unwrap, zero_fp32_state_dict

    out = run_dir / "model"
    if accelerator.state.distributed_type == DistributedType.DEEPSPEED:
        state_dict = zero_fp32_state_dict(model, keep=accelerator.is_main_process)  # every rank calls: a collective
    else:
        state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = unwrap(accelerator, model)
        unwrapped.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out)
    accelerator.wait_for_everyone()
    return out


def run(spec: Optional[RunSpec]) -> dict[str, Any]:
    """Join the process group (if any), agree on rank 0's spec, train."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from runner.distributed.process_group import agree_on_spec, init_process_group

        # Before the spec is known (a joined follower) the default timeout applies.
        init_process_group(spec.launch.timeout_minutes if spec is not None else 30.0)
        spec = agree_on_spec(spec)
    assert spec is not None, "a single process always has its spec"
    return train(spec)


def train(spec: RunSpec) -> dict[str, Any]:
    import torch
    from accelerate.utils import set_seed

    from runner.distributed.accelerator import (
        build_accelerator, check_engaged, check_in_sync, describe, fp32_copy, is_zero, rank_fingerprints,
        set_zero_master_weights, share_zero3_fp32_master, skip_output_upcast, unwrap,
    )
    from runner.components.data import prepare, resolve_block_size
    from runner.report.log import setup_logging
    from runner.report.metrics import current_memory_mb, peak_memory_mb, summary_table, write_results
    from runner.components.model import build_config, build_model, build_tokenizer, count_parameters, max_positions
    from runner.components.optim import build_optimizer, build_scheduler, effective_lr
    from runner.train.plan import banner, global_batch, plan_run
    from runner.report.plots import PLOT_FILENAME, plot_loss_curves
    from runner.train.rng import seed_training_stream
    from runner.train.checkpoint import checkpoint_dir, load_checkpoint
    from runner.report.flops import model_flops_per_token, peak_flops
    from runner.train.signals import EXIT_CODES, Stopped
    from runner.config.spec import spec_to_yaml
    from runner.launch.launcher import planned_world_size
    from runner.train.trainer import NonFiniteLoss, Trainer

    run_dir = Path(spec.run_dir)
    t = spec.train
    from runner.train.host_memory import retain_freed_memory, return_freed_memory

    if spec.launch.retain_freed_memory:  # before the model and the first batch are allocated
        retain_freed_memory()
    else:
        return_freed_memory()
    # The model is built, seeded, before the Accelerator: under ZeRO-3 a model built
    # afterwards is initialised inside the engine and its weights differ from DDP's.
    set_seed(t.seed)
    # What the process holds before any model state exists (interpreter, libraries):
    # peak memory above it is what training adds (bench/strategy_memory.py reads it).
    before_model_mb = current_memory_mb(None)
    tokenizer = build_tokenizer(spec.model)
    config = build_config(spec.model)
    model = build_model(spec.model, config, len(tokenizer))

    accelerator = build_accelerator(
        spec.strategy, spec.precision, t.grad_accum_steps, spec.optim.max_grad_norm,
        compile_model=spec.model.compile, timeout_minutes=spec.launch.timeout_minutes,
        tracking=spec.tracking.value, logging_dir=str(run_dir / "tensorboard"),
        per_device_batch_size=t.per_device_batch_size, model_type=config.model_type,
        hidden_size=getattr(config, "hidden_size", None),  # GPT-2's n_embd, by transformers' attribute map
    )
    setup_logging(run_dir, accelerator.is_main_process, accelerator.process_index)
    block_size = resolve_block_size(spec.data, max_positions(config), tokenizer.model_max_length)
    # Tokenize once per machine (its local rank 0); the other ranks then read the cache.
    with accelerator.local_main_process_first():
        data = prepare(spec.data, tokenizer, block_size)
    if accelerator.is_main_process:
        state = "reused" if data.cache_hit else "built"
        log.info(f"data: {state} {data.cache_path} in {data.seconds:.1f}s")

    train_loader, eval_loader, sampler = _loaders(spec, data)
    lr = effective_lr(spec.optim, global_batch(t, accelerator.num_processes))
    optimizer = build_optimizer(spec.optim, model, lr)
    initial = fp32_copy(model) if is_zero(spec.strategy) and accelerator.mixed_precision != "no" else None
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if initial is not None:
        set_zero_master_weights(model, initial)  # ZeRO starts from the same fp32 weights as ddp
        del initial
    elif spec.strategy.kind is StrategyKind.zero3 and spec.strategy.offload_optimizer is OffloadDevice.none:
        share_zero3_fp32_master(model)  # fp32: one copy of each partition, not two
    skip_output_upcast(accelerator, model)  # the loss is computed in the model, in fp32
    world_size = accelerator.num_processes
    optimizer_in_use = check_engaged(accelerator, model, optimizer, spec, planned_world_size(spec.launch))

    plan = plan_run(
        spec,
        world_size,
        batches_per_rank=len(train_loader),
        block_size=block_size,
        train_blocks=len(data.train),
        eval_blocks=len(data.validation),
        parameters=count_parameters(unwrap(accelerator, model)),
        precision=f"{spec.precision.kind.value} (Accelerate mixed_precision={accelerator.mixed_precision})",
        device=describe(accelerator)["device"],
    )
    scheduler = build_scheduler(spec.schedule, optimizer, plan.total_steps)
    if accelerator.is_main_process:
        swapped = " (DeepSpeed's, for strategy.offload_optimizer; optim.fused does not apply)" if "DeepSpeed" in optimizer_in_use else ""
        log.info(banner(plan, str(run_dir)) + f"\n  optimizer      {optimizer_in_use}{swapped}")

    accelerator.register_for_checkpointing(scheduler)  # not prepared (see optim.py), so saved explicitly
    device_peak = peak_flops(accelerator.device, spec.precision.kind.value)
    if device_peak is None and accelerator.is_main_process:
        log.warning(f"MFU: unknown ({torch.cuda.get_device_name(accelerator.device)} is not in runner/report/flops.py's peak table)")
    trainer = Trainer(
        accelerator, model, optimizer, scheduler, train_loader, eval_loader, plan, run_dir,
        max_grad_norm=spec.optim.max_grad_norm,
        max_consecutive_skipped_steps=spec.precision.max_consecutive_skipped_steps,
        log_every=t.log_every,
        eval_every=t.eval_every,
        save_every=t.save_every,
        keep_checkpoints=t.keep_checkpoints,
        sampler=sampler,
        spec_yaml=spec_to_yaml(spec),
        flops_per_token=model_flops_per_token(config, plan.parameters, block_size),
        peak_flops=device_peak * accelerator.num_processes if device_peak else 0.0,  # 0: MFU unknown
    )
    # Each rank's random state: seeded here for the loop, saved with every checkpoint,
    # and restored by load_checkpoint below, after all setup (see runner/train/rng.py).
    seed_training_stream(t.seed)
    resume_from = _resume_point(spec, run_dir)
    if resume_from is not None:
        meta = load_checkpoint(accelerator, resume_from)
        trainer.restore(meta)
        if accelerator.is_main_process:
            log.info(f"resumed from {resume_from} at step {trainer.state.step}")
    if accelerator.is_main_process:
        # Lines past the step this run starts from are logged again: after a resume, or
        # after a restart (launch.max_restarts) of an attempt that died before its first
        # checkpoint. metrics.jsonl then holds each step once.
        truncate_metrics(run_dir / "metrics.jsonl", trainer.state.step)
    if spec.tracking.value != "none":
        accelerator.init_trackers(spec.name, config=tracker_hparams(spec), init_kwargs=tracker_kwargs(trainer.state.step))
    try:
        train_results, eval_results = trainer.fit()
    except Stopped as stop:
        log.warning(
            f"runner: {stop}. Resume with: runner --spec {run_dir / 'run_spec.yaml'} --run-dir {run_dir} --resume auto"
        )
        raise SystemExit(EXIT_CODES.get(stop.signum, 1)) from None
    except NonFiniteLoss as err:
        log.error(f"runner: {err}")
        raise SystemExit(3) from None
    except Exception as err:
        if _is_timeout(err):
            raise CollectiveTimeout(
                f"rank {accelerator.process_index} waited more than launch.timeout_minutes={spec.launch.timeout_minutes:g} "
                "for the other ranks in a collective: a rank is stuck or died. See the README section 'When a run "
                "hangs' (launch.debug=true shows every rank's collectives; raise launch.timeout_minutes if one step "
                "is legitimately that slow)."
            ) from err
        raise
    fingerprints = rank_fingerprints(accelerator, model, spec.strategy)
    check_in_sync(fingerprints)  # a silent fallback to unsynchronised copies ends here
    train_results["rank_param_fingerprints"] = fingerprints
    memory = accelerator.gather(torch.tensor([[peak_memory_mb(accelerator.device), before_model_mb]], device=accelerator.device))
    train_results["peak_memory_mb_per_rank"] = [round(float(v), 1) for v in memory[:, 0].cpu()]
    train_results["host_memory_before_model_mb_per_rank"] = [round(float(v), 1) for v in memory[:, 1].cpu()]
    train_results["peak_memory_mb"] = max(train_results["peak_memory_mb_per_rank"])
    if t.save_every and trainer.last_checkpoint != checkpoint_dir(run_dir, trainer.state.step):
        trainer.save_checkpoint()  # the final state is always resumable
    save_outputs(accelerator, model, tokenizer, run_dir)
    results: dict[str, Any] = {}
    if accelerator.is_main_process:
        train_results["train_samples_total"] = len(data.train)
        train_results["data_seconds"] = round(data.seconds, 3)  # tokenize + group, or read the cache
        results = write_results(run_dir, train_results, eval_results or None)
        plot_loss_curves(run_dir / "metrics.jsonl", run_dir / PLOT_FILENAME, title=f"{spec.name}: {run_dir.name}")
        log.info(summary_table(results, run_dir))
    # Only on success: after a failure, exit at once (no barrier) so the launcher sees
    # it and stops the other ranks, which may be stuck in a collective.
    _close(accelerator)
    return results


def _close(accelerator: "Accelerator") -> None:
    """Leave together: a barrier, then tear the process group down, so no rank exits
    while another still talks to it (seen as rare aborts at exit under ZeRO-3)."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            accelerator.end_training()  # destroys the process group
            if dist.is_initialized():
                dist.destroy_process_group()
    else:
        accelerator.end_training()


def main(spec_path: str) -> None:
    """Entry for a spawned worker process."""
    # torch.distributed's deprecation notices, once per collective per rank, bury the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    run(load_spec(Path(spec_path)))
