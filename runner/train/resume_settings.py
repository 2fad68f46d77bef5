"""What each setting of the spec changes on a resume, decided once for every key of
runner.config.spec.flat_spec_dict: refused (MATH), the schedule planned again (HORIZON),
accepted and printed (HARMLESS), neither (BOOKKEEPING), or decided together as the
run's layout (LAYOUT_KEYS). runner.train.resume's compare applies them and refuses a
change of a key in none (the safe side); tests/train/test_resume_settings.py fails
while a field of the spec is in none of these sets, or in two.
"""

from __future__ import annotations

# Refused: the continued run would not train the model the checkpoint holds, on the same
# data in the same order, with the same update.
MATH = frozenset({
    "model.name_or_path", "model.model_type", "model.config_overrides", "model.tokenizer_name",
    "data.dataset_name", "data.dataset_config_name", "data.train_file", "data.validation_file",
    "data.validation_split_percentage", "data.train_split", "data.validation_split", "data.text_column",
    "data.keep_linebreaks", "data.block_size",
    "data.max_train_samples", "data.preprocessing_num_workers", "data.streaming", "data.shuffle_buffer",
    "data.validation_blocks",  # a stream without a validation file holds these blocks out of training
    # instruction data: other examples, other masks, other rows
    "data.format", "data.prompt_field", "data.completion_field", "data.messages_field", "data.chat_template",
    "data.train_on_prompt", "data.too_long", "data.packing",
    # a mixture: its sources (each a whole list entry: files, formats, weights) and its sampling
    "data.mixture", "data.mixture_stopping", "data.mixture_seed",
    "optim.kind", "optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.eps", "optim.max_grad_norm",
    "optim.scale_lr", "optim.reference_global_batch",
    # The same update by another kernel, but it would not take effect: torch's
    # Optimizer.load_state_dict restores the checkpoint's param groups, `fused` flag included,
    # while whether the non-finite verdict goes to the kernel was decided when the optimizer was
    # built (found_inf_optimizer, runner/distributed/strategy.py): the two would disagree.
    "optim.fused",
    # The schedule's shape and peak (optim.lr above, its batch scaling): another recipe for
    # the update, not a longer run of this one. Only its horizon may move (HORIZON).
    "schedule.kind", "schedule.warmup_steps", "schedule.warmup_ratio",
    "train.seed", "train.objective",
    # preference data and its loss: other pairs, another loss, another reference
    "data.chosen_field", "data.rejected_field", "preference.loss_type", "preference.beta",
    "preference.label_smoothing", "preference.gamma", "preference.reference", "preference.disable_dropout",
    # online RL: other samples, rewards or loss
    "rl.rewards", "rl.chat_prompts", "rl.num_generations", "rl.max_completion_length", "rl.temperature", "rl.loss_type",
    "rl.importance_sampling_level", "rl.epsilon", "rl.epsilon_high", "rl.beta", "rl.use_bias_correction_kl", "rl.scale_rewards",
    "rl.steps_per_generation", "rl.num_iterations", "rl.mask_truncated_completions", "rl.disable_dropout",
    "precision.kind",
    # ZeRO's CPU offload steps DeepSpeedCPUAdam instead of torch's AdamW, and both change how
    # DeepSpeed lays out the optimizer state it saves and loads.
    "strategy.offload_optimizer", "strategy.offload_params",
    # Adapters: which weights train, their shapes and scale, their dropout (adapters of another
    # rank or on other layers would not even load the checkpoint's optimizer state).
    "peft.kind", "peft.rank", "peft.alpha", "peft.dropout", "peft.target_modules", "peft.modules_to_save",
})

# Accepted and printed, and the schedule planned again over the new total: how long the
# run is (num_epochs sets the total only while max_steps is null). Linear and cosine decay,
# and warmup_ratio's warmup, are planned over the total, so each step after the checkpoint
# trains at the new plan's rate (runner/components/optim.py: follow_plan), and
# schedule_note says how the rate moves.
HORIZON = frozenset({"train.max_steps", "train.num_epochs"})

# Accepted and printed (`resume: accepted change KEY: old -> new`): how often, on what,
# through which kernels, and where the numbers go; the update itself is the same.
HARMLESS = frozenset({
    "train.log_every", "train.eval_every", "train.save_every",
    "train.keep_checkpoints", "train.per_device_eval_batch_size",
    "train.dataloader_num_workers",  # except for a stream, whose loader workers each read their own files (compare)
    "data.max_eval_samples", "data.cache_dir",  # evaluation only; a changed cache content is caught by its key
    "launch.max_restarts", "launch.rdzv_endpoint", "launch.rdzv_timeout", "launch.node_rank",
    "launch.timeout_minutes",  # how long a collective may wait (the docs say to raise it for a slow step)
    "launch.debug",  # distributed debug logs
    "launch.start_method",  # how workers start: the same processes, the same math
    "launch.retain_freed_memory",  # whether glibc hands freed host memory back: resident memory, not values
    "launch.device_memory", "launch.check_fit",  # the hardware a resume lands on: it may choose another layout
    "launch.mtbf_hours",  # only the checkpoint interval a run suggests
    "launch.engine", "launch.ray_address",  # who starts the same workers (torch elastic or Ray Train), and where
    "launch.min_workers",  # how few workers Ray may go on with: each group keeps the global batch
    "sweep.parity_baseline", "sweep.retry_failed",
    # benchmark evaluation of the saved model, after training: not what training computes
    "eval.tasks", "eval.num_fewshot", "eval.limit", "eval.batch_size", "eval.device", "eval.dtype",
    "tracking",  # only where metrics go; metrics.jsonl holds every step whichever tracker
    "precision.max_consecutive_skipped_steps",  # when fp16 overflows stop the run, not what a step computes
    "strategy.reshard_after_forward",  # FSDP2 re-gathers parameters or keeps them: memory and communication
    "strategy.zero3_save_16bit_model",  # how model/ is written at the end (false is refused anyway)
    "strategy.config_file",  # where the settings came from: what it sets is compared key by key, after it is read
    "peft.save_merged",  # whether model/ is also written, merged, at the end
    "model.gradient_checkpointing",  # recomputes activations in backward, with the dropout masks of the forward
    # Other kernels for the same math: float sums in another order, as a layout change has.
    # train.deterministic only picks GPU kernels; model.compile fuses the same operations (its
    # losses equal eager's within 1e-4: tests/test_compile.py) and the checkpoint's weights load
    # compiled or not (Accelerate saves them without torch.compile's prefix); the attention
    # kernels compute the same attention (tests/test_e2e.py), and transformers refuses a kernel
    # that lacks an architecture's feature (sdpa with Gemma 2's soft-capping) rather than
    # dropping it. With dropout on, another kernel may draw other masks: the continuation is
    # then statistically the same, not bit for bit, as after a change of layout.
    "train.deterministic", "model.compile", "model.attn_implementation",
    # torch's fused tanh GELU for transformers' Python one: the same function, rounded
    # otherwise (runner/components/activations.py).
    "model.fused_activations",
    # The head and loss over chunks of tokens: the same sums in another order (exact to
    # float rounding against the plain loss, tests/components/test_chunked_loss.py).
    "model.chunked_loss",
})

# Neither refused nor printed: which folder, under which name, how this launch was asked
# for, or set by the launcher. A resume into a new folder changes run_dir by design.
BOOKKEEPING = frozenset({"name", "run_dir", "resume", "overwrite", "dry_run", "probe"})

# Decided together by compare: the global batch must stay; a new layout of it is checked
# for an exact continuation (runner.train.resume's layout_change_problems).
LAYOUT_KEYS = frozenset({"train.grad_accum_steps", "train.global_batch_size", "train.per_device_batch_size",
                         "launch.nproc_per_node", "launch.nnodes",
                         # the same math sharded another way: read across (runner/train/reshard.py)
                         "strategy.kind"})
