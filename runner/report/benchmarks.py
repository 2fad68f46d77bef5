"""Benchmark evaluation of a run's saved model (eval.tasks), by EleutherAI's
lm-evaluation-harness: after training, and on demand as `runner eval RUN_DIR`.

One process evaluates, after the workers have exited: the launcher (rank 0's node), on
one device, reading `model/` (or `adapter/` on its base) as `lm_eval --model hf` would.
So the scores are those of the model a user gets, whatever the strategy and the number
of processes that trained it, and equal lm-eval's own command line on that folder (the
equivalent command is written into the results). Its cost: the evaluation runs on one
device rather than sharded over the run's; it holds nothing else, the workers having
freed theirs.

Scores go into all_results.json as `benchmark/<task>/<metric>` (and `..._stderr`), next
to `eval_loss`; lm-eval's full results into benchmark_results.json; each task's scored
documents (per choice: log-likelihood, greedy or not) into benchmarks/<task>.jsonl.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import shlex
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from runner.config.errors import RunFailed, UserError
from runner.config.paths import asset_path
from runner.config.spec import EvalSpec, PeftKind, RunSpec
from runner.report.log import LOG_FILENAME

PREFIX = "benchmark/"
RESULTS_FILE = "benchmark_results.json"
SAMPLES_DIR = "benchmarks"
INSTALL = 'pip install "runner[eval]"'


def shipped_tasks() -> Path:
    """The tasks that ship with runner (austen_next): always on lm-eval's include path."""
    return asset_path("tasks")


@dataclass
class TaskRequest:
    """eval.tasks resolved: lm-eval task names, and the folders to index for them."""

    names: list[str] = field(default_factory=list)
    include: list[Path] = field(default_factory=lambda: [shipped_tasks()])
    problems: list[str] = field(default_factory=list)


def _yaml_task_name(path: Path) -> Optional[str]:
    """The `task:` of a task YAML file, read without resolving lm-eval's own tags (!function)."""
    import yaml

    class Lenient(yaml.SafeLoader):
        pass

    Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)
    loaded = yaml.load(path.read_text(), Loader=Lenient)
    name = loaded.get("task") if isinstance(loaded, dict) else None
    return name if isinstance(name, str) else None


def request(tasks: list[str]) -> TaskRequest:
    found = TaskRequest()
    for entry in tasks:
        if entry.endswith((".yaml", ".yml")):
            path = Path(entry).expanduser()
            if not path.is_file():
                found.problems.append(f"eval.tasks: {entry}: no such task file. Give an existing lm-eval task YAML, "
                                      "or a task name (for example austen_next, hellaswag).")
                continue
            try:
                name = _yaml_task_name(path)
            except Exception as err:  # noqa: BLE001 - any parse error is the file's
                found.problems.append(f"eval.tasks: {entry} is not a readable YAML file ({str(err).splitlines()[0]}).")
                continue
            if name is None:
                found.problems.append(f"eval.tasks: {entry} has no `task:` name: lm-eval needs one to run it.")
                continue
            found.names.append(name)
            found.include.append(path.resolve().parent)
        else:
            found.names.append(entry)
    return found


_MANAGERS: dict[tuple[str, ...], Any] = {}


def task_manager(include: list[Path]) -> Any:
    """lm-eval's index of tasks (its own and the included folders'): built once per process
    (indexing its thousands of task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    key = tuple(str(p) for p in include)
    if key not in _MANAGERS:
        with _quiet_lm_eval():
            _MANAGERS[key] = TaskManager(include_path=list(key), verbosity="ERROR")
    return _MANAGERS[key]


def check(spec: RunSpec) -> list[str]:
    """What would stop the benchmark evaluation, found before training starts."""
    wanted = spec.eval
    if not wanted.tasks:
        return []
    problems = []  # eval.*'s own values: runner/config/validate.py check_eval
    if spec.peft.kind is not PeftKind.none and not spec.peft.save_merged and spec.model.name_or_path is None:
        problems.append("eval.tasks with adapters on a model built from scratch: lm-eval loads the base by name, "
                        "and this one has none. Add peft.save_merged=true: model/ then holds the merged model it evaluates.")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return problems + [f"eval.tasks needs EleutherAI's lm-evaluation-harness, which is not installed: {INSTALL}."]
    asked = request(wanted.tasks)
    problems += asked.problems
    if asked.names:
        known = task_manager(asked.include).all_tasks
        for name in asked.names:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                problems.append(f"eval.tasks: {name} is not an lm-eval task (nor one of runner's: "
                                f"{', '.join(sorted(p.name for p in shipped_tasks().iterdir() if p.is_dir()))}).{hint}")
    return problems


def model_args(spec: RunSpec, run_dir: Path) -> dict[str, str]:
    """lm-eval's `--model_args` for the run's saved model: model/ when there is one (a full
    fine-tune, or adapters with peft.save_merged), else the adapter on its base."""
    merged = run_dir / "model"
    if (merged / "config.json").is_file():
        return {"pretrained": str(merged), "dtype": spec.eval.dtype}
    adapter = run_dir / "adapter"
    if (adapter / "adapter_config.json").is_file() and spec.model.name_or_path is not None:
        return {"pretrained": spec.model.name_or_path, "peft": str(adapter), "tokenizer": str(adapter),
                "dtype": spec.eval.dtype}
    raise FileNotFoundError(f"{run_dir} holds no saved model to evaluate (model/ or adapter/): "
                            "the run did not finish, or was a dry run.")


def device_for(wanted: EvalSpec) -> str:
    if wanted.device:
        return wanted.device
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def command_line(args: dict[str, str], asked: TaskRequest, wanted: EvalSpec, device: str) -> str:
    """The `lm_eval` command that computes the same scores."""
    words = ["lm_eval", "--model", "hf", "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
             "--tasks", ",".join(asked.names), "--include_path", ",".join(str(p) for p in asked.include),
             "--batch_size", str(wanted.batch_size), "--device", device]
    words += ["--num_fewshot", str(wanted.num_fewshot)] if wanted.num_fewshot is not None else []
    words += ["--limit", str(wanted.limit)] if wanted.limit is not None else []
    return shlex.join(words)


class _Noise(logging.Filter):
    """lm-eval warns once per request cut to the model's length (counted here, said once),
    and once per task read by a loader function, as runner's own austen_next is (dropped)."""

    LOGGERS = ("lm_eval.models.huggingface", "lm_eval.api.task")  # a logger's filter sees only its own records

    def __init__(self) -> None:
        super().__init__()
        self.truncated = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exceeds model's maximum length" in message:
            self.truncated += 1
            return False
        return "Custom kwargs can be passed" not in message

    def __enter__(self) -> "_Noise":
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


class _quiet_lm_eval:
    """lm-eval's INFO lines (each task's building, its caches) only at launch.debug's level."""

    def __enter__(self) -> "_quiet_lm_eval":
        self.logger = logging.getLogger("lm_eval")
        self.level = self.logger.level
        self.logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.setLevel(self.level)


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, Optional[float]]:
    """lm-eval's {"task": {"acc,none": x, "acc_stderr,none": s}} as
    {"benchmark/task/acc": x, "benchmark/task/acc_stderr": s}; a filter other than none
    is kept in the name (acc/strict-match)."""
    flat: dict[str, Optional[float]] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key:
                continue  # alias, sample counts
            metric, filtered = key.split(",", 1)
            name = metric if filtered == "none" else f"{metric}/{filtered}"
            number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            flat[f"{PREFIX}{task}/{name}"] = None if number is None or math.isnan(number) else float(number)
    return flat


def _write_json(path: Path, obj: Any) -> None:
    """Whole or not at all: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(partial, path)


def _samples(samples: dict[str, list[dict[str, Any]]], out: Path) -> None:
    out.mkdir(exist_ok=True)
    for task, docs in samples.items():
        lines = [json.dumps({"doc_id": d.get("doc_id"), "target": d.get("target"),
                             "scores": d.get("filtered_resps"), "metrics": {m: d.get(m) for m in d.get("metrics", [])}},
                            default=str) for d in docs]
        (out / f"{task}.jsonl").write_text("\n".join(lines) + "\n")


@dataclass
class Benchmarked:
    scores: dict[str, Optional[float]]
    seconds: float
    command: str
    device: str
    truncated: int


@contextmanager
def _accelerate_left_as_found() -> Iterator[None]:
    """lm-eval's HFLM builds an Accelerator, which fills Accelerate's process-wide state
    (with no mixed precision). The next run in this process (a sweep's next job) would be
    refused another precision: if the evaluation set that state up, forget it after."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    was_set = bool(AcceleratorState._shared_state or PartialState._shared_state)
    try:
        yield
    finally:
        if not was_set:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def evaluate(spec: RunSpec, run_dir: Path) -> Benchmarked:
    """Run eval.tasks on the run's saved model; add the scores to all_results.json."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    wanted = spec.eval
    asked = request(wanted.tasks)
    args, device = model_args(spec, run_dir), device_for(wanted)
    started = time.perf_counter()
    with _quiet_lm_eval(), _Noise() as noise, _accelerate_left_as_found():
        model = HFLM(**args, device=device, batch_size=wanted.batch_size)
        out = lm_eval.simple_evaluate(model=model, tasks=asked.names, task_manager=task_manager(asked.include),
                                      num_fewshot=wanted.num_fewshot, limit=wanted.limit,
                                      batch_size=wanted.batch_size, device=device, log_samples=True)
    seconds = time.perf_counter() - started
    done = Benchmarked(flat_scores(out["results"]), round(seconds, 3), command_line(args, asked, wanted, device),
                       device, noise.truncated)
    _write_json(run_dir / RESULTS_FILE, {key: out.get(key) for key in ("results", "groups", "versions", "n-shot",
                                                                          "higher_is_better", "n-samples")}
                | {"lm_eval_version": lm_eval.__version__, "command": done.command})
    _samples(out.get("samples") or {}, run_dir / SAMPLES_DIR)
    everything_path = run_dir / "all_results.json"
    everything = json.loads(everything_path.read_text()) if everything_path.is_file() else {}
    everything = {k: v for k, v in everything.items() if not k.startswith(PREFIX)}  # a new evaluation replaces the last
    everything.update(done.scores)
    everything["benchmark_seconds"] = done.seconds
    everything["benchmark_command"] = done.command
    _write_json(everything_path, everything)
    return done


def table(done: Benchmarked, run_dir: Path) -> str:
    """The scores, one row per task metric, its standard error beside it."""
    rows = [(key[len(PREFIX):].replace("/", " ", 1), value, done.scores.get(f"{key}_stderr"))
            for key, value in done.scores.items() if not key.endswith("_stderr")]
    width = max((len(label) for label, _, _ in rows), default=10)
    rule = "-" * (width + 22)
    lines = [f"runner: benchmarks (lm-eval, {done.device}, {done.seconds:,.1f} s)", rule]
    for label, value, err in rows:
        shown = "-" if value is None else f"{value:.4f}"
        lines.append(f"  {label:<{width}}   {shown:>8}" + ("" if err is None else f" ± {err:.4f}"))
    if done.truncated:
        lines.append(f"  note: {done.truncated:,} requests were cut from the left to the model's length")
    lines += [rule, f"  in {run_dir / 'all_results.json'}; the same with lm-eval: {done.command}"]
    return "\n".join(lines)


def evaluate_and_show(spec: RunSpec, run_dir: Path) -> Benchmarked:
    """evaluate, then the table on the console and at the end of run.log; a failure of
    lm-eval's own says that the run's outputs are safe, and how to evaluate again."""
    try:
        done = evaluate(spec, run_dir)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    except Exception as err:  # lm-eval's traceback, then one line
        traceback.print_exc()
        raise RunFailed(f"the benchmark evaluation failed ({type(err).__name__}); the run's outputs in {run_dir} "
                        f"are as they were: evaluate again with `runner eval {run_dir} eval.tasks=[...]`") from None
    shown = table(done, run_dir) + "\n"
    sys.stderr.write(shown)
    with open(run_dir / LOG_FILENAME, "a", encoding="utf-8") as handle:
        handle.write(shown)
    return done
