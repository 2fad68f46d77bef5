"""Which checkpoint a run resumes from, and whether the new spec may continue it.

Every setting of the spec is classified once (runner.train.resume_settings; a test
fails when a new field is in none): a change of one that breaks the math (model, data,
optimizer, the schedule's shape and peak, precision, strategy, seed) is refused; a change
of the horizon (the steps the schedule is planned over) is accepted and the schedule
planned again over the new total, saying how the rate moves (`schedule_note`); a
harmless one (cadence, kernels, memory and communication settings, where metrics go,
timeouts) is accepted and printed; bookkeeping (the folder, the name, how the resume
was asked for) is neither. The layout may change at the same global batch when the
position can continue at the exact sample. A run that is already finished is left
alone, and a resume from an older checkpoint of the folder sets the newer branch aside
rather than deleting it (`set_aside_newer_branch`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from runner.components.adapters import ADAPTER_DIRNAME, uses_adapters
from runner.components.data.stream import training_files, training_files_changes
from runner.components.objectives import reported_figures
from runner.components.optim import effective_lr, horizon_matters, planned_rate, warmup_steps
from runner.config.batch import global_batch
from runner.config.errors import UserError
from runner.config.spec import SPEC_FILENAME, RunSpec, flat_spec_dict, load_spec
from runner.report.metrics import evaluation_name
from runner.train.checkpoint import (
    CHECKPOINTS_DIRNAME,
    COMPLETE_MARKER,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    read_marker,
)
from runner.train.plan import batches_per_rank, steps_per_epoch, total_steps
from runner.train.reshard import needs_reshard, unsupported
from runner.train.resume_settings import BOOKKEEPING, HARMLESS, HORIZON, LAYOUT_KEYS
from runner.train.rng import random_state_file, read_random_states

ABANDONED_DIRNAME = "abandoned"  # a newer branch a resume from an older checkpoint set aside
# What a finished run leaves beside its checkpoints: set aside with its branch.
BRANCH_RESULTS = ("all_results.json", "train_results.json", "eval_results.json", "loss_curves.png", "model",
                  "adapter", "benchmark_results.json", "benchmarks")  # the last two: eval.tasks' scores of that model


def _layout(spec: RunSpec, world: int) -> tuple[int, int, int]:
    return world, spec.train.per_device_batch_size, spec.train.grad_accum_steps


def describe_layout_change(old: RunSpec, new: RunSpec, old_world: int, new_world: int) -> str:
    before, after = _layout(old, old_world), _layout(new, new_world)
    return f"{'x'.join(map(str, before))} -> {'x'.join(map(str, after))} (processes x per-device batch x accumulation)"


def layout_change_problems(old: RunSpec, new: RunSpec, old_world: int, new_world: int, marker: dict) -> list[str]:
    """Why a change of layout (processes x per-device batch x accumulation) at the same
    global batch cannot continue at the exact sample; empty when it can."""
    before, after = _layout(old, old_world), _layout(new, new_world)
    problems = []
    if needs_reshard(old.strategy.kind.value, new.strategy.kind.value, old_world, new_world):
        offload = any(o.value != "none" for spec in (old, new)
                      for o in (spec.strategy.offload_optimizer, spec.strategy.offload_params))
        why = unsupported(old.strategy.kind.value, new.strategy.kind.value, old_world, new.precision.kind.value,
                          offload)
        if why:
            problems.append(why)
    if before == after:
        return problems
    shown = describe_layout_change(old, new, old_world, new_world)
    if "samples_in_epoch" not in marker:
        problems.append(f"layout {shown}: this checkpoint predates sample-exact positions; resume it in its own layout")
    elif int(marker["samples_in_epoch"]) % (new_world * new.train.per_device_batch_size):
        problems.append(f"layout {shown}: the checkpoint's position ({marker['samples_in_epoch']} samples into the "
                        "epoch) is not a whole number of this layout's micro-batches")
    # An epoch's short last step is the same samples in every layout (fillers complete the
    # last round: runner/components/data/epoch_batches.py), so the sample count needs no check.
    return problems


def compare(
    old: RunSpec, new: RunSpec, old_world: int, new_world: int, marker: Optional[dict] = None,
) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between the checkpoint's spec and this one."""
    a, b = flat_spec_dict(old), flat_spec_dict(new)
    breaking, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or key in LAYOUT_KEYS or key in BOOKKEEPING:
            continue
        # a stream's loader workers each read their own files: their number is part of the order
        is_harmless = key in HARMLESS | HORIZON and not (key == "train.dataloader_num_workers" and old.data.streaming)
        (harmless if is_harmless else breaking).append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    old_batch, new_batch = global_batch(old.train, old_world), global_batch(new.train, new_world)
    if old_batch != new_batch:
        breaking.append(f"global batch: {old_batch} -> {new_batch}")
    elif old.data.streaming and _layout(old, old_world) != _layout(new, new_world):
        # a stream's position is each rank's own, in its own share, counted in its micro-batches
        breaking.append(f"layout {describe_layout_change(old, new, old_world, new_world)} of a stream "
                        "(each rank's position is in its own share of it)")
    else:
        problems = layout_change_problems(old, new, old_world, new_world, marker or {})
        breaking += problems
        if not problems and _layout(old, old_world) != _layout(new, new_world):
            harmless.append(f"layout {describe_layout_change(old, new, old_world, new_world)}, "
                            f"the same global batch of {new_batch}")
        if not problems and old.strategy.kind != new.strategy.kind:
            harmless.append(f"strategy {old.strategy.kind.value} -> {new.strategy.kind.value}: the checkpoint is read "
                            "across (weights, fp32 master and AdamW moments by parameter name)")
    return breaking, harmless


def resolve(spec: RunSpec, run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from (None: start fresh). Raises when one was named but
    cannot be used; never silently starts fresh when a usable one exists."""
    if spec.resume is None:
        return None
    if spec.resume != "auto":
        path = Path(spec.resume).expanduser().resolve()
        if not is_complete(path):
            raise UserError(not_a_checkpoint(spec.resume, path))
        return path
    return latest_checkpoint(run_dir)


def not_a_checkpoint(given: str, path: Path) -> str:
    """Why resume=PATH cannot be used, and what to pass instead: PATH missing, a run
    folder (or its checkpoints/) rather than one of its checkpoints, or an incomplete save."""
    how = "pass one of its checkpoints (resume=RUN_DIR/checkpoints/step_N), or resume=auto with hydra.run.dir=RUN_DIR"
    if not path.exists():
        where = "" if str(path) == given else f" ({path})"
        return f"resume={given}: no such folder{where}. To continue a run, {how}."
    run_dir = path.parent if path.name == CHECKPOINTS_DIRNAME else path
    if (run_dir / CHECKPOINTS_DIRNAME).is_dir() or (run_dir / SPEC_FILENAME).is_file():
        newest = latest_checkpoint(run_dir)
        which = f"resume={newest} (its newest)" if newest else "one of its checkpoints (it holds no complete one yet)"
        return (f"resume={given} is a run folder, not a checkpoint: pass {which}, or continue the run with "
                f"resume=auto hydra.run.dir={run_dir}.")
    return (f"resume={given}: not a complete checkpoint (no {COMPLETE_MARKER} in it: an interrupted save, or not a "
            f"checkpoint). To continue a run, {how}.")


def describe_fresh_start(run_dir: Path) -> str:
    partial = sorted((run_dir / CHECKPOINTS_DIRNAME).glob(".tmp_step_*")) if (run_dir / CHECKPOINTS_DIRNAME).is_dir() else []
    if partial:
        return f"resume=auto: no complete checkpoint in {run_dir} (only an interrupted save, {partial[-1].name}); starting fresh."
    return f"resume=auto: no checkpoint in {run_dir}; starting fresh."


@dataclass
class ResumePlan:
    """What the launcher does about resume=...: the checkpoint (None: start fresh), the
    notes to print, and `finished`, the message for a run with nothing left to do."""

    checkpoint: Optional[Path] = None
    notes: list[str] = field(default_factory=list)
    marker: dict[str, Any] = field(default_factory=dict)
    finished: Optional[str] = None


def data_changes(spec: RunSpec, marker: dict[str, Any], data_key: Optional[str]) -> tuple[list[str], list[str]]:
    """(breaking, harmless): the data a checkpoint's position indexes against today's.
    Checkpoints from before these were recorded carry neither, and are not checked."""
    if spec.data.streaming and "data_files" in marker:
        return training_files_changes(marker["data_files"], training_files(spec.data))
    if not spec.data.streaming and data_key and marker.get("data_key", data_key) != data_key:
        return [f"the training data: its tokenized blocks differ from the checkpoint's (cache key {marker['data_key']} "
                f"-> {data_key}: a file's content, the tokenizer or the block size changed), and the position is a "
                "sample of the blocks as they were. Restore the data, or start a new run folder"], []
    return [], []


def check_resume(
    spec: RunSpec, run_dir: Path, world_size: int, train_samples: Optional[int] = None, data_key: Optional[str] = None,
) -> ResumePlan:
    """Launcher-side: the checkpoint and notes to print, or a UserError naming what changed."""
    path = resolve(spec, run_dir)
    if path is None:
        return ResumePlan(notes=[describe_fresh_start(run_dir)] if spec.resume == "auto" else [])
    saved_spec = path / SPEC_FILENAME
    if not saved_spec.is_file():
        raise UserError(f"checkpoint {path} has no {SPEC_FILENAME}; it cannot be checked against this run.")
    try:
        old = load_spec(saved_spec)
    except Exception as err:
        raise UserError(f"checkpoint {path}: its {SPEC_FILENAME} is unreadable ({err}).") from None

    marker = read_marker(path)
    breaking, harmless = compare(old, spec, int(marker.get("world_size", world_size)), world_size, marker)
    changed, named = data_changes(spec, marker, data_key)
    breaking, harmless = breaking + changed, harmless + named
    if breaking:
        raise UserError(
            f"cannot resume {path}: these changes would break the run's math: {'; '.join(breaking)}. "
            "Undo them, or start a new run folder."
        )
    old_world = int(marker.get("world_size", world_size))
    for file in sorted({random_state_file(path, rank, old_world) for rank in range(world_size)}):
        read_random_states(file)  # a missing or torn one is named now, not found by one rank mid-start
    notes = [f"resuming from {path} (step {marker.get('step')})"]
    notes += [f"resume: accepted change {h}" for h in harmless]
    old_total = marker.get("total_steps") or planned_total_steps(old, old_world, train_samples, marker)
    replanned = schedule_note(spec, old_total, planned_total_steps(spec, world_size, train_samples, marker),
                              int(marker["step"]), global_batch(spec.train, world_size))
    notes += [replanned] if replanned else []
    return ResumePlan(path, notes, marker, finished_message(spec, run_dir, path, marker, world_size, train_samples))


def schedule_note(spec: RunSpec, old_total: Optional[int], new_total: Optional[int], step: int,
                  batch: int) -> Optional[str]:
    """How the rate moves when a resume plans the schedule over another total (a HORIZON
    change): the rate the first resumed step trains at by the new plan, against the old
    plan's, and where the new plan ends. None when no rate moves, or no step is left."""
    if old_total is None or new_total is None or old_total == new_total or new_total <= step:
        return None
    schedule = spec.schedule
    if not horizon_matters(schedule, old_total, new_total):
        return None
    lr = effective_lr(spec.optim, batch)
    before, now = warmup_steps(schedule, old_total), warmup_steps(schedule, new_total)
    warmup = f"{now} warmup steps" + (f" (were {before})" if now != before else "")
    return (f"resume: the {schedule.kind.value} schedule is planned again over {new_total} steps (was {old_total}; "
            f"{warmup}): step {step + 1} trains at lr {planned_rate(schedule, lr, new_total, step):.4g}, where the "
            f"old plan had {planned_rate(schedule, lr, old_total, step):.4g}, and the rate follows the new plan to "
            f"{planned_rate(schedule, lr, new_total, new_total - 1):.4g} at step {new_total}")


def planned_total_steps(spec: RunSpec, world_size: int, train_samples: Optional[int], marker: dict[str, Any]) -> Optional[int]:
    """The step this spec trains to, as the worker will plan it (None: unknown here)."""
    t = spec.train
    if t.max_steps is not None:
        return t.max_steps
    if train_samples is not None:
        per_epoch = steps_per_epoch(batches_per_rank(train_samples, t.per_device_batch_size, world_size), t.grad_accum_steps)
    elif "steps_per_epoch" in marker:
        per_epoch = int(marker["steps_per_epoch"])  # the same global batch, the same samples
    else:
        return None
    return total_steps(None, t.num_epochs, per_epoch)


def _results_step(run_dir: Path) -> Optional[int]:
    """The step the folder's all_results.json was written at (None: no readable results)."""
    try:
        return int(json.loads((run_dir / "all_results.json").read_text())["train_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished_message(spec: RunSpec, run_dir: Path, checkpoint: Path, marker: dict[str, Any], world_size: int,
                     train_samples: Optional[int]) -> Optional[str]:
    """Why there is nothing to do, when this folder's run already ended at its newest
    checkpoint and this spec asks for no more steps (a requeued Slurm job that always
    passes resume=auto); None when there is training (or a final evaluation) left."""
    if checkpoint.parent != run_dir / CHECKPOINTS_DIRNAME or checkpoint != latest_checkpoint(run_dir):
        return None
    step, total = int(marker["step"]), planned_total_steps(spec, world_size, train_samples, marker)
    if total is None or step < total or _results_step(run_dir) != step:
        return None  # more steps to take, or the results were never written (a kill after the last save)
    if not all(p.is_dir() for p in output_folders(spec, run_dir)):
        return None  # the model was removed since: the worker writes it again, and nothing else
    past = "" if step == total else f" (past this spec's {total})"
    return (f"the run in {run_dir} is finished: step {step}{past}, results in all_results.json. Nothing to do; "
            "every file is left as it was. To train further, raise train.max_steps (or train.num_epochs) with resume=auto.")


def _set_aside(run_dir: Path, name: str, checkpoints: list[Path], results: list[Path]) -> tuple[Path, list[str]]:
    """Move a branch's checkpoints and results to abandoned/<name>_<time>/, with copies of
    its metrics and of the spec it ran (this launch writes over the folder's
    run_spec.yaml); (that folder, what went there)."""
    aside = run_dir / ABANDONED_DIRNAME / f"{name}_{time.strftime('%Y%m%dT%H%M%S')}"
    while aside.exists():  # two resumes within a second
        aside = aside.with_name(aside.name + "_")
    (aside / CHECKPOINTS_DIRNAME).mkdir(parents=True)
    for path in checkpoints:
        path.rename(aside / CHECKPOINTS_DIRNAME / path.name)
    for path in results:
        path.rename(aside / path.name)
    moved = [p.name for p in checkpoints] + [p.name for p in results]
    for record in ("metrics.jsonl", SPEC_FILENAME):
        if (run_dir / record).exists():
            shutil.copy2(run_dir / record, aside / record)
            moved.append(f"a copy of {record}")
    return aside, moved


def in_set_aside_branch(run_dir: Path, checkpoint: Path) -> bool:
    """Whether `checkpoint` is one of a branch this folder set aside (abandoned/X/checkpoints/step_N)."""
    parts = checkpoint.resolve().relative_to(run_dir.resolve()).parts
    return len(parts) == 4 and parts[0] == ABANDONED_DIRNAME and parts[2] == CHECKPOINTS_DIRNAME


def start_branch(run_dir: Path, checkpoint: Path, step: int) -> tuple[Path, Optional[str]]:
    """Before resuming from a checkpoint of this folder: the checkpoint to load (moved,
    when it was set aside) and the note to print, or None when nothing moved."""
    if in_set_aside_branch(run_dir, checkpoint):
        return return_to_branch(run_dir, checkpoint, step)
    return checkpoint, set_aside_newer_branch(run_dir, checkpoint, step)


def return_to_branch(run_dir: Path, checkpoint: Path, step: int) -> tuple[Path, str]:
    """Going back to a set-aside branch: the folder's current branch (every checkpoint,
    its results and a copy of metrics.jsonl) goes under abandoned/ whole, since which of
    its checkpoints the old branch shares is not recorded; the old branch's checkpoints
    up to `step` come back into checkpoints/, and its metrics.jsonl replaces the folder's
    (the worker cuts it back to `step`). Its later checkpoints and results stay where
    they are, a branch of their own. Nothing is deleted or written over."""
    run_dir, branch = run_dir.resolve(), checkpoint.resolve().parent.parent
    current = complete_checkpoints(run_dir)
    results = [run_dir / n for n in BRANCH_RESULTS if (run_dir / n).exists()]
    newest = max([int(p.name[5:]) for p in current] + [_results_step(run_dir) or 0])
    aside, moved = _set_aside(run_dir, f"until_step_{newest}", current, results)
    back = [p for p in complete_checkpoints(branch) if int(p.name[5:]) <= step]
    (run_dir / CHECKPOINTS_DIRNAME).mkdir(exist_ok=True)
    for path in back:
        path.rename(run_dir / CHECKPOINTS_DIRNAME / path.name)
    if (branch / "metrics.jsonl").exists():  # that branch's own lines, not the one just set aside
        shutil.copy2(branch / "metrics.jsonl", run_dir / "metrics.jsonl")
    note = (f"resume: {checkpoint.name} is in the set-aside branch {branch}; set the current branch aside in {aside}"
            f"{': ' + ', '.join(moved) if moved else ''}; moved {', '.join(p.name for p in back)} back into "
            f"{CHECKPOINTS_DIRNAME}/ and continue that branch")
    return run_dir / CHECKPOINTS_DIRNAME / checkpoint.name, note


def set_aside_newer_branch(run_dir: Path, checkpoint: Path, step: int) -> Optional[str]:
    """Resuming from an older checkpoint of this folder starts a new branch: move the
    newer checkpoints, and the results written after `step`, under abandoned/ (never
    deleted: pruning would otherwise remove the new branch's first checkpoint, and
    resume=auto would continue the old one). Returns the note to print, or None."""
    newer = [p for p in complete_checkpoints(run_dir) if int(p.name[5:]) > step]
    results_step = _results_step(run_dir)
    results = [run_dir / n for n in BRANCH_RESULTS if (run_dir / n).exists()] if (results_step or 0) > step else []
    if checkpoint.parent != run_dir / CHECKPOINTS_DIRNAME or not (newer or results):
        return None
    aside, moved = _set_aside(run_dir, f"after_step_{step}", newer, results)  # the worker cuts metrics.jsonl to `step`
    newest = f"newest checkpoint ({newer[-1].name})" if newer else f"results (step {results_step})"
    return f"resume: {checkpoint.name} is older than this folder's {newest}; set the newer branch aside in {aside}: {', '.join(moved)}"


@dataclass
class Recorded:
    """What a resume that runs no step (at its last step: a restart after the final
    checkpoint, or a run finished off) finds already written for that step, so it is not
    done again: the final evaluation, the results, the model."""

    evaluation: Optional[dict[str, Any]] = None  # reused rather than run again
    source: str = ""  # the file it came from
    results: bool = False  # all_results.json was written at this step
    outputs: bool = False  # and model/ (or adapter/) before it: complete

    def note(self, step: int) -> Optional[str]:
        if self.results and self.outputs:
            return f"resume: step {step} is this run's last and its results and model are written: nothing to redo"
        if self.evaluation is None:
            return None
        return (f"resume: step {step}'s final evaluation is recorded in {self.source} (eval_loss "
                f"{self.evaluation['eval_loss']:.4f}): reused, not run again")


def output_folders(spec: RunSpec, run_dir: Path) -> list[Path]:
    """What the end of a run writes beside its results (runner/train/finish.py, save_outputs): model/, or
    adapter/ and, with peft.save_merged, model/ too."""
    if not uses_adapters(spec.peft):
        return [run_dir / "model"]
    return [run_dir / ADAPTER_DIRNAME] + ([run_dir / "model"] if spec.peft.save_merged else [])


def recorded_at_end(run_dir: Path, step: int, checkpoint_spec: RunSpec, spec: RunSpec, eval_samples: int) -> Recorded:
    """What this folder already holds for `step`, the last step of a resume that runs none.

    Results count only when all_results.json names this step (written after model/, so
    that is complete then). The final evaluation is reused from eval_results.json beside
    them, else from metrics.jsonl's evaluation line at this step (logged before a kill
    could stop the results), when the evaluation data is the checkpoint's
    (data.max_eval_samples may change on a resume)."""
    results = _results_step(run_dir) == step
    found = Recorded(results=results, outputs=results and all(p.is_dir() for p in output_folders(spec, run_dir)))
    if checkpoint_spec.data.max_eval_samples != spec.data.max_eval_samples:
        return found
    if results:
        try:
            found.evaluation, found.source = dict(json.loads((run_dir / "eval_results.json").read_text())), "eval_results.json"
            return found
        except (OSError, ValueError, TypeError):
            pass
    row = _logged_evaluation(run_dir / "metrics.jsonl", step, reported_figures(spec.train.objective))
    if row is not None:
        found.evaluation = {**row, "eval_samples": eval_samples, "eval_runtime": None, "eval_samples_per_second": None}
        found.source = "metrics.jsonl"
    return found


def _logged_evaluation(path: Path, step: int, keys: Sequence[str]) -> Optional[dict[str, float]]:
    """The last evaluation metrics.jsonl logged at `step`: the objective's figures (`keys`)."""
    found = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by kill -9 mid-write
            continue
        # An evaluation line names its figures as the trackers see them (eval_rewards/...).
        if isinstance(row, dict) and row.get("step") == step and all(evaluation_name(k) in row for k in keys):
            found = {k: row[evaluation_name(k)] for k in keys}
    return found
