"""runner vs transformers' Trainer (run_clm's workflow) vs a plain PyTorch loop, on the same work.

Not a test: prints measured figures next to the goals, asserts nothing, exits 0.

The work, identical for all three: a GPT-2 built from config (n_embd=64, n_layer=2,
n_head=2, n_positions=128, GPT2Config's defaults otherwise, vocab 50257), the vendored
Austen corpus and GPT-2 tokenizer, block size 128, batch 8, fp32, one process, AdamW
lr 2e-3 / weight decay 0.01, cosine schedule with 30 warmup steps, max_grad_norm 1.0,
seed 42, --steps optimizer steps, no evaluation during training, no checkpoints.

Measured per framework, each in its own fresh subprocess (interpreter start and
imports count):
  - steady tokens/s: steps 51..N (time from the end of step 50 to the end of step N;
    8 x 128 tokens a step). runner: the mean of its 10-step metrics.jsonl windows
    with step > 50.
  - time to first step: from `t0 = time.time()` just before spawning the subprocess
    to the end of its first optimizer step.
Each framework runs once as a warm-up (datasets' cache for Trainer, runner's own data
cache for runner and the plain loop, the OS file cache for everyone), then once
measured: warm cache vs warm cache.

    python bench/trainer_vs_runner.py --steps 300                 # ~10 minutes on 2 CPU cores
    python bench/trainer_vs_runner.py --steps 300 --repeats 3     # three interleaved rounds, medians
    python bench/trainer_vs_runner.py --bf16 --steps 200          # runner only: precision=fp32 vs bf16

Internal: `--worker trainer|plain --steps N --out FILE` runs one framework (used by the above).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
BLOCK, BATCH = 128, 8
TOKENS_PER_STEP = BLOCK * BATCH
STEADY_FROM = 50  # steady state excludes the first 50 steps
CONFIG_OVERRIDES = "n_embd=64,n_layer=2,n_head=2,n_positions=128"
LR, WEIGHT_DECAY, WARMUP, MAX_GRAD_NORM, SEED = 2e-3, 0.01, 30, 1.0, 42
WARMUP_RUN_STEPS = 10  # the warm-up run only needs to fill caches

GOALS = {
    "tok_trainer": 1.0,  # runner / Trainer steady tokens/s >= 1.0
    "tok_plain": 0.97,  # runner / plain loop steady tokens/s >= 0.97
    "ttfs_trainer": 0.7,  # runner time to first step <= 0.7 x Trainer's
    "data_warm_s": 1.0,  # runner's warm data stage <= 1 s
    "bf16_over_fp32": 2.0,  # runner bf16 / fp32 steady tokens/s >= 2
}


# ============================================================== workers (subprocesses)
def _asset(name: str) -> Path:
    from runner.config.paths import asset_path

    return asset_path(name)


def _build_model(vocab_size: int, config_overrides: str = CONFIG_OVERRIDES) -> Any:
    """run_clm's from-scratch model: CONFIG_MAPPING['gpt2']() + --config_overrides."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING["gpt2"]()
    if config_overrides:
        config.update_from_string(config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    if vocab_size > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab_size)
    return model


def worker_trainer(steps: int, out: Path, config_overrides: str = CONFIG_OVERRIDES, bf16: bool = False,
                   block: int = BLOCK, batch: int = BATCH, use_cpu: bool = True, accumulation: int = 1) -> None:
    """run_clm.py's path, condensed: load_dataset('text'), 5% validation split,
    tokenize, group_texts, Trainer with default_data_collator. `config_overrides`: run_clm's
    --config_overrides ("" for GPT-2 small, 124M); `bf16`: its --bf16; `use_cpu=False`: the
    GPU the Trainer finds (bench/gpu_check.py); `accumulation`: its --gradient_accumulation_steps."""
    from itertools import chain

    from datasets import DatasetDict, load_dataset
    from transformers import (
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    stamps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            stamps.append(time.time())

    data_files = {"train": str(_asset("austen.txt.gz"))}
    # run_clm: no validation split in the data -> validation = train[:p%], train = train[p%:]
    raw = DatasetDict(
        validation=load_dataset("text", data_files=data_files, split="train[:5%]", keep_linebreaks=True),
        train=load_dataset("text", data_files=data_files, split="train[5%:]", keep_linebreaks=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(_asset("gpt2_tokenizer")), use_fast=True)
    column = "text"

    def tokenize_function(examples):  # type: ignore[no-untyped-def]
        return tokenizer(examples[column])

    tokenized = raw.map(tokenize_function, batched=True, remove_columns=[column], desc="Running tokenizer on dataset")

    def group_texts(examples):  # type: ignore[no-untyped-def]
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated[list(examples.keys())[0]]) // block) * block
        result = {k: [t[i : i + block] for i in range(0, total, block)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    lm = tokenized.map(group_texts, batched=True, desc=f"Grouping texts in chunks of {block}")

    set_seed(SEED)  # run_clm seeds before building the model
    model = _build_model(len(tokenizer), config_overrides)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            max_steps=steps,
            learning_rate=LR,
            weight_decay=WEIGHT_DECAY,
            lr_scheduler_type="cosine",
            warmup_steps=WARMUP,
            max_grad_norm=MAX_GRAD_NORM,
            logging_steps=10,
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            seed=SEED,
            use_cpu=use_cpu,
            bf16=bf16,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=lm["train"],
            data_collator=default_data_collator,
            callbacks=[StepTimes()],
        )
        trainer.train()
        optim = getattr(args.optim, "value", str(args.optim))
    out.write_text(json.dumps({"step_end_times": stamps, "optim": optim, "peak_memory_mb": _peak_memory_mb()}))


def _peak_memory_mb() -> float:
    """The process's peak: CUDA's max reserved on a GPU (as runner reports it), else peak RSS."""
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker_plain(steps: int, out: Path) -> None:
    """The minimal loop: runner's cached blocks, AdamW with runner's no-decay groups,
    transformers' cosine schedule; forward, backward, clip, step."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer, get_scheduler

    from runner.components.data.epoch_batches import EpochSampler
    from runner.components.data.prepare import collate, prepare
    from runner.components.optim import param_groups
    from runner.config.spec import DataSpec

    tokenizer = AutoTokenizer.from_pretrained(str(_asset("gpt2_tokenizer")), use_fast=True)
    data = prepare(DataSpec(train_file=str(_asset("austen.txt.gz")), block_size=BLOCK), tokenizer, BLOCK)
    torch.manual_seed(SEED)
    model = _build_model(len(tokenizer))
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR)
    scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=WARMUP, num_training_steps=steps)
    sampler = EpochSampler(len(data.train), SEED)
    loader = DataLoader(data.train, batch_size=BATCH, sampler=sampler, collate_fn=collate, num_workers=0)
    stamps: list[float] = []
    epoch = 0
    while len(stamps) < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stamps.append(time.time())
            if len(stamps) >= steps:
                break
        epoch += 1
    out.write_text(json.dumps({"step_end_times": stamps, "data_seconds": data.seconds, "final_loss": loss.item()}))


# ============================================================== the benchmark (parent)
# What runner sets for itself (runner/cli.py, runner/train/host_memory.py), as environment
# variables another process can be given: huge pages for torch's large CPU tensors, and
# glibc keeping freed memory for reuse (mallopt's thresholds, via glibc's tunables).
TUNED_ENV = {
    "THP_MEM_ALLOC_ENABLE": "1",
    "MALLOC_MMAP_THRESHOLD_": str(2**31 - 1),
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
}


def _env(tuned: bool) -> dict[str, str]:
    """The same environment for every subprocess. runner tunes its host memory itself;
    the others get the same settings only when `tuned`."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for key in TUNED_ENV:
        env.pop(key, None)
    if tuned:
        env.update(TUNED_ENV)
    return env


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Run cmd to completion; returns t0, taken right before the spawn."""
    with open(log, "w") as handle:
        t0 = time.time()
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}); log {log}:\n{tail}")
    return t0


def _steady_from_stamps(stamps: list[float]) -> float:
    n = len(stamps)
    if n <= STEADY_FROM + 1:
        return float("nan")
    return (n - STEADY_FROM) * TOKENS_PER_STEP / (stamps[-1] - stamps[STEADY_FROM - 1])


def run_worker(kind: str, steps: int, work: Path, tag: str, tuned: bool) -> dict[str, Any]:
    out = work / f"{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--steps", str(steps), "--out", str(out)]
    t0 = _spawn(cmd, _env(tuned), work / f"{tag}.log")
    result = json.loads(out.read_text())
    stamps = result["step_end_times"]
    return {
        "tokens_per_s": _steady_from_stamps(stamps),
        "first_step_s": stamps[0] - t0,
        "steps": len(stamps),
        "extra": {k: v for k, v in result.items() if k != "step_end_times"},
    }


def run_runner(steps: int, work: Path, tag: str, precision: str = "fp32", extra: tuple[str, ...] = ()) -> dict[str, Any]:
    run_dir = work / tag
    cmd = [
        sys.executable, "-m", "runner",
        "recipe=gpt2_clm_tiny",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "train.log_every=10",
        "data.max_eval_samples=8",
        "tracking=none",
        f'model.config_overrides="{CONFIG_OVERRIDES}"',
        f"precision={precision}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]  # fmt: skip
    t0 = _spawn(cmd, _env(tuned=False), work / f"{tag}.log")
    results = json.loads((run_dir / "all_results.json").read_text())
    windows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    # Each 10-step window logs its rate; its duration is its tokens over that rate.
    # Steady = all tokens after step 50 over all their time (not a mean of rates).
    steady = [w for w in windows if "tokens_per_s" in w and STEADY_FROM < w["step"] <= steps]
    tokens = [(w["step"] - prev["step"]) * TOKENS_PER_STEP for prev, w in zip(windows, windows[1:]) if w in steady]
    seconds = [n / w["tokens_per_s"] for n, w in zip(tokens, steady)]
    return {
        "tokens_per_s": sum(tokens) / sum(seconds) if seconds else float("nan"),
        "first_step_s": results["first_step_time"] - t0,
        "steps": results["train_steps"],
        "data_seconds": results["data_seconds"],
        "train_runtime": results.get("train_runtime"),
    }


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _table(rows: list[tuple[str, dict[str, Any]]], runner: dict[str, Any]) -> str:
    lines = [
        f"{'framework':<36} | {'steady tokens/s':>15} | {'time to first step (s)':>22} | {'vs runner':>9}",
        f"{'-' * 36}-|-{'-' * 15}-|-{'-' * 22}-|-{'-' * 9}",
    ]
    for name, r in rows:
        vs = "1.00x" if r is runner else f"{runner['tokens_per_s'] / r['tokens_per_s']:.2f}x"
        lines.append(f"{name:<36} | {r['tokens_per_s']:>15,.0f} | {r['first_step_s']:>22.2f} | {vs:>9}")
    lines.append("(vs runner = runner's steady tokens/s / this row's)")
    return "\n".join(lines)


def in_work_folder(keep: Optional[Path], prefix: str, run: Callable[[Path], None]) -> None:
    """`run` in the folder `keep` (made if missing, left behind: --keep) or in a temporary one."""
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        run(keep.resolve())
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        run(Path(tmp))


def _machine() -> str:
    """The machine, the versions, the time and the load: a bench's first line."""
    import torch
    import transformers

    load = os.getloadavg()
    return (
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, python {platform.python_version()}, "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


def _header(args: argparse.Namespace) -> str:
    return (
        f"{_machine()}\n"
        f"work: GPT-2 n_embd=64 n_layer=2 n_head=2 n_positions=128, block {BLOCK}, batch {BATCH}, fp32, 1 process, "
        f"{args.steps} steps; steady state = steps {STEADY_FROM + 1}..{args.steps}"
    )


# The least any runner must import before its first step: torch, transformers' GPT-2
# modelling code and Accelerate (which imports DeepSpeed when installed).
IMPORT_FLOOR = "from transformers import GPT2LMHeadModel; from accelerate import Accelerator; import time; print(time.time())"


def import_floor(env: dict[str, str]) -> float:
    """Seconds from spawning an interpreter to the end of those imports (the median of 3)."""
    times = []
    for _ in range(3):
        t0 = time.time()
        done = subprocess.run([sys.executable, "-c", IMPORT_FLOOR], env=env, capture_output=True, text=True, check=True)
        times.append(float(done.stdout.strip().splitlines()[-1]) - t0)
    return sorted(times)[1]


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median steady tokens/s (its time to first step comes with it)."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def _goal_lines(runner: dict[str, Any], trainer: dict[str, Any], plain: dict[str, Any], label: str) -> list[str]:
    tok_trainer = runner["tokens_per_s"] / trainer["tokens_per_s"]
    tok_plain = runner["tokens_per_s"] / plain["tokens_per_s"]
    ttfs = runner["first_step_s"] / trainer["first_step_s"]
    return [
        f"runner / Trainer tokens/s{label}: {tok_trainer:.2f}x      goal >= {GOALS['tok_trainer']:.2f}x: "
        f"{_mark(tok_trainer >= GOALS['tok_trainer'])}",
        f"runner / plain loop tokens/s{label}: {tok_plain:.2f}x   goal >= {GOALS['tok_plain']:.2f}x: "
        f"{_mark(tok_plain >= GOALS['tok_plain'])}",
        f"runner / Trainer time to first step{label}: {ttfs:.2f}x   goal <= {GOALS['ttfs_trainer']:.2f}x: "
        f"{_mark(ttfs <= GOALS['ttfs_trainer'])}",
    ]


def _section(title: str, runner: dict[str, Any], trainer: dict[str, Any], plain: dict[str, Any], label: str) -> None:
    """One comparison: its title, the table of the three frameworks, the goal lines."""
    print()
    print(title)
    print(_table([
        (f"Trainer (run_clm, {trainer['extra']['optim']})", trainer),
        ("runner", runner),
        ("plain PyTorch loop", plain),
    ], runner))  # fmt: skip
    for line in _goal_lines(runner, trainer, plain, label):
        print(line)


def compare(args: argparse.Namespace, work: Path) -> None:
    print(_header(args), flush=True)
    n = args.steps
    print(f"warm-up runs ({WARMUP_RUN_STEPS} steps each, to warm the data caches) ...", flush=True)
    run_worker("trainer", WARMUP_RUN_STEPS, work, "trainer_warmup", tuned=False)
    run_runner(WARMUP_RUN_STEPS, work, "runner_warmup")
    run_worker("plain", WARMUP_RUN_STEPS, work, "plain_warmup", tuned=False)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("trainer", "runner", "plain", "trainer_tuned", "plain_tuned")}
    for r in range(args.repeats):
        print(f"measured runs, round {r + 1} of {args.repeats} ...", flush=True)
        # Interleaved, so a slow spell of the machine hits every framework alike.
        runs["trainer"].append(run_worker("trainer", n, work, f"trainer_{r}", tuned=False))
        runs["runner"].append(run_runner(n, work, f"runner_{r}"))
        runs["plain"].append(run_worker("plain", n, work, f"plain_{r}", tuned=False))
        runs["trainer_tuned"].append(run_worker("trainer", n, work, f"trainer_tuned_{r}", tuned=True))
        runs["plain_tuned"].append(run_worker("plain", n, work, f"plain_tuned_{r}", tuned=True))
    floor = import_floor(_env(tuned=False))
    best = {k: _median_run(v) for k, v in runs.items()}
    runner = best["runner"]
    if args.repeats > 1:
        print("\nsteady tokens/s of every round:")
        for k, v in runs.items():
            print(f"  {k:<14} " + ", ".join(f"{x['tokens_per_s']:,.0f}" for x in v))
        print(f"(tables: each framework's median round of {args.repeats})")

    _section(
        "A. Same host-memory settings for all: Trainer and the plain loop get, as environment variables, what\n"
        "   runner sets for itself: " + " ".join(f"{k}={v}" for k, v in TUNED_ENV.items()) + ".",
        runner, best["trainer_tuned"], best["plain_tuned"], "",
    )
    data_s = runner["data_seconds"]
    print(f"runner data stage (warm cache): {data_s:.2f} s   goal <= {GOALS['data_warm_s']:.0f} s: "
          f"{_mark(data_s <= GOALS['data_warm_s'])}")
    print(f"(plain loop's data stage, same cache: {best['plain_tuned']['extra']['data_seconds']:.2f} s)")
    print(f"import floor: {floor:.2f} s from spawn to the end of `{IMPORT_FLOOR.split('; import time')[0]}` "
          f"alone = {floor / best['trainer_tuned']['first_step_s']:.2f}x Trainer's time to first step")

    _section(
        "B. As each is run out of the box: Trainer and the plain loop with glibc's and torch's defaults\n"
        "   (HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 for all, as in A).",
        runner, best["trainer"], best["plain"], " (out of the box)",
    )


def compare_bf16(args: argparse.Namespace, work: Path) -> None:
    print(_header(args).replace(", fp32,", ","), flush=True)
    extra = ("model.compile=true",) if args.compile else ()
    compiled = " (model.compile=true)" if args.compile else ""
    runs: dict[str, list[dict[str, Any]]] = {"fp32": [], "bf16": []}
    for r in range(args.repeats):
        print(f"round {r + 1} of {args.repeats}: runner with precision=fp32, then precision=bf16{compiled} ...", flush=True)
        for precision in runs:
            runs[precision].append(run_runner(args.steps, work, f"runner_{precision}_{r}", precision, extra))
    print()
    if args.repeats > 1:
        for precision, v in runs.items():
            print(f"steady tokens/s of every round, {precision}: " + ", ".join(f"{x['tokens_per_s']:,.0f}" for x in v))
        print(f"(table: the median round of {args.repeats})")
    best = {k: _median_run(v) for k, v in runs.items()}
    width = 16 + len(compiled)
    print(f"{'runner precision':<{width}} | {'steady tokens/s':>15} | {'time to first step (s)':>22}")
    print(f"{'-' * width}-|-{'-' * 15}-|-{'-' * 22}")
    for name, r in best.items():
        print(f"{name + compiled:<{width}} | {r['tokens_per_s']:>15,.0f} | {r['first_step_s']:>22.2f}")
    ratio = best["bf16"]["tokens_per_s"] / best["fp32"]["tokens_per_s"]
    print(f"runner bf16 / fp32 tokens/s{compiled}: {ratio:.2f}x   goal >= {GOALS['bf16_over_fp32']:.1f}x: "
          f"{_mark(ratio >= GOALS['bf16_over_fp32'])}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per measured run (default 300; more than 60)")
    parser.add_argument("--repeats", type=int, default=1, help="measured rounds; tables show each framework's median (default 1)")
    parser.add_argument("--bf16", action="store_true",
                        help="instead: run runner with precision=fp32 and precision=bf16 and print the ratio")
    parser.add_argument("--compile", action="store_true", help="with --bf16: both runs with model.compile=true (torch.compile)")
    parser.add_argument("--keep", type=Path, default=None, help="keep run folders and logs here (default: a temp folder)")
    parser.add_argument("--worker", choices=("trainer", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        {"trainer": worker_trainer, "plain": worker_plain}[args.worker](args.steps, args.out)
        return
    if args.steps <= STEADY_FROM + 10:
        parser.error(f"--steps must be above {STEADY_FROM + 10} (steady state starts after step {STEADY_FROM})")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="trainer_vs_runner-") as tmp:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix="trainer_vs_runner-", dir=args.keep))
        else:
            work = Path(tmp)
        try:
            (compare_bf16 if args.bf16 else compare)(args, work)
        except RuntimeError as err:
            print(f"\nbenchmark stopped: {err}")
            raise SystemExit(1) from None
        finally:
            if args.keep:
                print(f"\nrun folders and logs: {work}")


if __name__ == "__main__":
    main()
