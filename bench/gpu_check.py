"""Issue 50's GPU check: every case side by side in one call, one table (markdown and JSON).

Not a test: prints the table and the targets, asserts nothing; a case that fails prints
its error and the next one runs. `scripts/gpu-check.sh` runs it on a lent GPU (after
installing what the machine lacks from the wheels `scripts/gpu-wheels.sh` downloaded);
`--cpu` runs the same cases with a tiny model and a few steps on a CPU, so CI keeps it
from rotting (tests/test_gpu_check.py).

    python bench/gpu_check.py --out OUT            # on a GPU: GPT-2 124M at 8 x 1024, bf16
    python bench/gpu_check.py --cpu --out OUT      # the CPU's table (marked CPU)

Each runner case is `runner recipe=... train.max_steps=N train.log_every=1` in a process
of its own; steady tokens/s and MFU are over the steps after `steady_from` (compiling and
allocator warm-up happen in the first ones), from its metrics.jsonl; peak memory is
all_results.json's (CUDA's max reserved on a GPU, peak RSS on a CPU). The Trainer case is
run_clm's workflow on the same data, batch, optimizer and schedule
(bench/trainer_vs_runner.py's worker, on the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

OVERFLOW_STEP = 5  # the fp16 case's forced overflow: its gradients are made infinite at this step

# The injected failure and the hidden library, in the case's own processes only (a
# sitecustomize.py on PYTHONPATH, as the tests inject failures): no switch in runner.
SITECUSTOMIZE = '''
import os
import runner.train.trainer as trainer
if os.environ.get("GPU_CHECK_OVERFLOW_STEP"):
    step, original = int(os.environ["GPU_CHECK_OVERFLOW_STEP"]), trainer.Trainer.train_step
    def train_step(self, batch):
        if self.state.step != step - 1:
            return original(self, batch)
        loss_of = self.objective.loss
        def overflowing(model, batch):
            loss = loss_of(model, batch)
            loss.backward.register_hook(lambda grad: grad * float("inf"))  # the loss stays finite, its gradients do not
            return loss
        self.objective.loss = overflowing
        try:
            return original(self, batch)
        finally:
            del self.objective.loss
    trainer.Trainer.train_step = train_step
if os.environ.get("GPU_CHECK_HIDE_LIGER"):
    import runner.components.liger_loss as liger
    seen = liger.installed_version
    liger.installed_version = lambda library: None if library == "liger-kernel" else seen(library)
'''


@dataclass(frozen=True)
class Mode:
    name: str
    gpt2: str  # model.config_overrides of the GPT-2 the speed cases train
    block: int
    batch: int
    steps: int
    steady_from: int
    big: str  # the ~0.5B model (a Qwen2 built from its config), or its tiny stand-in
    big_block: int
    big_batch: int
    timeout: int  # seconds a case may take


GPU = Mode("GPU", gpt2="n_positions=1024", block=1024, batch=8, steps=40, steady_from=10,
           big=("hidden_size=896,intermediate_size=4864,num_hidden_layers=24,num_attention_heads=14,"
                "num_key_value_heads=2,vocab_size=50257,max_position_embeddings=1024,tie_word_embeddings=true"),
           big_block=1024, big_batch=4, timeout=240)
CPU = Mode("CPU", gpt2="n_embd=64,n_layer=2,n_head=2,n_positions=128", block=128, batch=8, steps=8, steady_from=3,
           big=("hidden_size=64,intermediate_size=176,num_hidden_layers=2,num_attention_heads=4,"
                "num_key_value_heads=2,vocab_size=50257,max_position_embeddings=256,tie_word_embeddings=true"),
           big_block=128, big_batch=4, timeout=300)


@dataclass
class Row:
    case: str
    status: str = "ok"  # ok | failed | refused | not run
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    seconds: Optional[float] = None
    note: str = ""


@dataclass
class Case:
    name: str
    run: Callable[["Check"], Row]
    gpu_only: str = ""  # why it does not run on a CPU


@dataclass
class Check:
    mode: Mode
    out: Path
    cache: Path = field(init=False)

    def __post_init__(self) -> None:
        self.cache = self.out / "cache"
        (self.out / "inject").mkdir(parents=True, exist_ok=True)
        (self.out / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RUNNER_CACHE_DIR": str(self.cache),
               **extra}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.out / "inject"), str(REPO), env.get("PYTHONPATH", "")) if p)
        return env

    def run_dir(self, case: str) -> Path:
        return self.out / "runs" / re.sub(r"[^A-Za-z0-9.]+", "_", case).strip("_")

    def runner(self, case: str, overrides: list[str], env: Optional[dict[str, str]] = None,
               recipe: str = "gpt2_clm_tiny") -> tuple[Row, Path]:
        """A runner run; its row from its own files. A refusal (exit 2) is the row's note."""
        run_dir = self.run_dir(case)
        m = self.mode
        command = [sys.executable, "-m", "runner", f"recipe={recipe}", f"train.max_steps={m.steps}", "train.log_every=1",
                   "train.eval_every=0", "train.save_every=0", "data.max_eval_samples=8", "tracking=none",
                   f"hydra.run.dir={run_dir}", "overwrite=true", *overrides]
        started = time.time()
        done = subprocess.run(command, cwd=REPO, env=self.env(**(env or {})), capture_output=True, text=True,
                              timeout=m.timeout)
        (run_dir.parent / f"{run_dir.name}.log").write_text(done.stdout + done.stderr)
        seconds = round(time.time() - started, 1)
        if done.returncode == 2:
            return Row(case, "refused", seconds=seconds, note=_last_line(done.stderr)), run_dir
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {_last_line(done.stderr)}")
        return self.figures(case, run_dir, seconds), run_dir

    def figures(self, case: str, run_dir: Path, seconds: float) -> Row:
        results = json.loads((run_dir / "all_results.json").read_text())
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steady = [r for r in records if "tokens_per_s" in r and r["step"] > self.mode.steady_from and r.get("samples_per_s")]
        # each step's time is its samples over samples/s; steady = all its tokens over all its time
        times = [1.0 / r["samples_per_s"] for r in steady]
        rate = sum(r["tokens_per_s"] * t for r, t in zip(steady, times)) / sum(times) if steady else None
        mfus = [r["mfu"] * t for r, t in zip(steady, times) if r.get("mfu") is not None]
        mfu = sum(mfus) / sum(times) if steady and len(mfus) == len(steady) else None
        return Row(case, tokens_per_s=rate, mfu=mfu, peak_memory_mb=results.get("peak_memory_mb"), seconds=seconds)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


# ================================================================ the cases
def gpt2(check: Check, *extra: str, precision: str = "bf16") -> list[str]:
    m = check.mode
    return [f"model.config_overrides='{m.gpt2}'", f"data.block_size={m.block}", f"train.per_device_batch_size={m.batch}",
            f"precision={precision}", *extra]


def trainer_case(check: Check) -> Row:
    m = check.mode
    out = check.out / "runs" / "trainer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--trainer-worker", "--out", str(out),
               "--steps", str(m.steps), "--config", m.gpt2, "--block", str(m.block), "--batch", str(m.batch)]
    command += ["--cpu"] if m is CPU else []
    started = time.time()
    done = subprocess.run(command, cwd=REPO, env=check.env(), capture_output=True, text=True, timeout=m.timeout)
    (out.parent / "trainer.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {_last_line(done.stderr)}")
    result = json.loads(out.read_text())
    stamps = result["step_end_times"]
    steady = stamps[m.steady_from - 1:]
    rate = (len(steady) - 1) * m.block * m.batch / (steady[-1] - steady[0]) if len(steady) > 1 else None
    return Row("Trainer, bf16", tokens_per_s=rate, peak_memory_mb=round(result["peak_memory_mb"], 1),
               seconds=round(time.time() - started, 1), note=f"optimizer {result['optim']}")


def runner_case(name: str, *extra: str, env: Optional[dict[str, str]] = None, note: str = "") -> Callable[[Check], Row]:
    def run(check: Check) -> Row:
        row, _ = check.runner(name, gpt2(check, *extra), env)
        row.note = row.note or note
        return row
    return run


def fp16_overflow(check: Check) -> Row:
    """fp16 with loss scaling, its gradients made infinite at OVERFLOW_STEP: that step is
    skipped, said, and the run goes on; the loss scale's history is in metrics.jsonl."""
    name = f"runner, fp16, overflow at step {OVERFLOW_STEP}"
    row, run_dir = check.runner(name, gpt2(check, precision="fp16"), {"GPU_CHECK_OVERFLOW_STEP": str(OVERFLOW_STEP)})
    if row.status != "ok":
        return row
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    before, at = records.get(OVERFLOW_STEP - 1, {}), records.get(OVERFLOW_STEP, {})
    skipped = at.get("skipped_steps", 0) > before.get("skipped_steps", 0)
    scales = [records[s].get("loss_scale") for s in sorted(records)]
    row.note = (f"step {OVERFLOW_STEP} skipped: {'yes' if skipped else 'NO'}; loss scale "
                f"{before.get('loss_scale')} -> {at.get('loss_scale')}; {len(records)} steps logged; "
                f"scales {sorted(set(s for s in scales if s is not None))}")
    row.status = "ok" if skipped and len(records) == check.mode.steps else "failed"
    return row


def big_case(name: str, *extra: str, base_of: str = "") -> Callable[[Check], Row]:
    """The ~0.5B model. Adapters need a pretrained base (runner refuses them on random
    weights): the LoRA case starts from the full case's saved model/."""
    def run(check: Check) -> Row:
        m = check.mode
        model = [f"model.name_or_path={check.run_dir(base_of) / 'model'}", "model.config_overrides=null"] if base_of else [
            "model.model_type=qwen2", f"model.config_overrides='{m.big}'"]
        if base_of and not (check.run_dir(base_of) / "model" / "config.json").is_file():
            raise RuntimeError(f"needs the model/ of the case '{base_of}', which did not finish")
        row, _ = check.runner(name, [*model, f"data.block_size={m.big_block}", f"train.per_device_batch_size={m.big_batch}",
                                     "precision=bf16", *extra])
        return row
    return run


def instruction_case(name: str, packing: bool) -> Callable[[Check], Row]:
    def run(check: Check) -> Row:
        m = check.mode
        row, _ = check.runner(name, [f"model.config_overrides='{m.gpt2}'", f"data.block_size={m.block}",
                                     f"train.per_device_batch_size={m.batch}", "precision=bf16",
                                     f"data.packing={str(packing).lower()}"], recipe="gpt2_sft_tiny")
        row.note = row.note or "trained (answer) tokens/s"
        return row
    return run


def grpo_case(name: str) -> Callable[[Check], Row]:
    """Online RL at ~0.5B (train.objective=grpo, bf16): generated tokens/s over the ledger's
    generation seconds (sampling with its KV cache, and the log-probs scored on the samples),
    and the run's peak memory (the KV cache of a group beside the training step's)."""
    def run(check: Check) -> Row:
        m = check.mode
        group, length = (8, 256) if m.name == "GPU" else (4, 8)
        # the recipe's model is its warm GPT-2: a Qwen2 from config instead, with GPT-2's tokenizer
        row, run_dir = check.runner(name, ["model.name_or_path=null", "model.tokenizer_name=${asset:gpt2_tokenizer}",
                                           "model.model_type=qwen2", f"model.config_overrides='{m.big}'",
                                           "precision=bf16", f"rl.num_generations={group}",
                                           f"rl.max_completion_length={length}", f"train.per_device_batch_size={2 * group}",
                                           "train.max_steps=6", "data.max_eval_samples=2"], recipe="gpt2_grpo_tiny")
        if row.status != "ok":
            return row
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        generated = sum(r["completions/mean_length"] * 2 * group for r in steps)  # a generation batch a step
        seconds = json.loads((run_dir / "all_results.json").read_text())["goodput"]["parts_seconds"]["generation"]
        row.tokens_per_s, row.mfu = generated / seconds, None
        row.note = (f"generated tokens/s: {len(steps)} steps of 2 prompts x G={group}, up to {length} tokens, "
                    f"{generated:,.0f} tokens in {seconds:.1f} s of generation")
        return row
    return run


CASES = [
    Case("Trainer, bf16", trainer_case),
    Case("runner, bf16", runner_case("runner, bf16", note="out of the box: Liger's loss with liger-kernel on a GPU, "
                                                           "runner's chunked loss otherwise")),
    Case("runner, bf16, compile", runner_case("runner, bf16, compile", "model.compile=true"),
         gpu_only="inductor's CPU build takes minutes on 2 cores; tests/test_compile.py covers compile on a CPU"),
    Case("runner, bf16, plain loss", runner_case("runner, bf16, plain loss", "model.chunked_loss=false")),
    Case("runner, bf16, chunked loss", runner_case("runner, bf16, chunked loss", env={"GPU_CHECK_HIDE_LIGER": "1"},
                                                   note="runner's chunks, liger-kernel hidden"),
         gpu_only="on a CPU the default row is this one (Liger needs a GPU)"),
    Case(f"runner, fp16, overflow at step {OVERFLOW_STEP}", fp16_overflow),
    Case("~0.5B from config, full", big_case("~0.5B from config, full")),
    Case("~0.5B from config, LoRA", big_case("~0.5B from config, LoRA", "peft=lora", base_of="~0.5B from config, full")),
    Case("~0.5B from config, GRPO", grpo_case("~0.5B from config, GRPO")),
    Case("instruction data, padded", instruction_case("instruction data, padded", packing=False)),
    Case("instruction data, packed", instruction_case("instruction data, packed", packing=True)),
    Case("runner, bf16, zero2 on 1 device", runner_case("runner, bf16, zero2 on 1 device", "strategy=zero2")),
    Case("runner, bf16, fsdp on 1 device", runner_case("runner, bf16, fsdp on 1 device", "strategy=fsdp")),
]

# (numerator case, denominator case, figure, target, how the ratio must compare)
TARGETS = [
    ("runner, bf16", "Trainer, bf16", "tokens_per_s", 1.3, ">="),
    ("runner, bf16", "Trainer, bf16", "peak_memory_mb", 0.7, "<="),
    ("runner, bf16, compile", "runner, bf16", "tokens_per_s", 1.1, ">="),
    ("~0.5B from config, LoRA", "~0.5B from config, full", "peak_memory_mb", 0.5, "<="),
    ("instruction data, packed", "instruction data, padded", "tokens_per_s", 2.0, ">="),
]


def run_cases(check: Check) -> list[Row]:
    rows = []
    for case in CASES:
        if case.gpu_only and check.mode is CPU:
            rows.append(Row(case.name, "not run", note=f"GPU only: {case.gpu_only}"))
            continue
        print(f"gpu-check: {case.name} ...", flush=True)
        try:
            row = case.run(check)
        except Exception as err:  # noqa: BLE001 - the case's error is its row; the next case runs
            traceback.print_exc()
            row = Row(case.name, "failed", note=f"{type(err).__name__}: {str(err)[:400]}")
        print(f"gpu-check: {case.name}: {row.status} {row.note}", flush=True)
        rows.append(row)
    return rows


def target_lines(rows: list[Row]) -> list[dict[str, Any]]:
    by_name = {r.case: r for r in rows}
    lines = []
    for top, bottom, figure, target, sense in TARGETS:
        a, b = by_name.get(top), by_name.get(bottom)
        values = (getattr(a, figure) if a and a.status == "ok" else None, getattr(b, figure) if b and b.status == "ok" else None)
        ratio = values[0] / values[1] if None not in values and values[1] else None
        met = None if ratio is None else (ratio >= target if sense == ">=" else ratio <= target)
        lines.append({"what": f"{top} / {bottom}, {figure}", "ratio": ratio, "target": f"{sense} {target}", "met": met})
    return lines


def device_name(mode: Mode) -> str:
    import torch

    if mode is GPU:
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def versions() -> dict[str, Optional[str]]:
    import importlib.metadata

    found = {}
    for library in ("torch", "transformers", "accelerate", "datasets", "peft", "deepspeed", "liger-kernel"):
        try:
            found[library] = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            found[library] = None
    return found


def _cell(value: Any, digits: str = ",.0f") -> str:
    return "-" if value is None else format(value, digits)


def markdown(mode: Mode, device: str, rows: list[Row], targets: list[dict[str, Any]], found: dict[str, Any]) -> str:
    lines = [f"# GPU check ({mode.name}{': a tiny model, a few steps, not the GPU figures' if mode is CPU else ''})", "",
             f"{device}; GPT-2 at {mode.batch} x {mode.block}, {mode.steps} steps, steady after step {mode.steady_from}; "
             + ", ".join(f"{k} {v}" for k, v in found.items()), "",
             "| case | status | tokens/s | MFU | peak memory (MB) | s | note |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.status} | {_cell(r.tokens_per_s)} | "
                     f"{'-' if r.mfu is None else f'{100 * r.mfu:.1f}%'} | {_cell(r.peak_memory_mb)} | "
                     f"{_cell(r.seconds, ',.1f')} | {r.note.replace('|', '/')} |")
    lines += ["", "| target | ratio | wanted | |", "|---|---:|---|---|"]
    for t in targets:
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        lines.append(f"| {t['what']} | {ratio} | {t['target']} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the CPU's tiny version of every case (CI)")
    parser.add_argument("--out", type=Path, required=True, help="folder for table.md, table.json, the runs and logs")
    parser.add_argument("--only", default="", help="case names to run, separated by ';' (default: all)")
    parser.add_argument("--trainer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--block", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer_worker:
        from trainer_vs_runner import worker_trainer

        worker_trainer(args.steps, args.out, config_overrides=args.config, bf16=True, block=args.block,
                       batch=args.batch, use_cpu=args.cpu)
        return 0
    import torch

    mode = CPU if args.cpu else GPU
    if mode is GPU and not torch.cuda.is_available():
        print("gpu-check: no GPU visible to torch (torch.cuda.is_available() is False); run with --cpu for the CPU's "
              "table.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    global CASES
    if args.only:
        wanted = {name.strip() for name in args.only.split(";")}
        CASES = [case for case in CASES if case.name in wanted]
    started = time.time()
    rows = run_cases(Check(mode, args.out.resolve()))
    targets = target_lines(rows)
    found, device = versions(), device_name(mode)
    table = markdown(mode, device, rows, targets, found)
    (args.out / "table.md").write_text(table)
    (args.out / "table.json").write_text(json.dumps({"mode": mode.name, "device": device, "versions": found,
                                                     "settings": asdict(mode), "rows": [asdict(r) for r in rows],
                                                     "targets": targets, "seconds": round(time.time() - started, 1)},
                                                    indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
