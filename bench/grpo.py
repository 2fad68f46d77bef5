"""runner's GRPO (`train.objective=grpo`) against TRL's GRPOTrainer, side by side in one run.

Not a test: prints the figures and the ratios runner / TRL, asserts nothing, exits 0.

The work, the same for both: a small GPT-2 (`--layers` x `--width`, GPT2Config's
defaults otherwise, random weights) saved once with save_pretrained, with the vendored
GPT-2 tokenizer, and loaded by both; the offline arithmetic prompts
(runner/assets/arith.jsonl.gz, fields prompt / answer) that `recipe=gpt2_grpo_tiny`
trains on; `--prompts` prompts a step x G = `--generations` completions each (TRL's
num_generations; per_device_train_batch_size = prompts x G; one generation a step),
`--max-completion-length` new tokens at most, `--temperature`, plain sampling over the
whole vocabulary (TRL's top_k=0, top_p=1); one reward, exact match on the last number
(runner: rl.rewards=[{kind: exact_match, column: answer, extract: last_number}]; TRL: the
same rule, runner.components.rewards.builtins.exact_match, as its reward function); the
loss, optimizer and schedule from the recipe (DAPO's loss, beta 0, epsilon 0.2, group
scaling, dropout off, AdamW fused, constant lr, clip 1.0); one process, fp32, no
gradient checkpointing (TRL's GRPOConfig turns it on by default: off here, as runner).
TRL reads the optimizer's settings from runner's frozen run_spec.yaml and takes the
prompts runner trained, in runner's order (its completions.jsonl), with shuffle_dataset
off, so the two cannot drift. Neither side is forced to the full length: the model is
random, so an end-of-sequence is rare, and generated tokens are counted as drawn (each
completion up to its end-of-sequence, that token included) on both sides.

Each side in its own subprocess, one after another (`--rounds` interleaved rounds,
medians), with the same OMP_NUM_THREADS (`--threads`; default: what runner would take)
and, on a CPU, runner's host memory settings for TRL too (bench/trainer_vs_runner.py's
TUNED_ENV; runner sets its own). Measured in each worker, over the steps after
`--warmup` warm-up steps:
  generated tokens/s  tokens generated / seconds generating. runner: its
                      RolloutSource.generate wrapped (sampling, gathering, scoring the
                      rewards); TRL: its GRPOTrainer._generate wrapped (tokenising,
                      generate, decoding)
  optimizer steps/s   from time stamps at each optimizer step's end (torch's global
                      optimizer hook, the same in both loops)
  peak memory         CUDA: torch.cuda.max_memory_allocated; CPU: the worker's peak RSS
                      (getrusage), the whole process: Python, the libraries each imports,
                      the model, data and steps

    python bench/grpo.py                  # 2 x 64 GPT-2, 4 prompts x G=4, 8 tokens, 1 + 5 steps, 2 rounds: ~2 min
    python bench/grpo.py --threads 1 --rounds 3   # one thread each (steadier on a shared machine), three rounds
    python bench/grpo.py --device cuda --width 256 --layers 4 --max-completion-length 64
    python bench/grpo.py --profile        # also: one more run of each under cProfile, top entries

Internal: `--worker runner|trl --run-dir DIR --out FILE [--profile-out FILE]`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_vs_runner import REPO, TUNED_ENV, _env, _machine, _spawn, in_work_folder  # noqa: E402

RUNNER, TRL = "runner", "TRL"
PROFILE_TOP = 15  # entries printed by --profile, by own time
# Where a GRPO step's time goes, by cumulative time under cProfile (printed if seen)
PROFILE_PARTS = {
    RUNNER: [("runner.components.rollouts", "generate", "generation batch (RolloutSource.generate)"),
             ("runner.components.generation", "sample_group", "  sampling loop (sample_group)"),
             ("modeling_gpt2", "forward", "GPT-2 forwards, generating and training"),
             ("runner.components.generation", "_draw", "  the draw (a uniform a row, inverse CDF)"),
             ("runner.components.rewards", "score_all", "  rewards"),
             ("runner.components.objectives.completion_scores", "completion_logps", "training pass's log-probs"),
             ("torch._tensor", "backward", "backward"),
             ("torch.optim", "step", "optimizer step")],
    TRL: [("trl.trainer.grpo_trainer", "_generate", "generation (GRPOTrainer._generate)"),
          ("transformers.generation.utils", "generate", "  model.generate"),
          ("modeling_gpt2", "forward", "GPT-2 forwards, generating and training"),
          ("~", "<built-in method torch.multinomial>", "  torch.multinomial"),
          ("trl.trainer.grpo_trainer", "_calculate_rewards", "  rewards"),
          ("trl.trainer.grpo_trainer", "_compute_loss", "loss (log-probs and terms)"),
          ("torch._tensor", "backward", "backward"),
          ("torch.optim", "step", "optimizer step")],
}


# ============================================================== in each worker
class Measure:
    """Stamps at each optimizer step's end, each generation's seconds and tokens, and,
    with `profile_out`, cProfile over the steps after the warm-up."""

    def __init__(self, warmup: int, steps: int, profile_out: Optional[Path]) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.stamps: list[float] = []
        self.generations: list[tuple[float, int]] = []  # (seconds, tokens generated)
        self.warmup, self.total, self.profile_out = warmup, warmup + steps, profile_out
        self.profiler: Any = None
        register_optimizer_step_post_hook(self._step_done)

    def _step_done(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._sync()
        self.stamps.append(time.perf_counter())
        if self.profile_out is None:
            return
        if len(self.stamps) == self.warmup:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif len(self.stamps) == self.total and self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(str(self.profile_out))
            self.profiler = None

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def timed(self, generate: Callable[..., Any], count: Callable[[Any], int]) -> Callable[..., Any]:
        """`generate` timed, its output's tokens counted by `count`."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            self._sync()
            self.generations.append((time.perf_counter() - start, count(out)))
            return out

        return wrapper

    def write(self, out: Path, **extra: Any) -> None:
        import resource

        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak, kind = torch.cuda.max_memory_allocated() / 2**20, "CUDA max_memory_allocated"
        else:
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak RSS"  # KiB on Linux
        out.write_text(json.dumps({"stamps": self.stamps, "generations": self.generations, "peak_mb": peak,
                                   "peak_kind": kind, **extra}))


def runner_worker(args: argparse.Namespace) -> None:
    """runner in this process (world size 1 runs its worker in the launcher's process),
    its RolloutSource.generate timed."""
    from runner.cli import main as runner_main  # first: it sets THP_MEM_ALLOC_ENABLE before torch loads
    from runner.components import rollouts

    measure = Measure(args.warmup, args.steps, args.profile_out)
    rollouts.RolloutSource.generate = measure.timed(rollouts.RolloutSource.generate,  # type: ignore[method-assign]
                                                    lambda r: int(r.lengths.sum()))
    try:
        runner_main(runner_overrides(args))
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    measure.write(args.out)


def runner_overrides(args: argparse.Namespace) -> list[str]:
    steps = args.warmup + args.steps
    return ["recipe=gpt2_grpo_tiny", f"model.name_or_path={args.model}", f"model.tokenizer_name={args.model}",
            "model.config_overrides=null", f"train.per_device_batch_size={args.prompts * args.generations}",
            f"train.max_steps={steps}", "train.eval_every=0", f"train.log_every={steps}",
            "data.max_eval_samples=1", "tracking=none", "name=bench_grpo",
            f"rl.num_generations={args.generations}", f"rl.max_completion_length={args.max_completion_length}",
            f"rl.temperature={args.temperature}",
            "rl.rewards=[{kind:exact_match,column:answer,extract:last_number}]", f"hydra.run.dir={args.run_dir}"]


def trained_prompts(run_dir: Path) -> list[dict[str, str]]:
    """The prompts the runner run of `run_dir` trained, one a group, in its order (its
    completions.jsonl), each with its answer from the asset."""
    from runner.config.paths import asset_path

    with gzip.open(asset_path("arith.jsonl.gz"), "rt") as handle:
        answers = {r["prompt"]: r["answer"] for r in map(json.loads, handle)}
    groups: dict[tuple[int, int], str] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        groups.setdefault((row["generation"], row["prompt_id"]), row["prompt"])
    return [{"prompt": prompt, "answer": answers[prompt]} for prompt in groups.values()]


def trl_worker(args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer on what the runner run of `args.run_dir` trained, its _generate timed."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from runner.components.rewards.builtins import exact_match as exact_match_rule
    from runner.config.rl_spec import Extract
    from runner.config.spec import load_spec

    spec = load_spec(args.run_dir / "run_spec.yaml")
    rl, optim, train = spec.rl, spec.optim, spec.train
    measure = Measure(args.warmup, args.steps, args.profile_out)

    class Timed(GRPOTrainer):  # type: ignore[misc]
        pass

    Timed._generate = measure.timed(GRPOTrainer._generate, lambda out: sum(len(ids) for ids in out[1]))

    def exact_match(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
        return [exact_match_rule(c, a, Extract.last_number) for c, a in zip(completions, answer)]

    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_name or spec.model.name_or_path)
    tokenizer.pad_token = tokenizer.eos_token
    cpu = args.device == "cpu"
    with tempfile.TemporaryDirectory(prefix="bench-trl-grpo-") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=cpu, bf16=False, fp16=False, report_to=[], save_strategy="no",
            eval_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=train.seed,
            per_device_train_batch_size=train.per_device_batch_size, gradient_accumulation_steps=1,
            max_steps=train.max_steps, logging_steps=train.max_steps, shuffle_dataset=False,
            num_generations=rl.num_generations, max_completion_length=rl.max_completion_length,
            temperature=rl.temperature, top_k=0, top_p=1.0, loss_type=rl.loss_type.value, beta=rl.beta,
            epsilon=rl.epsilon, scale_rewards=rl.scale_rewards.value, steps_per_generation=rl.steps_per_generation,
            num_iterations=rl.num_iterations, mask_truncated_completions=rl.mask_truncated_completions,
            disable_dropout=rl.disable_dropout, activation_checkpointing=spec.model.gradient_checkpointing,
            learning_rate=optim.lr, adam_beta1=optim.beta1, adam_beta2=optim.beta2, adam_epsilon=optim.eps,
            weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
            optim="adamw_torch_fused" if optim.fused else "adamw_torch",
            lr_scheduler_type=spec.schedule.kind.value, warmup_steps=spec.schedule.warmup_steps,
        )
        trainer = Timed(model=AutoModelForCausalLM.from_pretrained(spec.model.name_or_path, dtype=torch.float32),
                        reward_funcs=[exact_match], args=config,
                        train_dataset=Dataset.from_list(trained_prompts(args.run_dir)), processing_class=tokenizer)
        trainer.train()
    measure.write(args.out)


# ============================================================== the bench (parent)
def save_model(folder: Path, args: argparse.Namespace) -> int:
    """A GPT-2 with random weights and the vendored tokenizer in `folder`; its parameter count."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from runner.config.paths import asset_path

    torch.manual_seed(0)
    positions = 64 * -(-(32 + args.max_completion_length) // 64)  # the prompts are ~12 tokens
    model = GPT2LMHeadModel(GPT2Config(n_embd=args.width, n_layer=args.layers, n_head=max(1, args.width // 32),
                                       n_positions=positions))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(asset_path("gpt2_tokenizer")).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def worker_env(args: argparse.Namespace, tuned: bool) -> dict[str, str]:
    env = _env(tuned=tuned and args.device == "cpu")
    env["OMP_NUM_THREADS"] = str(args.threads)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # runner takes a visible GPU by itself
    return env


def run_side(side: str, args: argparse.Namespace, work: Path, tag: str, run_dir: Path,
             profile_out: Optional[Path] = None) -> dict[str, Any]:
    out = work / f"{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side.lower(), "--run-dir", str(run_dir),
           "--out", str(out), *shared_flags(args)]
    if profile_out is not None:
        cmd += ["--profile-out", str(profile_out)]
    _spawn(cmd, worker_env(args, tuned=side == TRL), work / f"{tag}.log")
    return figures(json.loads(out.read_text()), args)


def shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", str(args.model), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--prompts", str(args.prompts), "--generations", str(args.generations),
            "--max-completion-length", str(args.max_completion_length), "--temperature", str(args.temperature),
            "--device", args.device]


def figures(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Steady figures: the steps after the warm-up (one generation a step)."""
    stamps, generations = raw["stamps"], raw["generations"]
    if len(stamps) != args.warmup + args.steps or len(generations) != args.warmup + args.steps:
        raise RuntimeError(f"expected {args.warmup + args.steps} steps and generations, got {len(stamps)} and "
                           f"{len(generations)}")
    steady = generations[args.warmup:]
    gen_s, tokens = sum(s for s, _ in steady), sum(n for _, n in steady)
    step_s = (stamps[-1] - stamps[args.warmup - 1]) / args.steps
    return {"tokens_per_s": tokens / gen_s, "gen_s": gen_s / args.steps, "steps_per_s": 1 / step_s, "step_s": step_s,
            "mean_length": tokens / (args.steps * args.prompts * args.generations), "peak_mb": raw["peak_mb"],
            "peak_kind": raw["peak_kind"]}


def print_profile(side: str, path: Path, steps: int) -> None:
    import pstats

    stats = pstats.Stats(str(path))
    table = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in table.values())  # own times add up to the profiled time
    print(f"\n{side} under cProfile, {steps} steps after the warm-up: {total:.2f} s, {total / steps:.3f} s a step")
    print(f"  {'part (cumulative)':<44} | {'s a step':>8} | {'share':>6}")
    for module, name, label in PROFILE_PARTS[side]:
        # the outermost of the functions it names (a model's forward holds its modules' forwards)
        seen = [ct for (file, _, fn), (_, _, _, ct, _) in table.items()
                if fn == name and (module == "~" and file == "~" or module.replace(".", "/") in file)]
        cumulative = max(seen, default=0)
        if cumulative:
            print(f"  {label:<44} | {cumulative / steps:>8.3f} | {cumulative / total:>6.1%}")
    print(f"  top {PROFILE_TOP} by own time:")
    rows = sorted(table.items(), key=lambda item: -item[1][2])[:PROFILE_TOP]
    for (file, line, fn), (_, calls, tt, ct, _) in rows:
        where = fn if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}({fn})"
        print(f"  {where[:72]:<72} | {calls:>7} calls | own {tt / steps:>7.3f} s a step | {tt / total:>6.1%}")


def compare(args: argparse.Namespace, work: Path) -> None:
    import trl

    args.model = work / "model"
    parameters = save_model(args.model, args)
    print(f"{_machine()}, trl {trl.__version__}; OMP_NUM_THREADS={args.threads}, device {args.device}")
    print(f"work: GPT-2 {args.layers} x {args.width} (random weights), {parameters / 1e6:.1f}M parameters, fp32, "
          f"1 process; {args.prompts} prompts a step x G={args.generations} = {args.prompts * args.generations} "
          f"completions of at most {args.max_completion_length} tokens, temperature {args.temperature}, exact-match "
          f"reward; {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} round(s)", flush=True)
    rows: dict[str, list[dict[str, Any]]] = {RUNNER: [], TRL: []}
    for r in range(args.rounds):
        run_dir = work / f"runner-{r}"
        for side in (RUNNER, TRL):
            print(f"round {r + 1}: {side} ...", flush=True)
            rows[side].append(run_side(side, args, work, f"{side.lower()}-{r}", run_dir))
    median = {side: {key: statistics.median(row[key] for row in rows[side]) for key in rows[side][0]
                     if key != "peak_kind"} for side in rows}
    peak_kind = rows[RUNNER][0]["peak_kind"]

    print()
    header = (f"{'':<7} | {'generated tokens/s':>18} | {'generation s/step':>17} | {'optimizer steps/s':>17} | "
              f"{'s/step':>7} | {'generation share':>16} | {'mean length':>11} | {f'{peak_kind} (MB)':>24}")
    print(header)
    print("-|-".join("-" * len(part) for part in header.split(" | ")))
    for side, m in median.items():
        print(f"{side:<7} | {m['tokens_per_s']:>18.1f} | {m['gen_s']:>17.3f} | {m['steps_per_s']:>17.3f} | "
              f"{m['step_s']:>7.3f} | {m['gen_s'] / m['step_s']:>16.1%} | {m['mean_length']:>11.2f} | "
              f"{m['peak_mb']:>24,.0f}")
    if args.rounds > 1:
        for side in rows:
            print(f"{side} by round: tokens/s " + ", ".join(f"{row['tokens_per_s']:.1f}" for row in rows[side])
                  + "; steps/s " + ", ".join(f"{row['steps_per_s']:.3f}" for row in rows[side]))
    print(f"(TRL with runner's host memory settings: {' '.join(f'{k}={v}' for k, v in TUNED_ENV.items())})"
          if args.device == "cpu" else "")
    ratios = [("generated tokens/s", "tokens_per_s"), ("optimizer steps/s", "steps_per_s"), ("peak memory", "peak_mb")]
    print("runner / TRL: " + ", ".join(f"{what} {median[RUNNER][key] / median[TRL][key]:.2f}x" for what, key in ratios))

    if args.profile:
        for side in (RUNNER, TRL):
            print(f"profiling {side} ...", flush=True)
            profile = work / f"{side.lower()}.prof"
            run_dir = work / ("runner-profile" if side == RUNNER else "runner-0")  # TRL: the prompts runner trained
            run_side(side, args, work, f"{side.lower()}-profile", run_dir, profile)
            print_profile(side, profile, args.steps)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps after the warm-up (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps, not timed (default 1)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step (default 4)")
    parser.add_argument("--generations", type=int, default=4, help="G, completions a prompt (default 4)")
    parser.add_argument("--max-completion-length", type=int, default=8, help="new tokens at most (default 8)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--width", type=int, default=64, help="GPT-2's n_embd (default 64; n_head = width / 32)")
    parser.add_argument("--layers", type=int, default=2, help="GPT-2's n_layer (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds, medians (default 2)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both (default: the usable cores, as runner takes)")
    parser.add_argument("--profile", action="store_true",
                        help="then run each side once more under cProfile and print where its steps' time goes")
    parser.add_argument("--keep", type=Path, default=None, help="keep the model, run folders, logs and profiles here")
    parser.add_argument("--worker", choices=("runner", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        (runner_worker if args.worker == "runner" else trl_worker)(args)
        return
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1 or args.generations < 2:
        parser.error("need --warmup >= 1, --steps >= 1, --rounds >= 1 and --generations >= 2")
    if args.threads is None:
        from runner.launch.cpus import usable_cpus

        args.threads = usable_cpus()
    in_work_folder(args.keep, "bench-grpo-", lambda folder: compare(args, folder))


if __name__ == "__main__":
    os.chdir(REPO)
    main()
