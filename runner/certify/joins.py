"""`runner certify --joins`: where features meet, certified by construction.

Every feature is proven alone elsewhere; defects live where two meet (a mixture of
preference sources and the precomputed reference, a mixture of experts and DPO, ZeRO's
bf16 module and the saved config). The features are factors (FACTORS) and the cells a
pairwise covering array of them (runner/certify/pairwise.py): every pair of values that
can meet does, in one cell at least, in some twenty cells instead of 768. The array is
generated, so a new value of a factor (the next objective) joins every pair by itself.

Each cell runs three legs on the tiny models and data of `runner certify` (34 rows at 8 a
step: 5 steps an epoch, its last of 2 rows; 12 steps, dropout off):
- one process (8 rows a step; a mixture of experts 4 x 2), logged every step;
- the cell's strategy at 2 processes x 4, logged every step, a checkpoint at step 7 (odd,
  mid-epoch);
- that checkpoint resumed on 1 process x 4 x 2 accumulation under ddp (another world size,
  a strategy read across), logged every 3 steps,
and holds them to the invariants that hold everywhere:
- with dropout off, a fresh preference run's step 1 is log 2 with zero rewards;
- 2 processes equal one process at every step, over an epoch end that does not divide;
- the resume on another world size equals the uninterrupted run;
- the saved model/ (or adapter/ on its base) reloads with dtype="auto" in the run's weights'
  dtype (fp32 under every precision) and gives the one process's logits;
- train_loss does not depend on train.log_every (the resumed leg's windows hold an
  epoch's short last step).
All first legs share one launch, all second legs one of 2 workers, all resumes a third. A
cell a combination cannot run is refused in one line and listed as refused; the pairs only
it held are listed as left uncovered.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from runner.certify import matrix
from runner.certify.pairwise import Cell, covering_array, pairs_of, uncovered_pairs
from runner.config.paths import asset_path
from runner.config.spec import RunSpec
from runner.report.parity import BF16_LOSS_ATOL, EQUAL_MATH, figure_problems, parity_problems, step_records

FACTORS: dict[str, tuple[str, ...]] = {
    "objective": ("causal_lm", "sft", "dpo", "grpo"),
    "data": ("one", "mixture"),
    "packing": ("off", "on"),
    "peft": ("none", "lora"),
    "reference": ("precomputed", "frozen", "adapter_off"),
    "model": ("gpt2", "llama", "mixtral_router"),  # the last: a mixture of experts with its router loss on
    "strategy": matrix.STRATEGIES,
    "precision": matrix.PRECISIONS,
}
RESUME_LOG_EVERY = 3  # the resumed leg's windows: 8-9 and 10-12, the latter holding the epoch's short step 10
# Where the 2-process checkpoint resumes: one process under ddp, 4 rows x 2 accumulation (the
# same global batch), so the epoch's short last step is one micro-batch where the others are two.
MOVED_TO = ["strategy=ddp", "launch.nproc_per_node=1", "train.per_device_batch_size=4", "train.grad_accum_steps=2"]


def applies(cell: Cell) -> bool:
    """Which combinations are a run: a reference mode is DPO's alone, adapter_off needs
    adapters, and run_clm's text blocks are packed by construction (data.packing is for
    examples)."""
    if any(cell[name] is None for name in FACTORS if name != "reference"):
        return False
    dpo = cell["objective"] == "dpo"
    if (cell["reference"] is not None) != dpo:
        return False
    if cell["reference"] == "adapter_off" and cell["peft"] == "none":
        return False
    if cell["objective"] == "grpo" and cell["precision"] == "bf16":
        # bf16 rounds another layout's update otherwise; once a weight crosses a sampling
        # boundary the samples part, and then everything after them (measured: a LoRA fsdp
        # cell's generation at step 9). Online RL's layouts are held in fp32, where its samples
        # are the same to the byte; bf16 trains it (the GPU check's GRPO case), alike only within a layout.
        return False
    # run_clm's text blocks are packed by construction; online RL's rows are its generations
    return not (cell["packing"] == "on" and cell["objective"] in ("causal_lm", "grpo"))


@dataclass
class Join:
    """One cell of the array, its three runs and its verdict."""

    values: Cell
    root: Path
    verdict: str = ""
    detail: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return " ".join(value for value in self.values.values() if value is not None)

    def leg(self, which: str) -> Path:
        return self.root / which

    @property
    def folder(self) -> str:
        return "_".join(value for value in self.values.values() if value is not None)


# ------------------------------------------------------------------ data
def write_sources(folder: Path) -> None:
    """Two sources of each format for the mixtures, cut from the vendored files: the novels'
    text in two halves; instruction examples and preference pairs, the second source's
    records in reverse order (so each source's row 0 is another record)."""
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(asset_path("austen.txt.gz"), "rt") as handle:
        lines = [next(handle) for _ in range(1600)]
    (folder / "novels_a.txt").write_text("".join(lines[:800]))
    (folder / "novels_b.txt").write_text("".join(lines[800:]))
    for name, asset in (("sft", "austen_sft.jsonl.gz"), ("pref", "austen_pref.jsonl.gz"), ("arith", "arith.jsonl.gz")):
        with gzip.open(asset_path(asset), "rt") as handle:
            records = [next(handle) for _ in range(240)]
        (folder / f"{name}_a.jsonl").write_text("".join(records[:120]))
        (folder / f"{name}_b.jsonl").write_text("".join(reversed(records[120:])))


def _mixture(sources: Sequence[tuple[str, Path, str]]) -> str:
    items = ",".join(f"{{name:{name},train_file:'{path}',format:{fmt},weight:0.5}}" for name, path, fmt in sources)
    return f"data.mixture=[{items}]"


def data_overrides(values: Cell, sources: Path) -> list[str]:
    objective, mixture, packed = values["objective"], values["data"] == "mixture", values["packing"] == "on"
    if objective == "causal_lm":
        if not mixture:
            return []  # the tiny recipe's novels
        return ["data.train_file=null", _mixture([(f"novels_{s}", sources / f"novels_{s}.txt", "text") for s in "ab"])]
    if objective == "grpo":  # runner certify --objective grpo's prompts, generations and rewards
        return [*matrix.GRPO, *(["data.train_file=null", "data.validation_split_percentage=50",
                                 _mixture([(f"arith_{s}", sources / f"arith_{s}.jsonl", "prompts") for s in "ab"])]
                                if mixture else [])]
    fmt, data, stem = (("prompt_completion", "austen_sft", "sft") if objective == "sft" else
                       ("preference", "austen_pref", "pref"))
    chosen = [f"data={data}", "data.too_long=truncate", f"data.packing={str(packed).lower()}"]
    if objective == "dpo":
        chosen += ["objective=dpo", f"preference.reference={values['reference']}"]
    if mixture:
        chosen += ["data.train_file=null", f"data.format={fmt}",
                   _mixture([(f"{stem}_{s}", sources / f"{stem}_{s}.jsonl", fmt) for s in "ab"])]
    return chosen


# ------------------------------------------------------------------ the legs
def leg_overrides(join: Join, model_dir: Path, sources: Path, which: str, cache: Path) -> list[str]:
    values, row = join.values, str(join.values["model"])
    layout = {"one": [*matrix.RESHARD_TO, *matrix.architectures.reference_layout(row)],
              "two": [f"strategy={values['strategy']}", f"launch.nproc_per_node={matrix.NPROC}",
                      "train.per_device_batch_size=4"],
              "moved": MOVED_TO}[which]
    adapters = [] if values["peft"] == "none" else [f"peft={values['peft']}", "peft.dropout=0", "optim.lr=5e-3"]
    return [*matrix.COMMON, f"model.name_or_path={model_dir}", f"model.tokenizer_name={model_dir / 'tokenizer'}",
            "model.config_overrides=null", f"precision={values['precision']}", f"data.cache_dir={cache}",
            *layout, *adapters, *data_overrides(values, sources)]


def leg_spec(join: Join, model_dir: Path, sources: Path, which: str, cache: Path) -> RunSpec:
    spec = matrix.compose(leg_overrides(join, model_dir, sources, which, cache))
    spec.train.max_steps = matrix.STEPS
    if which == "two":
        spec.train.save_every = matrix.CUT
    if which == "moved":
        spec.resume = str(join.leg("two") / "checkpoints" / f"step_{matrix.CUT}")
        spec.train.log_every = RESUME_LOG_EVERY
    return spec


# ------------------------------------------------------------------ the invariants
def _tolerance(join: Join) -> matrix.Tolerance:
    return matrix.BF16_LAYOUT if join.values["precision"] == "bf16" else EQUAL_MATH


def first_step_problems(join: Join) -> list[str]:
    """A fresh preference run's step 1: the policy is the reference (dropout off), so the
    loss is log 2 and the rewards are 0 (a reference-based loss: every mode here)."""
    if join.values["objective"] != "dpo":
        return []
    first = step_rows(join.leg("one"))[1]
    atol = BF16_LOSS_ATOL if join.values["precision"] == "bf16" else 1e-5
    problems = []
    router = router_coefficient(str(join.values["model"])) * first.get("aux_loss", 0.0)  # a mixture of experts adds it
    if abs(first["loss"] - router - math.log(2)) > atol:
        problems.append(f"step 1 loss {first['loss']:.6f} less the router term {router:.6f}, not log 2 "
                        f"(allowed {atol:g})")
    for name in ("rewards/margins", "rewards/chosen", "rewards/rejected"):
        if abs(first[name]) > max(atol, 1e-4):
            problems.append(f"step 1 {name} {first[name]:.3g}, not 0")
    return problems


def router_coefficient(row: str) -> float:
    """The row's router_aux_loss_coef when its tiny config returns router logits, else 0."""
    settings = dict(item.split("=", 1) for item in matrix.architectures.tiny_config(row).split(","))
    return float(settings.get("router_aux_loss_coef", 0)) if settings.get("output_router_logits") == "True" else 0.0


def step_rows(run_dir: Path) -> dict[int, dict]:
    rows = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {int(r["step"]): r for r in rows if "loss" in r}


def layout_problems(join: Join) -> list[str]:
    """2 processes against one, every step, the objective's figures too."""
    tolerance = _tolerance(join)
    one, two = step_records(join.leg("one") / "metrics.jsonl"), step_records(join.leg("two") / "metrics.jsonl")
    problems = parity_problems(one, two, tolerance.loss_atol, tolerance.grad_norm_rtol)
    if sorted(two) != list(range(1, matrix.STEPS + 1)):
        problems.append(f"2 processes logged steps {sorted(two)}, not 1-{matrix.STEPS} once each")
    figures = matrix.FIGURES.get(str(join.values["objective"]), ())
    if tolerance == EQUAL_MATH:  # online RL: the same samples, to the byte
        problems += matrix.sample_problems(join.leg("one"), join.leg("two"))
    return problems + figure_problems(join.leg("one") / "metrics.jsonl", join.leg("two") / "metrics.jsonl", figures,
                                      tolerance.loss_atol)


def resume_problems(join: Join) -> list[str]:
    """The resume on 1 process: each window the mean of the uninterrupted steps it holds,
    its last step's gradient norm, and train_loss the one process's mean of every step."""
    tolerance = _tolerance(join)
    one, moved = step_rows(join.leg("one")), step_rows(join.leg("moved"))
    problems = []
    expected = list(range(matrix.CUT + RESUME_LOG_EVERY - (matrix.CUT % RESUME_LOG_EVERY), matrix.STEPS + 1,
                          RESUME_LOG_EVERY))
    if sorted(moved) != expected:
        return [f"the resume logged steps {sorted(moved)}, not {expected}"]
    start = matrix.CUT + 1
    for step in expected:
        mean = sum(one[s]["loss"] for s in range(start, step + 1)) / (step + 1 - start)
        if abs(moved[step]["loss"] - mean) > tolerance.loss_atol:
            problems.append(f"resumed window {start}-{step}: loss {moved[step]['loss']:.6f} vs the steps' mean "
                            f"{mean:.6f} (allowed {tolerance.loss_atol:g})")
        a, b = one[step].get("grad_norm"), moved[step].get("grad_norm")
        if a is None or b is None or abs(a - b) > tolerance.grad_norm_rtol * abs(a):
            problems.append(f"resumed step {step}: grad_norm {b} vs {a}")
        start = step + 1
    results = [json.loads((join.leg(leg) / "all_results.json").read_text()) for leg in ("one", "moved")]
    if abs(results[0]["train_loss"] - results[1]["train_loss"]) > tolerance.loss_atol:
        problems.append(f"train_loss {results[1]['train_loss']:.6f} logged every {RESUME_LOG_EVERY} after the resume "
                        f"vs {results[0]['train_loss']:.6f} logged every step")
    return problems


def reload_problems(join: Join, model_dir: Path) -> list[str]:
    """The 2-process run's saved model (adapter/ on its base) loaded with dtype="auto": the
    weights' dtype (fp32, bf16 being autocast over them) and the one process's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    atol = matrix.LOGITS_ATOL[str(join.values["precision"])]

    def load(run_dir: Path) -> torch.nn.Module:
        if join.values["peft"] == "none":
            return AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype="auto").eval()
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        return PeftModel.from_pretrained(base, run_dir / "adapter").eval()

    try:
        ours = load(join.leg("two"))
    except Exception as err:  # whatever transformers or peft say of a bad save
        return [f"the saved model does not load: {err}"]
    dtype = next(ours.parameters()).dtype
    problems = [] if dtype == torch.float32 else [f"dtype=\"auto\" loads {dtype}, the weights written are fp32"]
    theirs = load(join.leg("one"))
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (ours(input_ids=ids).logits.float() - theirs(input_ids=ids).logits.float()).abs().max().item()
    if gap > atol:
        problems.append(f"the reloaded logits differ from one process's by up to {gap:.2e} (allowed {atol:g})")
    return problems


def judge(join: Join, model_dir: Path) -> None:
    problems = (first_step_problems(join) + layout_problems(join) + resume_problems(join)
                + reload_problems(join, model_dir))
    if problems:
        join.verdict, join.detail = "not exact", problems
    else:
        tolerance = _tolerance(join)
        join.verdict = "exact" if tolerance == EQUAL_MATH else "within bf16 tolerance"
        join.detail = [tolerance.describe()]


# ------------------------------------------------------------------ the run
def cells() -> list[Cell]:
    return covering_array(FACTORS, applies)


def certify_joins(work_dir: Path) -> list[Join]:
    """Every cell of the array, its legs in three launches, judged."""
    sources, cache = work_dir / "sources", work_dir / "cache"
    write_sources(sources)
    joins = [Join(values, work_dir / "cells" / f"{index:02d}_{Join(values, work_dir).folder}")
             for index, values in enumerate(cells())]
    models: dict[str, Path] = {}
    for row in dict.fromkeys(str(j.values["model"]) for j in joins):
        models[row] = work_dir / "models" / row
        matrix.save_initial_model(row, models[row])
    for which in ("one", "two", "moved"):
        pending = [j for j in joins if not j.verdict]
        matrix.run_in_turn([(j, leg_spec(j, models[str(j.values["model"])], sources, which, cache), j.leg(which))
                            for j in pending], matrix.STEPS, overwrite=which != "moved")
    for join in joins:
        if not join.verdict:
            judge(join, models[str(join.values["model"])])
    return joins


def render(joins: Sequence[Join], command: str) -> str:
    """The array as Markdown: a row per cell, its factors' values and its verdict; then each
    cell's reason where it is not exact, and the pairs the refused cells left uncovered."""
    names = list(FACTORS)
    lines = [f"Made by `{command}`: {len(joins)} cells, every pair of the factors' values in one at least.", "",
             "| # | " + " | ".join(names) + " | verdict |", "|---|" + "---|" * (len(names) + 1)]
    for index, join in enumerate(joins, 1):
        lines.append(f"| {index} | " + " | ".join(join.values[n] or "-" for n in names) + f" | {join.verdict} |")
    notes = [f"- {index} ({join.name}): {join.verdict}: {'; '.join(join.detail)}"
             for index, join in enumerate(joins, 1) if join.verdict not in matrix.TOLERATED]
    ran = [join.values for join in joins if join.verdict in matrix.TOLERATED]
    left = sorted(uncovered_pairs(ran, FACTORS, applies))
    if left:
        notes.append("- pairs no passing cell holds: " + ", ".join(f"{a[0]}={a[1]} x {b[0]}={b[1]}" for a, b in left))
    if any(join.values["precision"] == "bf16" for join in joins):
        notes.insert(0, f"- bf16 is held to {matrix.BF16_LAYOUT.describe()}: {matrix.BF16_LAYOUT.why}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def pair_count() -> int:
    """Pairs the array covers (for the docs)."""
    return len(set().union(*(pairs_of(cell) for cell in cells())))


def main(work_dir: Path, out: Optional[Path]) -> None:
    joins = certify_joins(work_dir)
    matrix.publish(render(joins, "runner certify --joins"), out, all(j.verdict in matrix.TOLERATED for j in joins))
