"""The plan's per-rank peak (`dry_run=true`, runner/launch/fit.py) against the measured peak of live tensors.

Not a test: prints, for each architecture x strategy x precision x gradient checkpointing,
the plan's estimate for the run's frozen spec, the larger of the two ranks' measured
peaks of live tensors in step 2 (torch profiler allocation events, bench/tensor_peak:
the CPU analogue of torch.cuda.max_memory_allocated) and their ratio, then one line
`worst estimate/measured: R` (R furthest from 1). Every run: 2 processes, 3 steps,
micro-batch 4 x 128 tokens, the recipe's dropout on, the vendored corpus and tokenizer.

    python bench/fit_estimate.py                                # 48 cases, ~17 minutes on 2 CPU cores
    python bench/fit_estimate.py --archs gpt2 --strategies ddp,zero3 --precisions fp32 --checkpointing off
    python bench/fit_estimate.py --peft lora                    # the same 48 cases training adapters
    python bench/fit_estimate.py --objective dpo                # DPO on preference pairs: 4 pairs (8 sequences)
                                                                # a micro-batch, each of 32 tokens (the pairs fill them)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from strategy_memory import tensor_peak_mb  # bench/ is the script's folder, first on sys.path

from runner.launch.memory_estimate import COMPARED_STRATEGIES

# One config per architecture: big enough that activations and model states both count
# (16-20M parameters, most in the 50,257-token embedding), small enough for a CPU in bf16.
ARCHS: dict[str, list[str]] = {
    "gpt2": ["model.model_type=gpt2", 'model.config_overrides="n_embd=256,n_layer=4,n_head=4,n_positions=128"'],
    # grouped-query attention (8 query heads over 2 key-value heads) and a gated MLP
    "llama": ["model.model_type=llama", 'model.config_overrides="hidden_size=256,intermediate_size=688,'
              'num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=2,max_position_embeddings=128,'
              'vocab_size=50257"'],
    # QK-norm, explicit head_dim, untied head
    "qwen3": ["model.model_type=qwen3", 'model.config_overrides="hidden_size=256,intermediate_size=688,'
              'num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=2,head_dim=32,'
              'max_position_embeddings=128,vocab_size=50257,tie_word_embeddings=false"'],
}
RUN = ["recipe=gpt2_clm_tiny", "data.block_size=128", "train.per_device_batch_size=4", "train.max_steps=3",
       "train.eval_every=0", "data.max_eval_samples=2", "launch.nproc_per_node=2", "launch.check_fit=false"]


def adapter_run(arch: str, base: Path, peft: str) -> list[str]:
    """Overrides training `peft` adapters on the architecture's config, randomly initialised
    once and saved as the pretrained base the adapters need."""
    import torch
    from transformers import AutoModelForCausalLM

    from runner.components.model import build_config
    from runner.config.spec import ModelSpec

    overrides = dict(o.split("=", 1) for o in ARCHS[arch])
    spec = ModelSpec(model_type=overrides["model.model_type"], config_overrides=overrides["model.config_overrides"].strip('"'))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config(spec)).save_pretrained(base)
    return [f"model.name_or_path={base}", "model.config_overrides=null", f"peft={peft}"]


# --objective dpo: the vendored preference pairs, cut to 32 tokens from the prompt's start,
# which nearly every pair fills (1,847 of 1,900), as the plan assumes of every sequence.
OBJECTIVES: dict[str, list[str]] = {
    "causal_lm": [],
    "dpo": ["objective=dpo", "data=austen_pref", "data.too_long=truncate", "data.block_size=32"],
}


def estimate_mb(run_dir: Path) -> float:
    """The plan's per-rank peak for the run's frozen spec."""
    from runner.config.spec import load_spec
    from runner.launch.fit import Planner

    spec = load_spec(run_dir / "run_spec.yaml")
    return Planner(spec, spec.data.block_size, 2).estimate(spec.strategy.kind.value).device_total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--strategies", default=",".join(COMPARED_STRATEGIES))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--checkpointing", default="off,on", help="model.gradient_checkpointing: off, on or both")
    parser.add_argument("--peft", default="none", choices=("none", "lora", "dora"),
                        help="lora or dora: adapters on each architecture's frozen, randomly initialised weights "
                             "(saved once, as a pretrained base) instead of training every weight")
    parser.add_argument("--objective", default="causal_lm", choices=tuple(OBJECTIVES),
                        help="dpo: preference pairs (a micro-batch of 4 pairs is 8 sequences) instead of text blocks")
    args = parser.parse_args()
    worst, rows = 1.0, []
    print("| arch | strategy | precision | checkpointing | estimate MB | measured MB | estimate/measured |")
    print("|---|---|---|---|---|---|---|")
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model = ARCHS[arch] if args.peft == "none" else adapter_run(arch, Path(tmp) / f"{arch}-base", args.peft)
            for precision in args.precisions.split(","):
                for ckpt in args.checkpointing.split(","):
                    for strategy in args.strategies.split(","):
                        extra = [*RUN, *model, *OBJECTIVES[args.objective], f"precision={precision}",
                                 f"model.gradient_checkpointing={'true' if ckpt == 'on' else 'false'}"]
                        name = f"{arch}-{strategy}-{precision}-{ckpt}"
                        measured = max(tensor_peak_mb(strategy, Path(tmp) / name, extra))
                        estimate = estimate_mb(Path(tmp) / name / f"{strategy}-profiled")
                        ratio = estimate / measured
                        worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
                        rows.append(ratio)
                        print(f"| {arch} | {strategy} | {precision} | {ckpt} | {estimate:,.0f} | {measured:,.0f} | "
                              f"{ratio:.3f} |", flush=True)
    print(f"{len(rows)} cases in {time.time() - started:.0f} s; within 15%: {sum(abs(r - 1) <= 0.15 for r in rows)}")
    print(f"worst estimate/measured: {worst:.3f}")
    sys.exit(0)


if __name__ == "__main__":
    main()
