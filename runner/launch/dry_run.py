"""`dry_run=true`: the resolved spec and the run's plan, without training."""

from __future__ import annotations

import torch

from runner.components.data.prepare import PreparedData
from runner.components.data.stream import StreamedData
from runner.components.rollouts import stream_layout
from runner.config.batch import global_batch
from runner.config.spec import RunSpec, spec_to_yaml
from runner.launch.fit import Budget, Planner, gib, verdict_lines
from runner.launch.memory_estimate import COMPARED_STRATEGIES, MemoryEstimate
from runner.train.plan import RunPlan, batches_per_rank, plan_run


def report(spec: RunSpec, data: PreparedData | StreamedData, world_size: int, planner: Planner, room: Budget) -> str:
    shape = planner.shape
    streamed = isinstance(data, StreamedData)
    train_blocks = 0 if streamed else len(data.train)  # a stream's length is unknown
    if spec.train.objective.online_rl:  # its loader's rows: an epoch's completions, whole steps
        layout = stream_layout(train_blocks, spec.rl, global_batch(spec.train, world_size))
        train_blocks = layout.steps_per_epoch * layout.global_batch
    plan = plan_run(
        spec,
        world_size,
        batches_per_rank=batches_per_rank(train_blocks, spec.train.per_device_batch_size, world_size),
        block_size=data.block_size,
        train_blocks=train_blocks,
        eval_blocks=len(data.validation),
        parameters=shape.parameters,
        trainable_parameters=shape.trainable or 0,
        precision=spec.precision.kind.value,
        device="cuda" if torch.cuda.is_available() else "cpu",
        stream=data.source if streamed else "",
    )
    mine = planner.estimate(plan.strategy)
    lines = verdict_lines(planner, COMPARED_STRATEGIES, room)
    return f"{spec_to_yaml(spec)}\n{dry_run_report(plan, mine, planner.eval_batch())}\n" + "\n".join(lines)


def dry_run_report(plan: RunPlan, estimate: MemoryEstimate, eval_batch: int) -> str:
    p = plan
    lines = [
        "runner: dry run (nothing trained, no run folder written)",
        f"  world size      {p.world_size} ({p.strategy}, precision {p.precision}, device {p.device})",
        f"  global batch    {p.global_batch_size} = {p.per_device_batch_size} per device x {p.world_size} process(es)"
        f" x {p.grad_accum_steps} accumulation",
        f"  tokens/step     {p.tokens_line}",
        f"  data            {p.data_line}",
        f"  steps           {p.steps_line}",
        f"  parameters      {p.model_line.removesuffix(' parameters')}",
        f"  learning rate   {p.lr:g} configured, {p.effective_lr:g} in effect",
        f"  memory per rank at its peak ({p.strategy}, {p.micro_batch_line}):",
        f"    parameters    {gib(estimate.params)}",
        *([f"    reference     {gib(estimate.reference)}  (preference.reference=frozen: the starting weights "
           "again, sharded as the parameters are)"] if estimate.reference else []),
        f"    gradients     {gib(estimate.grads)}" + ("  (the trainable parameters' only)" if p.trainable != p.parameters else ""),
        f"    optimizer     {gib(estimate.optimizer)}",
        f"    buffers       {gib(estimate.buffers)}  (DDP's gradient buckets; ZeRO's reduce bucket and gathered parameters; FSDP's gathered root and layers)",
        f"    activations   {gib(estimate.activations)}  (one micro-batch traced on fake tensors, with the gradients "
        "backward holds beside them)",
        (f"    evaluation    {gib(estimate.evaluation_total)}  (the states allocated between steps and one evaluation "
         f"batch of {eval_batch} traced: train.per_device_eval_batch_size, else the micro-batch)"
         if estimate.evaluation is not None else
         f"    evaluation    below the step  (the chunked head evaluating a batch of {eval_batch}, no larger than "
         "the micro-batch: not traced)"),
        *([f"    generation    {gib(estimate.generation_total)}  (the states between steps and one group's sampling, "
           f"{gib(estimate.generation)}: the KV cache of rl.num_generations x (prompt + completion) tokens and its logits)"]
          if estimate.generation else []),
        f"    peak          {gib(estimate.device_total)}  ({estimate.decided_by})"
        + (f"  (+ {gib(estimate.offloaded)} offloaded to host memory)" if estimate.offloaded else ""),
    ]
    return "\n".join(lines)
