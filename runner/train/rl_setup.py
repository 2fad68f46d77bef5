"""Setup step 4 for train.objective=grpo (runner/train/worker.py names the steps): the
prompts, the rollouts' source and its loaders, the reference of rl.beta > 0, and the
completions log. The loop itself is the one every objective runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from runner.components.adapters import uses_adapters
from runner.components.data.prepare import PreparedData
from runner.components.rollouts import Rollouts, RolloutSource, prompt_set, stream_layout
from runner.config.batch import global_batch
from runner.config.spec import RunSpec, StrategyKind
from runner.train.loaders import Loaders, prompt_loaders

COMPLETIONS_FILENAME = "completions.jsonl"


def rollout_parts(spec: RunSpec, accelerator: Any, tokenizer: Any, data: PreparedData) -> tuple[Loaders, RolloutSource]:
    rl, world = spec.rl, accelerator.num_processes
    field = spec.data.prompt_field
    train, evaluation = (prompt_set(split, field, tokenizer, rl.chat_prompts) for split in (data.train, data.validation))
    layout = stream_layout(len(train), rl, global_batch(spec.train, world))
    device = accelerator.device
    source = RolloutSource(
        train, evaluation, rl, layout, tokenizer, spec.train.seed, rank=accelerator.process_index, world=world,
        lockstep=spec.strategy.kind in (StrategyKind.zero3, StrategyKind.fsdp),
        gather=lambda t: accelerator.gather(t.to(device)).cpu(), prompt_field=field)
    loaders = prompt_loaders(spec, layout.steps_per_epoch * layout.global_batch, len(evaluation))
    return loaders, source


def rl_reference(spec: RunSpec, frozen: Callable[[], Any]) -> Any:
    """rl.beta > 0: the starting weights' log-probs come from the model with its adapters
    off (peft), else from a frozen copy prepared like the policy; None at beta 0."""
    if not spec.rl.beta:
        return None
    return "adapter_off" if uses_adapters(spec.peft) else frozen().model


def completions_writer(run_dir: Path, source: RolloutSource) -> Callable[[Rollouts], None]:
    """Rank 0 appends each generation batch's prompts, completions and rewards to
    completions.jsonl, the samples people want to read, each under the first step that
    trains it (metrics.jsonl's step numbers: a resume cuts both back to its step)."""
    path = run_dir / COMPLETIONS_FILENAME
    g, layout = source.settings.num_generations, source.layout

    def write(buffer: Rollouts) -> None:
        texts = source.tokenizer.batch_decode([row[: int(n)].tolist() for row, n in zip(buffer.completion_ids, buffer.lengths)],
                                              skip_special_tokens=True)
        step = buffer.generation * layout.steps_per_generation * layout.iterations + 1  # the first step it trains
        with path.open("a") as out:
            for c, text in enumerate(texts):
                record = source.prompts.records[buffer.prompt_ids[c // g]]
                out.write(json.dumps({"step": step, "generation": buffer.generation, "prompt_id": buffer.prompt_ids[c // g],
                                      "prompt": record[source.prompt_field], "completion": text,
                                      "reward": round(float(buffer.rewards[c]), 6),
                                      "advantage": round(float(buffer.advantages[c]), 6)}, default=str) + "\n")
    return write
