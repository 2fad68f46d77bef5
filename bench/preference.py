"""runner's DPO against TRL's DPOTrainer, side by side in one run (issue 48, point 6).

Not a test: prints the figures beside the targets, asserts nothing, exits 0.

The work, the same for both: GPT-2 small built from `GPT2Config()` (124M parameters,
dropout 0.1 as GPT2Config and the recipe have it) with random weights, saved once with
save_pretrained and loaded by both; the vendored preference pairs
(runner/assets/austen_pref.jsonl.gz) that `recipe=gpt2_dpo_tiny` trains on, the first
steps x batch of its train split, in runner's epoch order; block size = TRL's max_length,
over-long pairs cut from the prompt's start (TRL's truncation_mode="keep_end"); `--batch`
pairs a step, one process, fp32, sigmoid loss with the recipe's beta, AdamW (fused) with
the recipe's lr, betas, eps, weight decay and clipping, its cosine schedule and warmup.
TRL's side reads all of it from runner's frozen run_spec.yaml, so the two cannot drift.

Each variant in its own subprocess, one after another:
  runner  preference.reference=precomputed (the starting weights' log-probs, scored once
          before training; runner's default without adapters)
  runner  preference.reference=frozen (a second, frozen copy of the starting weights);
          a runner that refuses it (before issue 48's frozen reference) has its refusal
          printed (its own checks, runner.config.validate, asked without starting a run)
  TRL     a reference model (its default: a second copy, forward each step)
  TRL     precompute_ref_log_probs=True (scored once before training)
Steady pairs/s: steps `--warmup`+1..`--steps`. runner: its metrics.jsonl windows
(log_every=1; `samples_per_s` counts pairs in a preference run) over their durations;
TRL: a callback's time stamps at each step's end, with runner's host-memory settings as
environment variables (bench/trainer_vs_runner.py's TUNED_ENV). Peak memory: each variant
again for 3 steps under bench/tensor_peak (the peak of live tensors during step 2, the
CPU's analogue of CUDA's max_memory_allocated; TRL's through tensor_peak/step_peak.py's
Trainer callback, its reference model counted).

    python bench/preference.py                 # GPT-2 124M, block 128, 4 pairs, 12 steps: 25.6 CPU-minutes
    python bench/preference.py --tiny          # a 2-layer GPT-2, 3 steps of 2 pairs at block 64: checks the bench
    python bench/preference.py --steps 20 --warmup 5 --block-size 256 --batch 8

Internal: `--trl-worker --spec RUN_SPEC --reference model|precomputed --out FILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_targets import spawn_for_tensor_peak  # noqa: E402
from trainer_vs_runner import REPO, TUNED_ENV, _env, _machine, _spawn, in_work_folder  # noqa: E402

TINY = {"n_embd": 64, "n_layer": 2, "n_head": 2}  # --tiny: GPT2Config's defaults otherwise
PEAK_STEPS = 3  # the peak is step 2's (bench/tensor_peak)
TARGETS = {"speed": 1.2, "peak": 0.7, "precomputed": 0.85}
RUNNER_PRECOMPUTED, RUNNER_FROZEN = "runner, reference=precomputed", "runner, reference=frozen"
RUNNER_PACKED = "runner, precomputed, packed"
RUNNER_CHECKPOINTED = "runner, precomputed, act. ckpt"  # as TRL 1.16's DPOConfig defaults
TRL_MODEL, TRL_PRECOMPUTED = "TRL, reference model", "TRL, precompute_ref_log_probs"


# ============================================================== TRL's side (a subprocess)
def runner_pairs(spec: Any) -> Any:
    """The preference records a runner run with this spec trains on, as a datasets.Dataset:
    its train split's records (runner.components.data.prepare.load_raw), less the pairs runner
    drops (equal answers; too_long=drop's over-long ones), the first max_train_samples."""
    from transformers import AutoTokenizer

    from runner.components.data.preference import fit_pair_to_block, preference_record_row
    from runner.components.data.prepare import load_raw

    data = spec.data
    raw = load_raw(data)["train"]
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_name or spec.model.name_or_path)
    names = {"prompt_field": data.prompt_field, "chosen_field": data.chosen_field,
             "rejected_field": data.rejected_field}
    kept: list[int] = []
    for index, record in enumerate(raw):
        if data.max_train_samples is not None and len(kept) == data.max_train_samples:
            break
        row = preference_record_row(record, index, names, tokenizer, None, "train data")
        pair = {key: value for key, value in row.items() if key != "same"}
        if not row["same"] and fit_pair_to_block(pair, data.block_size, data.too_long.value) is not None:
            kept.append(index)
    return raw.select(kept).rename_columns({data.prompt_field: "prompt", data.chosen_field: "chosen",
                                            data.rejected_field: "rejected"})


def trl_worker(spec_path: Path, reference: str, out: Path) -> None:
    """TRL's DPOTrainer on what the runner run of `spec_path` trained, stamping each step's end."""
    import time

    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl_dpo import dpo_trainer, runner_order

    from runner.config.spec import load_spec

    spec = load_spec(spec_path)
    stamps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            stamps.append(time.time())

    pairs = runner_pairs(spec)
    optim, schedule, train = spec.optim, spec.schedule, spec.train
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        trainer = dpo_trainer(
            AutoModelForCausalLM.from_pretrained(spec.model.name_or_path),
            spec.model.tokenizer_name or spec.model.name_or_path, pairs, runner_order(len(pairs), train.seed),
            output_dir,
            per_device_train_batch_size=train.per_device_batch_size, max_steps=train.max_steps, seed=train.seed,
            learning_rate=optim.lr, adam_beta1=optim.beta1, adam_beta2=optim.beta2, adam_epsilon=optim.eps,
            weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
            optim="adamw_torch_fused" if optim.fused else "adamw_torch",
            lr_scheduler_type=schedule.kind.value, warmup_steps=schedule.warmup_steps or schedule.warmup_ratio,
            logging_steps=train.max_steps,  # one log, after the last step: none inside the timed steps
            max_length=spec.data.block_size, truncation_mode="keep_end",
            loss_type=[spec.preference.loss_type.value], beta=spec.preference.beta,
            label_smoothing=spec.preference.label_smoothing,
            disable_dropout=spec.preference.disable_dropout,  # both off by default (TRL's, and runner's since issue 61)
            precompute_ref_log_probs=reference == "precomputed",
            precompute_ref_batch_size=train.per_device_batch_size,
        )
        trainer.add_callback(StepTimes())
        if os.environ.get("RUNNER_BENCH_TENSOR_PEAK"):
            from step_peak import trainer_callback  # bench/tensor_peak is on the path under the hook

            trainer.add_callback(trainer_callback(trainer))
        trainer.train()
    out.write_text(json.dumps({"step_end_times": stamps, "pairs_per_step": train.per_device_batch_size,
                               "pairs": len(pairs)}))


# ============================================================== the bench (parent)
def save_model(folder: Path, tiny: bool) -> int:
    """GPT-2 from GPT2Config() (or its --tiny shrink) with random weights; its parameter count."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(TINY if tiny else {})))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def runner_cmd(args: argparse.Namespace, run_dir: Path, steps: int, reference: str,
               extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "runner", "recipe=gpt2_dpo_tiny", f"model.name_or_path={args.model}", *extra,
            "model.config_overrides=null", f"data.block_size={args.block_size}",
            f"data.max_train_samples={steps * args.batch}", f"data.max_eval_samples={args.batch}",
            f"train.per_device_batch_size={args.batch}", f"train.max_steps={steps}", "train.log_every=1",
            "train.eval_every=0", "tracking=none", "name=bench_preference", f"preference.reference={reference}",
            f"hydra.run.dir={run_dir}"]


def refusal(spec_path: Path, reference: str) -> Optional[str]:
    """Why runner refuses the run of `spec_path` with preference.reference=`reference`
    (its own checks, runner.config.validate), or None: what the CLI would print, without
    starting one."""
    from runner.config.spec import ReferenceMode, load_spec
    from runner.config.validate import spec_problems

    spec = load_spec(spec_path)
    spec.preference.reference = ReferenceMode(reference)
    return " ".join(spec_problems(spec)) or None


def run_runner(args: argparse.Namespace, work: Path, reference: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Steady pairs/s from metrics.jsonl; then the peak run. `extra`: more overrides
    (data.packing=true), which name the run's folders too."""
    reference_tag = reference + "".join(f"_{o.split('=')[0].split('.')[-1]}" for o in extra)
    run_dir, log = work / f"runner_{reference_tag}", work / f"runner_{reference_tag}.log"
    _spawn(runner_cmd(args, run_dir, args.steps, reference, extra), _env(tuned=False), log)
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"samples_per_s"' in line]
    steady = [w for w in windows if w["step"] > args.warmup]
    seconds = sum(args.batch / w["samples_per_s"] for w in steady)  # log_every=1: one step's pairs a window
    peak_dir = work / f"runner_{reference_tag}-peak"
    peak = spawn_for_tensor_peak(runner_cmd(args, peak_dir, PEAK_STEPS, reference, extra),
                                 work / f"runner_{reference_tag}-tensor-peak", work / f"runner_{reference_tag}-peak.log")
    return {"pairs_per_s": args.batch * len(steady) / seconds, "peak_mb": peak, "spec": run_dir / "run_spec.yaml",
            "peak_spec": peak_dir / "run_spec.yaml"}


def run_trl(args: argparse.Namespace, work: Path, reference: str, spec: Path, peak_spec: Path) -> dict[str, Any]:
    def cmd(spec_path: Path, out: Path) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--spec", str(spec_path),
                "--reference", reference, "--out", str(out)]

    out = work / f"trl_{reference}.json"
    _spawn(cmd(spec, out), _env(tuned=True), work / f"trl_{reference}.log")
    stamps = json.loads(out.read_text())["step_end_times"]
    pairs_per_s = (len(stamps) - args.warmup) * args.batch / (stamps[-1] - stamps[args.warmup - 1])
    peak = spawn_for_tensor_peak(cmd(peak_spec, work / f"trl_{reference}-peak.json"),
                                 work / f"trl_{reference}-tensor-peak", work / f"trl_{reference}-peak.log", tuned=True)
    return {"pairs_per_s": pairs_per_s, "peak_mb": peak}


def ratio_line(what: str, a: Optional[float], b: Optional[float], target: str, met: Callable[[float], bool]) -> str:
    if a is None or b is None:
        return f"{what}: -   target {target}: not measured"
    value = round(a / b, 2)  # judged as printed
    return f"{what}: {value:.2f}x   target {target}: {'met' if met(value) else 'NOT met'}"


def compare(args: argparse.Namespace, work: Path) -> None:
    import trl

    args.model = work / "model"
    parameters = save_model(args.model, args.tiny)
    print(f"{_machine()}, trl {trl.__version__}")
    model = f"tiny {TINY}" if args.tiny else "small (GPT2Config())"
    print(f"work: GPT-2 {model}, {parameters / 1e6:.1f}M parameters, dropout 0.1, fp32, 1 process; "
          f"{args.batch} pairs a step, block {args.block_size}, {args.steps} steps of the vendored pairs "
          f"(recipe=gpt2_dpo_tiny's); steady state = steps {args.warmup + 1}..{args.steps}; "
          f"peak of live tensors in step 2 of a {PEAK_STEPS}-step run", flush=True)
    print(f"{RUNNER_PRECOMPUTED} ...", flush=True)
    rows: dict[str, dict[str, Any]] = {RUNNER_PRECOMPUTED: run_runner(args, work, "precomputed")}
    base = rows[RUNNER_PRECOMPUTED]
    refused = refusal(base["spec"], "frozen")  # None: runner accepts it, and it is measured
    print(f"{RUNNER_FROZEN} ...{' refused' if refused else ''}", flush=True)
    rows[RUNNER_FROZEN] = {"refused": refused} if refused else run_runner(args, work, "frozen")
    print(f"{RUNNER_PACKED} ...", flush=True)
    rows[RUNNER_PACKED] = run_runner(args, work, "precomputed", ("data.packing=true",))
    print(f"{RUNNER_CHECKPOINTED} ...", flush=True)
    rows[RUNNER_CHECKPOINTED] = run_runner(args, work, "precomputed", ("model.gradient_checkpointing=true",))
    for reference, tag in (("model", TRL_MODEL), ("precomputed", TRL_PRECOMPUTED)):
        print(f"{tag} ...", flush=True)
        rows[tag] = run_trl(args, work, reference, base["spec"], base["peak_spec"])

    print()
    print(f"{'variant':<31} | {'steady pairs/s':>14} | {'peak of live tensors (MB)':>25}")
    print(f"{'-' * 31}-|-{'-' * 14}-|-{'-' * 25}")
    for tag, row in rows.items():
        if "refused" in row:
            print(f"{tag:<31} | refused today: runner: error: {row['refused']}")
        else:
            print(f"{tag:<31} | {row['pairs_per_s']:>14.3f} | {row['peak_mb']:>25,.0f}")
    print(f"(TRL with runner's host memory settings: {' '.join(f'{k}={v}' for k, v in TUNED_ENV.items())})")
    print()

    def figure(tag: str, name: str) -> Optional[float]:
        return rows[tag].get(name)

    frozen = RUNNER_FROZEN if "refused" not in rows[RUNNER_FROZEN] else None
    lines = []
    for trl_tag in (TRL_PRECOMPUTED, TRL_MODEL):
        lines.append(ratio_line(f"runner precomputed / {trl_tag}, pairs/s", figure(RUNNER_PRECOMPUTED, "pairs_per_s"),
                                figure(trl_tag, "pairs_per_s"), f">= {TARGETS['speed']}x",
                                lambda v: v >= TARGETS["speed"]))
    for trl_tag in (TRL_PRECOMPUTED, TRL_MODEL):
        lines.append(ratio_line(f"runner precomputed / {trl_tag}, peak", figure(RUNNER_PRECOMPUTED, "peak_mb"),
                                figure(trl_tag, "peak_mb"), f"<= {TARGETS['peak']}x", lambda v: v <= TARGETS["peak"]))
    if frozen:
        lines.append(ratio_line("runner precomputed / runner frozen, peak", figure(RUNNER_PRECOMPUTED, "peak_mb"),
                                figure(frozen, "peak_mb"), f"<= {TARGETS['precomputed']}x",
                                lambda v: v <= TARGETS["precomputed"]))
    else:
        lines.append("runner precomputed / runner frozen, peak: runner's frozen reference is refused today; instead:")
        for tag in (RUNNER_PRECOMPUTED, TRL_PRECOMPUTED):
            lines.append(ratio_line(f"  {tag} / {TRL_MODEL}, peak", figure(tag, "peak_mb"),
                                    figure(TRL_MODEL, "peak_mb"), f"<= {TARGETS['precomputed']}x",
                                    lambda v: v <= TARGETS["precomputed"]))
    # TRL 1.16's DPOConfig turns activation checkpointing on by default: like for like
    for what, name, target, met in (("pairs/s", "pairs_per_s", f">= {TARGETS['speed']}x",
                                     lambda v: v >= TARGETS["speed"]),
                                    ("peak", "peak_mb", f"<= {TARGETS['peak']}x", lambda v: v <= TARGETS["peak"])):
        lines.append(ratio_line(f"{RUNNER_CHECKPOINTED} / {TRL_PRECOMPUTED} (both checkpointed), {what}",
                                figure(RUNNER_CHECKPOINTED, name), figure(TRL_PRECOMPUTED, name), target, met))
    lines.append(ratio_line(f"{RUNNER_PACKED} / {TRL_PRECOMPUTED}, pairs/s", figure(RUNNER_PACKED, "pairs_per_s"),
                            figure(TRL_PRECOMPUTED, "pairs_per_s"), "(packed: no target; TRL's DPO cannot pack)",
                            lambda v: v >= TARGETS["speed"]))
    # Full fine-tuning in fp32 with AdamW holds 16 bytes a parameter whatever computes the
    # loss (the weights, their gradients, AdamW's two moments): the floor under every peak.
    states = 16 * parameters / 1e6
    lines.append(f"the states (weights, gradients, AdamW's moments: 16 B x {parameters / 1e6:.1f}M) = {states:,.0f} MB; "
                 "above them at the peak: " + ", ".join(
                     f"{tag} {rows[tag]['peak_mb'] - states:,.0f} MB" for tag in rows if "peak_mb" in rows[tag]))
    print("\n".join(lines))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps a timed run (default 12; --tiny 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steady state starts after this step (default 4; --tiny 1)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="data.block_size = TRL's max_length (default 128; --tiny 64)")
    parser.add_argument("--batch", type=int, default=None, help="pairs a step (default 4; --tiny 2)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2, 3 steps of 2 pairs: checks the bench runs")
    parser.add_argument("--keep", type=Path, default=None, help="keep the model, run folders and logs here")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference", choices=("model", "precomputed"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(args.spec, args.reference, args.out)
        return
    args.steps = args.steps or (3 if args.tiny else 12)
    args.block_size = args.block_size or (64 if args.tiny else 128)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 4)
    if not 1 <= args.warmup < args.steps or args.steps < PEAK_STEPS:
        parser.error(f"need 1 <= --warmup < --steps and --steps >= {PEAK_STEPS}")
    in_work_folder(args.keep, "bench-preference-", lambda folder: compare(args, folder))


if __name__ == "__main__":
    os.chdir(REPO)
    main()
