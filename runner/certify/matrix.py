"""`runner certify`: does each architecture train the same under every strategy?

For each model type (a tiny config, runner/certify/architectures.py, randomly initialised
once and saved with save_pretrained: every run starts from those weights, as from a
user's pretrained folder) and precision it runs, on the embedded data, dropout off:
- a reference: one process, 8 sequences a step, 12 steps over two epoch boundaries;
- each strategy (ddp, zero2, zero3, fsdp) at 2 processes x 4 sequences: the same global
  batch, so the same math. Each stops at an odd step mid-epoch (7), saving a checkpoint,
  and a new run resumes it (resume=auto) to step 12;
- with --peft lora (or dora), the same runs train adapters on the frozen initial weights,
  and adapter/ is loaded with peft instead of model/ with from_pretrained;
- with --reshard, each strategy's resume runs on 1 process x 8 under ddp instead: the
  checkpoint of 2 processes is read across (runner/train/reshard.py), a world-size and,
  but for ddp, a strategy change;
- with --objective dpo, every run optimises DPO's loss on the vendored preference pairs
  (data=austen_pref, 8 pairs a step, the last of an epoch 2): the reference log-probs
  scored once before training (precomputed), or with --peft the adapters switched off.

A cell is exact when every step's loss and gradient norm match the reference (fp32:
1e-4 and 0.1%, runner/report/parity.py), the resume logged each step once, and the
saved model/ loads with `from_pretrained` and gives the reference model's logits. bf16
is held to bf16's allowance (BF16_LAYOUT). A strategy that refuses the architecture
says why.

Start-up dominates such small runs, so every strategy's first leg runs in one launch of
two workers, one run after another (runner/launch/launcher.launch_in_turn), and every
resume in a second; a run that fails ends its launch, and the rest go on in a new one.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from runner.certify import architectures
from runner.certify.architectures import DEFAULT_ROWS, ROWS
from runner.config.errors import RunFailed, UserError
from runner.config.spec import RunSpec
from runner.launch.launcher import launch_in_turn
from runner.launch.start import claim, launch_failures, start
from runner.report.parity import (
    BF16_GRAD_NORM_RTOL,
    BF16_LOSS_ATOL,
    EQUAL_MATH,
    Tolerance,
    figure_problems,
    parity_problems,
    step_records,
)
from runner.train.rl_setup import COMPLETIONS_FILENAME

STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
PRECISIONS = ("fp32", "bf16")
PEFTS = ("none", "lora", "dora")
STEPS = 12
CUT = 7  # an odd step, mid-epoch (5 steps an epoch)
NPROC = 2
# 34 blocks of 32 tokens at a global batch of 8: 5 steps an epoch, the last of 2 blocks
# (at 2 x 4, rank 0's batch half fillers and rank 1's all: runner/components/data/epoch_batches.py),
# so 12 steps cross two epoch boundaries; the first leg's checkpoint (step 7) sits mid-epoch. A constant rate
# after warm-up: the first leg, planned for 7 steps, then takes the rates of the 12-step
# reference (a decaying schedule is planned over max_steps).
COMMON = ("recipe=gpt2_clm_tiny", "name=certify", "data.block_size=32", "data.max_train_samples=34",
          "data.max_eval_samples=16", "train.log_every=1", "train.eval_every=0", "schedule=constant",
          "schedule.warmup_steps=2", "tracking=none", "launch.timeout_minutes=5")
# bf16 at 2 x 4 sequences is not the reference's math at 1 x 8 even under one policy:
# autocast rounds each matmul's output to bf16, and another micro-batch shape sums in
# another order first, so a rounding can flip (measured under ddp, gpt2: loss 2e-4 apart
# by step 5). Every bf16 cell gets bf16's allowance, as a sweep gives bf16 jobs in two policies
# or layouts (runner/report/parity.py parity_tolerance).
BF16_LAYOUT = Tolerance(BF16_LOSS_ATOL, BF16_GRAD_NORM_RTOL,
                        "bf16 in another layout or policy rounds differently from the first step")
# Saved models of equal math give equal logits but for float rounding: measured up to
# 8.2e-6 in fp32 after 12 steps over the twelve rows (2,048-token vocabulary), so 1e-4
# leaves 12x. bf16's fp32 master weights drift by its rounding of each update:
# measured up to 7.3e-2 (mixtral), so 0.15; a model that did not train, or loaded other
# weights, is off by more than 1.
LOGITS_ATOL = {"fp32": 1e-4, "bf16": 0.15}
TOLERATED = ("exact", "within bf16 tolerance")  # the verdicts that pass
# GRPO's prompts: 7 seeded sums, 2 a step (8 completions, 4 a prompt), so an epoch ends
# mid-step (step 4), and each generation trains 2 steps: the first leg's checkpoint (step
# 7) sits mid-generation, and the resume trains on the generation batch it saved.
GRPO = ("objective=grpo", "data=arith", "data.max_train_samples=7", "data.max_eval_samples=4",
        "rl.num_generations=4", "rl.max_completion_length=8", "rl.steps_per_generation=2",
        "rl.rewards=[{kind:exact_match,column:answer,extract:last_number},{kind:contains,text:'1',name:has_one,weight:0.5}]")
# --objective: what each one adds to every run. DPO's pairs: 34 of them at 8 a step make
# the text rows' 5 steps an epoch, the last of 2 pairs; each pair's prompt is cut from its
# start to fit the 32-token blocks (data.too_long=truncate).
OBJECTIVES: dict[str, tuple[str, ...]] = {
    "causal_lm": (),
    "dpo": ("objective=dpo", "data=austen_pref", "data.too_long=truncate"),
    "grpo": GRPO,
    "rloo": ("objective=rloo", *GRPO[1:], "rl.num_generations=4"),  # RLOO's own beta 0.05: a frozen reference
}
# Each objective's logged figures held to the loss's allowance at every step, beside it.
# (rewards/accuracies is left out: at step 1 every reward is 0 up to the rounding of a
# forward of another shape, and which side of 0 it falls decides it.)
FIGURES: dict[str, tuple[str, ...]] = {
    "causal_lm": (),
    "dpo": ("rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected"),
    "grpo": ("reward", "reward_std", "entropy", "clip_ratio/region_mean"),
    "rloo": ("reward", "reward_std", "entropy", "clip_ratio/region_mean", "kl"),
}


@dataclass
class Cell:
    model_type: str
    precision: str
    strategy: str
    run_dir: Path
    model_dir: Path  # the initial weights
    verdict: str = ""  # empty while it is still to run
    detail: list[str] = field(default_factory=list)
    peft: str = "none"  # none: every weight trains; lora / dora: adapters on the frozen initial weights
    reshard: bool = False  # the resume runs on 1 process under ddp (RESHARD_TO)
    objective: str = "causal_lm"  # a key of OBJECTIVES

    @property
    def name(self) -> str:
        return (f"{self.model_type} {self.strategy} "
                f"{column_suffix(self.precision, self.peft, self.reshard, self.objective)}")


def column_suffix(precision: str, peft: str, reshard: bool = False, objective: str = "causal_lm") -> str:
    return " ".join([precision, *([objective] if objective != "causal_lm" else []),
                     *([peft] if peft != "none" else []), *(["-> ddp x1"] if reshard else [])])


# --reshard: where each strategy's checkpoint of 2 processes resumes (the same global batch)
RESHARD_TO = ["strategy=ddp", "launch.nproc_per_node=1", "train.per_device_batch_size=8"]


def save_initial_model(row: str, folder: Path) -> None:
    """The architecture's tiny config, randomly initialised once and saved with
    save_pretrained, its tokenizer in tokenizer/ (architectures.save_small_tokenizer): every run
    starts from these weights (model.name_or_path), as a user's pretrained model would, so
    a strategy that loads or shards them differently shows."""
    import torch
    from transformers import AutoModelForCausalLM

    from runner.components.model import build_config
    from runner.config.spec import ModelSpec

    architectures.save_small_tokenizer(folder / "tokenizer")  # apart: AutoTokenizer would go by the model's type
    torch.manual_seed(0)
    config = architectures.small_vocabulary(build_config(ModelSpec(model_type=architectures.model_type(row),
                                                                   config_overrides=architectures.tiny_config(row))))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)


def overrides(model_dir: Path, precision: str, strategy: Optional[str], peft: str = "none", row: str = "",
              objective: str = "causal_lm") -> list[str]:
    """The Hydra overrides of one run of `row`: the reference (strategy None) or a strategy's.
    With adapters, their dropout is off too (equal math) and the rate is an adapter's."""
    layout = ["train.per_device_batch_size=8", *architectures.reference_layout(row)] if strategy is None else [
        f"strategy={strategy}", f"launch.nproc_per_node={NPROC}", "train.per_device_batch_size=4"]
    adapters = [] if peft == "none" else [f"peft={peft}", "peft.dropout=0", "optim.lr=5e-3"]
    return [*COMMON, f"model.name_or_path={model_dir}", f"model.tokenizer_name={model_dir / 'tokenizer'}",
            "model.config_overrides=null", f"precision={precision}",
            *layout, *adapters, *OBJECTIVES[objective], *architectures.run_overrides(row)]


def compose(run_overrides: Sequence[str]) -> RunSpec:
    """The launcher's composition (only this process runs Hydra; workers read the frozen
    spec), once for a cell's two legs: a copy each, since a leg sets its own steps."""
    return copy.deepcopy(_composed(tuple(run_overrides)))


@functools.lru_cache(maxsize=None)
def _composed(run_overrides: tuple[str, ...]) -> RunSpec:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.config.paths import conf_dir
    from runner.config.spec import to_spec
    from runner.config.store import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return to_spec(hydra_compose("config", overrides=list(run_overrides)))


def leg_spec(cell: Cell, resume: bool) -> RunSpec:
    moved = [*RESHARD_TO, *architectures.reference_layout(cell.model_type)] if resume and cell.reshard else []
    spec = compose([*overrides(cell.model_dir, cell.precision, cell.strategy, cell.peft, cell.model_type,
                               cell.objective), *moved])
    spec.train.max_steps = STEPS if resume else CUT
    spec.train.save_every = CUT
    spec.resume = "auto" if resume else None
    return spec


def run_reference(model_dir: Path, precision: str, run_dir: Path, peft: str = "none", row: str = "",
                  objective: str = "causal_lm") -> Optional[str]:
    """The one-process run every strategy is held to, in this process; why it could not run, else None."""
    spec = compose(overrides(model_dir, precision, None, peft, row, objective))
    spec.train.max_steps = STEPS
    try:
        start(spec, run_dir, overwrite=True)
    except UserError as err:
        return "refused: " + " ".join(err.problems)
    except RunFailed as err:
        return f"failed: {err}"
    return None


def run_leg(cells: list[Cell], resume: bool) -> None:
    """One leg of every cell still to run, in as few launches as failures allow."""
    run_in_turn([(cell, leg_spec(cell, resume), cell.run_dir) for cell in cells], STEPS if resume else CUT,
                overwrite=not resume)


class Judged(Protocol):
    """What run_in_turn marks: a cell's verdict and why."""

    verdict: str
    detail: list[str]


def run_in_turn(runs: Sequence[tuple[Judged, RunSpec, Path]], step: int, overwrite: bool = True) -> None:
    """Each (cell, spec, run folder): claimed (a refusal marks its cell `refused`), then all
    launched one after another on one set of workers (the specs share their launch
    settings), in as few launches as failures allow: a failure marks its cell `failed`,
    ends its launch, and the rest go on in a new one. `step`: where a run that finished ends."""
    queued: list[tuple[Judged, RunSpec, Path]] = []
    for cell, spec, run_dir in runs:
        try:
            path = claim(spec, run_dir, overwrite=overwrite)
        except UserError as err:
            cell.verdict, cell.detail = "refused", list(err.problems)
            continue
        assert path is not None, "neither a dry run nor a finished run"
        queued.append((cell, spec, path))
    folders = {id(spec): run_dir for _, spec, run_dir in runs}
    while queued:  # each failure ends a launch, and the next starts past it: at most one launch a cell
        try:
            with launch_failures(queued[0][1], folders[id(queued[0][1])]):
                launch_in_turn(queued[0][1], [path for _, _, path in queued])
            return
        except RunFailed as err:  # a signal (SystemExit) stops certify itself
            index = next((i for i, (_, spec, _) in enumerate(queued) if not _finished(folders[id(spec)], step)), None)
            if index is None:  # every run had finished: the launch failed on its way out; judge them
                sys.stderr.write(f"runner certify: the launch failed after its last run: {err}\n")
                return
            queued[index][0].verdict, queued[index][0].detail = "failed", [str(err)]
            queued = queued[index + 1:]


def _finished(run_dir: Path, step: int) -> bool:
    results = run_dir / "all_results.json"
    return results.exists() and int(json.loads(results.read_text()).get("train_steps", step)) >= step


def sample_problems(reference: Path, run_dir: Path) -> list[str]:
    """Online RL: the run sampled exactly the reference's completions, each with its prompt
    and reward, its resume included (completions.jsonl: every generation batch). Its
    advantage is left to the loss's allowance: with a KL in the reward (RLOO's) it reads the
    policy's log-probs, which another layout rounds otherwise."""
    theirs = reference / COMPLETIONS_FILENAME
    if not theirs.exists():
        return []
    ours = run_dir / COMPLETIONS_FILENAME

    def samples(path: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in json.loads(line).items() if k != "advantage"} for line in path.read_text().splitlines()]

    if not ours.exists() or samples(ours) != samples(theirs):
        return [f"its {COMPLETIONS_FILENAME} does not hold the one process's samples, prompts and rewards"]
    return []


def judge(cell: Cell, reference: Path) -> None:
    """Exact / within tolerance / not exact, from the two runs' metrics and saved models."""
    tolerance = BF16_LAYOUT if cell.precision == "bf16" else EQUAL_MATH
    ours, theirs = step_records(cell.run_dir / "metrics.jsonl"), step_records(reference / "metrics.jsonl")
    problems = parity_problems(theirs, ours, tolerance.loss_atol, tolerance.grad_norm_rtol)
    if sorted(ours) != list(range(1, STEPS + 1)):
        problems.append(f"steps logged {sorted(ours)}, not 1-{STEPS} once each")
    problems += figure_problems(reference / "metrics.jsonl", cell.run_dir / "metrics.jsonl", FIGURES[cell.objective],
                                tolerance.loss_atol)
    if tolerance == EQUAL_MATH:  # bf16's rounding moves the weights, and with them a sample now and then
        problems += sample_problems(reference, cell.run_dir)
    if cell.peft == "none":
        problems += logits_problems(cell.run_dir / "model", reference / "model", LOGITS_ATOL[cell.precision])
    else:
        problems += adapter_problems(cell.run_dir / "adapter", reference / "adapter", cell.model_dir,
                                     LOGITS_ATOL[cell.precision])
    if problems:
        cell.verdict, cell.detail = "not exact", problems
    else:
        cell.verdict = "exact" if tolerance == EQUAL_MATH else "within bf16 tolerance"
        cell.detail = [tolerance.describe()]


def logits_problems(model_dir: Path, reference_dir: Path, atol: float) -> list[str]:
    """model/ loads with from_pretrained and gives the reference's logits on one fixed batch."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        ours = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    except Exception as err:  # whatever from_pretrained says of a bad save
        return [f"model/ does not load with from_pretrained: {err}"]
    theirs = AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (ours(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max().item()
    return [] if gap <= atol else [f"model/'s logits differ from the reference's by up to {gap:.2e} (allowed {atol:g})"]


def adapter_problems(adapter_dir: Path, reference_dir: Path, base_dir: Path, atol: float) -> list[str]:
    """adapter/ loads with peft onto the initial weights and gives the reference adapters'
    logits on one fixed batch; and the reference's adapters trained (an empty or
    untrained save would match an equally empty one)."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    def loaded(folder: Path) -> torch.nn.Module:
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), folder).eval()

    try:
        ours = loaded(adapter_dir)
    except Exception as err:  # whatever peft says of a bad save
        return [f"adapter/ does not load with PeftModel.from_pretrained: {err}"]
    reference_weights = load_file(reference_dir / "adapter_model.safetensors")
    if not any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in reference_weights.items()):
        return ["the reference's adapters did not train (every lora_B is zero)"]
    theirs = loaded(reference_dir)
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (ours(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max().item()
    return [] if gap <= atol else [f"adapter/'s logits differ from the reference's by up to {gap:.2e} (allowed {atol:g})"]


def certify(model_types: Sequence[str], precisions: Sequence[str], work_dir: Path,
            pefts: Sequence[str] = ("none",), reshard: bool = False, objective: str = "causal_lm") -> dict[str, list[Cell]]:
    """Every cell of the matrix: a row per model type, a column per strategy, precision and
    peft; every strategy's first legs in one launch, and every resume in a second."""
    rows: dict[str, list[Cell]] = {}
    references: dict[tuple[str, str, str], Path] = {}
    for model_type in model_types:
        model_dir = work_dir / model_type / "initial_model"
        save_initial_model(model_type, model_dir)
        for peft in pefts:
            for precision in precisions:
                column = column_suffix(precision, peft, reshard, objective).replace(" -> ", "_to_").replace(" ", "_")
                reference = work_dir / model_type / column / "reference"
                why = run_reference(model_dir, precision, reference, peft, model_type, objective)
                cells = [Cell(model_type, precision, s, work_dir / model_type / column / s, model_dir, peft=peft,
                              reshard=reshard, objective=objective) for s in STRATEGIES]
                for cell in cells:
                    if why:
                        cell.verdict, cell.detail = "no reference", [why]
                rows.setdefault(model_type, []).extend(cells)
                references[(model_type, precision, peft)] = reference
    pending = [c for cells in rows.values() for c in cells if not c.verdict]
    run_leg(pending, resume=False)
    run_leg([c for c in pending if not c.verdict], resume=True)
    for cell in pending:
        if not cell.verdict:
            judge(cell, references[(cell.model_type, cell.precision, cell.peft)])
    return rows


def render(rows: dict[str, list[Cell]], precisions: Sequence[str], command: str, pefts: Sequence[str] = ("none",),
           reshard: bool = False, objective: str = "causal_lm") -> str:
    """The matrix as Markdown: a row per architecture, a column per strategy, precision and
    peft, then each cell's reason where it is not exact."""
    columns = [(s, p, peft) for peft in pefts for p in precisions for s in STRATEGIES]
    lines = [f"Made by `{command}`.", "",
             "| architecture | " + " | ".join(f"{s} {column_suffix(p, peft, reshard, objective)}"
                                             for s, p, peft in columns) + " |",
             "|---|" + "---|" * len(columns)]
    notes = []
    for model_type, cells in rows.items():
        by_key = {(c.strategy, c.precision, c.peft): c for c in cells}
        lines.append(f"| {model_type} | " + " | ".join(by_key[k].verdict for k in columns) + " |")
        notes += [f"- {c.name}: {c.verdict}: {'; '.join(c.detail)}" for c in cells if c.verdict not in TOLERATED]
    if "bf16" in precisions:
        notes.insert(0, f"- bf16 is held to {BF16_LAYOUT.describe()}: {BF16_LAYOUT.why}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(args: argparse.Namespace) -> None:
    """The architecture x strategy matrices (runner/certify/command.py parses the arguments)."""
    model_types = args.model_types or list(DEFAULT_ROWS)
    unknown = [m for m in model_types if m not in ROWS]
    precisions = [p for p in args.precision.split(",") if p]
    pefts = [p for p in args.peft.split(",") if p]
    if unknown or not precisions or any(p not in PRECISIONS for p in precisions):
        raise UserError(
            (f"no tiny config for model type(s) {', '.join(unknown)}: choose from {', '.join(ROWS)} "
             "(runner/certify/architectures.py lists them)" if unknown else
             f"--precision {args.precision}: give fp32, bf16 or fp32,bf16"))
    if not pefts or any(p not in PEFTS for p in pefts):
        raise UserError(f"--peft {args.peft}: give {', '.join(PEFTS)}, or a list of them (none,lora)")
    rows = certify(model_types, precisions, args.work_dir, pefts, args.reshard, args.objective)
    shown = ["--precision", args.precision] if precisions != ["fp32"] else []
    shown += ["--objective", args.objective] if args.objective != "causal_lm" else []
    shown += ["--peft", args.peft] if args.peft != "none" else []
    shown += ["--reshard"] if args.reshard else []
    command = " ".join(["runner certify", *args.model_types, *shown])
    publish(render(rows, precisions, command, pefts, args.reshard, args.objective), args.out,
            all(c.verdict in (*TOLERATED, "refused") for cells in rows.values() for c in cells))


def publish(text: str, out: Optional[Path], passed: bool) -> None:
    """A certify table on stdout (and in `out`); exit 1 unless every cell `passed`."""
    sys.stdout.write("\n" + text)
    if out:
        out.write_text(text)
    if not passed:
        raise SystemExit(1)
