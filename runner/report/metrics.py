"""Rank-0 outputs: metrics.jsonl, the progress bar, results JSON and the end summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

METRICS_FILENAME = "metrics.jsonl"


class MetricsWriter:
    """Appends one JSON object per line and forwards the numbers to the trackers;
    a no-op on every rank but 0."""

    def __init__(self, path: Path, enabled: bool, tracker_log: Optional[Callable[[dict, int], None]] = None) -> None:
        self.path = path
        self.enabled = enabled
        self.tracker_log = tracker_log

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tracker_log is not None:
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            for key in ("peak_memory_mb", "memory_mb"):
                if isinstance(record.get(key), list):
                    numbers[key] = max(record[key])
            self.tracker_log(numbers, int(record["step"]))


def evaluation_name(name: str) -> str:
    """An evaluation figure's name in metrics.jsonl and the trackers: `eval_` before each
    name that lacks it, as transformers' Trainer (and so TRL) prefixes evaluation metrics,
    so that no series holds a training and an evaluation value at one step (a preference
    run's rewards/*, logps/*). perplexity keeps run_clm's name. eval_results.json keeps
    the objective's own names."""
    return name if name.startswith("eval_") or name == "perplexity" else f"eval_{name}"


def evaluation_record(results: dict[str, Any], figures: Sequence[str]) -> dict[str, Any]:
    """An evaluation's line: the objective's figures and each source's eval_loss/<name>."""
    return {**{evaluation_name(name): results[name] for name in figures},
            **{name: value for name, value in results.items() if name.startswith("eval_loss/")}}


class Progress:
    """A tqdm bar (rate and ETA) on rank 0; silent elsewhere."""

    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="train")

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_cuda(device: Any) -> bool:
    return device is not None and getattr(device, "type", str(device)) == "cuda"


# The run's CUDA peak so far, per device: window_peak_memory_mb resets torch's peak
# counter each window, so the whole run's peak is kept here.
_run_peak_mb: dict[str, float] = {}


def window_peak_memory_mb(device: Any = None) -> float:
    """Peak memory of this rank since the previous call (one log window). On a GPU:
    CUDA's peak *reserved* memory (allocated plus the caching allocator's cache: what
    the driver gave this process, what an out-of-memory error depends on), then the
    counter is reset. On a CPU: the process's peak RSS since the run began (resetting it
    per window would lose the run's peak, which only the OS keeps)."""
    if not _is_cuda(device):
        return peak_memory_mb(device)
    peak = torch.cuda.max_memory_reserved(device) / 2**20
    key = str(device)
    _run_peak_mb[key] = max(_run_peak_mb.get(key, 0.0), peak)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def peak_memory_mb(device: Any = None) -> float:
    """Peak memory of this rank over the run: CUDA max reserved on a GPU, else the
    process's peak RSS since reset_peak_memory (VmHWM)."""
    if _is_cuda(device):
        return max(_run_peak_mb.get(str(device), 0.0), torch.cuda.max_memory_reserved(device) / 2**20)
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory() -> None:
    """Start this run's peak afresh. A sweep runs one-process jobs in one process: without
    this, each job's peak would be the largest of every job before it (the process's
    lifetime peak RSS, CUDA's peak counters and the run peak kept above)."""
    _run_peak_mb.clear()
    # Only where an earlier run used CUDA: in a fresh process there is nothing to reset, and
    # the memory-stat calls would create a CUDA context on every device before the worker
    # picked its own, and before train.deterministic set CUBLAS_WORKSPACE_CONFIG.
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the caching allocator's blocks from before count as reserved otherwise
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # Linux: resets the peak resident set (VmHWM, ru_maxrss) to the current one
    except OSError:
        pass  # not Linux: the peak stays the process's own


def current_memory_mb(device: Any = None) -> float:
    """Memory this rank holds now: CUDA reserved on a GPU, else the process's resident set."""
    if _is_cuda(device):
        return torch.cuda.memory_reserved(device) / 2**20
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return peak_memory_mb(device)


def write_results(run_dir: Path, train: dict[str, Any], evaluation: Optional[dict[str, Any]]) -> dict[str, Any]:
    """run_clm's three files: train_results.json, eval_results.json, all_results.json."""
    everything = dict(train)
    (run_dir / "train_results.json").write_text(json.dumps(train, indent=2) + "\n")
    if evaluation is not None:
        (run_dir / "eval_results.json").write_text(json.dumps(evaluation, indent=2) + "\n")
        everything.update(evaluation)
    (run_dir / "all_results.json").write_text(json.dumps(everything, indent=2, sort_keys=True) + "\n")
    return everything


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def summary_table(results: dict[str, Any], run_dir: Path) -> str:
    keys = [
        ("train_loss", "train loss"),
        ("eval_loss", "eval loss"),
        ("perplexity", "perplexity"),
        ("eval_accuracy", "token accuracy"),
        ("rewards/accuracies", "reward accuracy"),  # a preference run's evaluation (train.objective=dpo)
        ("rewards/margins", "reward margin"),
        ("train_steps", "optimizer steps"),
        ("train_tokens", "tokens seen"),
        ("train_runtime", "train time (s)"),
        ("compile_seconds", "compile (s)"),  # model.compile, in training and evaluation (runner/components/compile.py)
        ("recompilations", "recompilations"),
        ("train_tokens_per_second", "tokens/s"),
        ("train_samples_per_second", "samples/s"),
        ("train_mfu", "MFU"),
        ("peak_memory_mb", "peak memory (MB/rank)"),
    ]
    def shown(key: str) -> str:
        if key == "train_mfu":  # present but None: the device's peak is not known
            return "unknown" if results[key] is None else f"{100 * results[key]:.2f}%"
        return _fmt(results[key])

    rows = [(label, shown(key)) for key, label in keys if results.get(key) is not None or (key == "train_mfu" and key in results)]
    # data.mixture: each source's own validation loss, after the total
    after = next((i + 1 for i, (label, _) in enumerate(rows) if label == "eval loss"), len(rows))
    rows[after:after] = [(f"  eval loss, {key.split('/', 1)[1]}", _fmt(value)) for key, value in results.items()
                         if key.startswith("eval_loss/") and value is not None]
    # eval.tasks: lm-eval's scores of the saved model (runner/report/benchmarks.py), after the evaluation's
    evaluated = [i for i, (label, _) in enumerate(rows)
                 if label.strip().startswith(("eval loss", "perplexity", "token accuracy", "reward"))]
    at = evaluated[-1] + 1 if evaluated else after
    rows[at:at] = [(key.split("/", 1)[1].replace("/", " ", 1), _fmt(value)) for key, value in results.items()
                         if key.startswith("benchmark/") and not key.endswith("_stderr") and value is not None]
    ledger = results.get("goodput")  # the goodput ledger's figures (runner/train/ledger.py), shown as they are
    if ledger and ledger.get("goodput") is not None:
        parts = ledger["parts_seconds"]
        rows.append(("goodput", f"{ledger['goodput']:.1%} of {ledger['wall_seconds']:,.0f} s"))
        rows += [(f"  {name.replace('_', ' ')} (s)", f"{seconds:,.1f}") for name, seconds in parts.items()
                 if seconds or name == "steps"]
    if results.get("trainable_parameters") and results["trainable_parameters"] != results.get("total_parameters"):
        rows.append(("trainable parameters", f"{results['trainable_parameters']:,} of {results['total_parameters']:,} "
                                             f"({100 * results['trainable_ratio']:.2f}%)"))
    width = max(len(label) for label, _ in rows)
    value_width = max(len(v) for _, v in rows)
    rule = "-" * (width + value_width + 5)
    outputs = "/, ".join(d for d in ("adapter", "model") if (run_dir / d).is_dir()) + "/" if (run_dir / "adapter").is_dir() else "model/"
    lines = ["runner: finished", rule]
    lines += [f"  {label:<{width}}   {value:>{value_width}}" for label, value in rows]
    if ledger and ledger.get("suggestion"):
        lines += [rule, f"  checkpoint interval: {ledger['suggestion']}"]
    lines += [rule, f"  outputs in {run_dir}  ({outputs}, all_results.json, metrics.jsonl, loss_curves.png)"]
    return "\n".join(lines)
