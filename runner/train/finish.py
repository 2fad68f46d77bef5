"""The end of a run: the ranks agree, the final state is checkpointed, model/ (or adapter/)
and the results are written, and the ranks leave together.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator

from runner.components.adapters import ADAPTER_DIRNAME, uses_adapters
from runner.components.data.prepare import PreparedData
from runner.components.data.stream import StreamedData, blocks_handed_out
from runner.components.model import build_config, build_model
from runner.config.mixture import shares_asked
from runner.config.spec import RunSpec
from runner.distributed.accelerator import unwrap
from runner.distributed.engagement import check_in_sync, rank_fingerprints
from runner.distributed.strategy import Strategy
from runner.report.metrics import peak_memory_mb, summary_table, write_results
from runner.report.plots import PLOT_FILENAME, plot_loss_curves
from runner.train.checkpoint import checkpoint_dir
from runner.train.resume import Recorded
from runner.train.trainer import Trainer

log = logging.getLogger("runner")


def finish(spec: RunSpec, strategy: Strategy, accelerator: Accelerator, trainer: Trainer, model: Any, tokenizer: Any,
           data: PreparedData | StreamedData, run_dir: Path, before_model_mb: float, train_results: dict[str, Any],
           eval_results: dict[str, float], recorded: Optional[Recorded] = None) -> dict[str, Any]:
    """Check the ranks agree, checkpoint the final state, save model/ and the results,
    except what a resume at the last step found written (`recorded`)."""
    recorded = recorded or Recorded()
    fingerprints = rank_fingerprints(accelerator, model, strategy)
    check_in_sync(fingerprints)  # a silent fallback to unsynchronised copies ends here
    train_results["rank_param_fingerprints"] = fingerprints
    streamed_mixture = (streamed_mixture_results(spec, accelerator, trainer, data)
                        if isinstance(data, StreamedData) and data.sources else None)  # a collective: every rank
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
        train_results["goodput"] = trainer.ledger.results(trainer.state.step, spec.train.save_every,
                                                          spec.launch.mtbf_hours)
        train_results["train_samples_total"] = None if isinstance(data, StreamedData) else len(data.train)
        train_results["data_seconds"] = round(data.seconds, 3)  # tokenize + group, or read the cache
        if isinstance(data, PreparedData) and data.counts:  # instruction formats: examples, rows, trained tokens
            train_results["instruction_data"] = data.counts
        if isinstance(data, PreparedData) and data.mixture is not None:
            train_results["mixture"] = mixture_results(spec, data, trainer.plan, trainer.state.step)
        elif streamed_mixture is not None:
            train_results["mixture"] = streamed_mixture
        results = write_results(run_dir, train_results, eval_results or None)
        plot_loss_curves(run_dir / "metrics.jsonl", run_dir / PLOT_FILENAME, title=f"{spec.name}: {run_dir.name}")
        log.info(summary_table(results, run_dir))
    # Only on success: after a failure, exit at once (no barrier) so the launcher sees
    # it and stops the other ranks, which may be stuck in a collective.
    close(accelerator)
    return results


def mixture_results(spec: RunSpec, data: PreparedData, plan: Any, steps: int) -> list[dict[str, Any]]:
    """Per source: the prepared rows and tokens, its rows in the mixture, the share its
    weight asked, and the shares of examples and tokens the run trained, in closed form
    from the schedule: global step k trains rows [k * global batch, (k + 1) * global
    batch) of its epoch's order (runner/components/data/epoch_batches.py), an epoch's last
    step the rest."""
    from runner.components.data.epoch_batches import EpochSampler

    rows, per_step = len(data.train), plan.global_batch_size
    full, partial = divmod(steps, max(plan.steps_per_epoch, 1))
    trained = [rows] * full + ([min(rows, partial * per_step)] if partial else [])
    sampler = EpochSampler(rows, spec.train.seed)

    def order(epoch: int) -> list[int]:
        sampler.set_epoch(epoch)
        return list(iter(sampler))

    assert data.mixture is not None
    shares = data.mixture.shares_trained(order, trained)
    return [{"source": f.name, "share_asked": round(f.share_asked, 6), "prepared_examples": f.examples,
             "prepared_tokens": f.tokens, "mixture_examples": f.mixed_examples, "mixture_tokens": f.mixed_tokens,
             "validation_examples": f.validation_examples,
             "trained_examples_share": round(shares["examples"][i], 6), "trained_tokens_share": round(shares["tokens"][i], 6)}
            for i, f in enumerate(data.mixture.figures)]


def streamed_mixture_results(spec: RunSpec, accelerator: Accelerator, trainer: Trainer,
                             data: StreamedData) -> list[dict[str, Any]]:
    """A streamed mixture's realised shares: the blocks each rank's stream handed its loader,
    per source, as the loader's state (what a checkpoint saves, so a resume carries them
    on) holds them, summed over the ranks. Every block is block_size tokens, so the shares
    of examples and of tokens are one. A pass's remainder shorter than a step, counted
    though not trained, is the only difference from the steps' own blocks."""
    mine = blocks_handed_out(trainer.data.train_loader.state_dict()) or [0] * len(data.sources)
    counts = accelerator.gather(torch.tensor([mine], device=accelerator.device)).sum(dim=0).tolist()
    total = max(sum(counts), 1)
    return [{"source": name, "share_asked": round(asked, 6), "trained_blocks": int(count),
             "trained_examples_share": round(count / total, 6), "trained_tokens_share": round(count / total, 6)}
            for name, asked, count in zip(data.sources, shares_asked(spec.data), counts)]


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
        written = weights_dtype(state_dict)  # before save_pretrained, which empties the dict
        unwrap(accelerator, model).save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        record_weights_dtype(out, written)
        tokenizer.save_pretrained(out)
        if adapters and spec.peft.save_merged:
            with strategy.alone(accelerator):  # this rank alone: no collective (ZeRO-3's hung)
                save_merged_model(spec, out, run_dir / "model", tokenizer)
    accelerator.wait_for_everyone()
    return out


def weights_dtype(state_dict: dict[str, Any]) -> Optional[torch.dtype]:
    """The dtype of a state dict's floating weights (mixed: the most common); None: none."""
    dtypes = [t.dtype for t in state_dict.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max(set(dtypes), key=dtypes.count) if dtypes else None


def record_weights_dtype(out: Path, dtype: Optional[torch.dtype]) -> None:
    """config.json's `dtype` made `dtype`, the weights' written beside it. save_pretrained
    records the module's dtype, and under zero2/zero3 with bf16 that is the engine's bf16
    copy while the weights written are its fp32 master: a load with dtype="auto" (lm-eval's
    eval.dtype=auto, a user's) would then run in bf16 under ZeRO and in fp32 under ddp.
    peft's adapter/ carries no dtype (its base's config does)."""
    config_path = out / "config.json"
    if dtype is None or not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    if config.get("dtype") != name:
        config["dtype"] = name
        tmp = config_path.with_name(f".{config_path.name}.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, config_path)


def save_merged_model(spec: RunSpec, adapter_dir: Path, out: Path, tokenizer: Any) -> None:
    """model/: the pretrained base, read again (it was frozen, so it is what trained), with
    the saved adapters merged into its weights by peft: a plain Hugging Face model."""
    from peft import PeftModel

    base = build_model(replace(spec.model, gradient_checkpointing=False), build_config(spec.model), len(tokenizer))
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def close(accelerator: Accelerator) -> None:
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
