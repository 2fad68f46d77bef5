"""train.objective=grpo against TRL 1.16's GRPOTrainer, and train.objective=rloo against its
RLOOTrainer, end to end, on identical rollouts.

Both trainers start from the same saved tiny model (fp32, dropout off) and train the same
prompts in the same order on the same fixed completions (sampling is the one part they
cannot share: tests/train/grpo_trl_rollouts.py patches runner's sample_group and
transformers' generate, as TRL's own tests do, and says what else is aligned and how).
Every step's loss, gradient norm, reward, reward_std, frac_reward_zero_std, the rewards'
means, entropy, kl (beta > 0) and clip ratios agree, for DAPO's loss (TRL's default) and
grpo's, beta 0 and 0.04 (runner's frozen reference against TRL's ref_model), on GPT-2
and Llama, and with two optimizer steps a generation batch, where the ratio leaves 1 and
the clip acts. RLOO the same on GPT-2 (the tests at the end): beta 0.05 (both sides'
default; kl, RLOO's k1 of the sampling pass, is a generation figure in TRL's log) and
beta 0 at two steps a generation (the sequence ratio leaves 1, the clip acts).

How close is close. TRL scores log-probs through its fused, chunked LM head
(trl.trainer.utils.add_fused_lm_head; no GRPOConfig option turns it off, cast_lm_head_to_fp32
only changes a dtype), runner from the whole logits with torch's log_softmax.
test_trls_fused_head_is_within_float_error measures that gap on one forward and backward:
float rounding (log-probs within ~2 ulp, gradient norm within 2e-8 relative). Over a run,
AdamW turns rounding into drift: its first steps move every weight by ~lr x sign(g), so
an element whose gradient is rounding noise (the attention's key bias, whose exact
gradient is 0) moves by a different ±lr in two programs. TRL against itself, fused head
against exact scoring patched in, drifts by up to 7e-6 (gradient norm, relative) in the
two-steps-a-generation run at lr 3e-2; runner against either TRL drifts by up to 3e-5
there, 1e-5 at lr 1e-3 (its rows are padded to a different width, so other GEMM shapes,
and TRL's logged norm is fp32 arithmetic, ~1e-6 off at step 1). GRAD_NORM_TOLERANCE is
that largest drift with a margin; a real difference is far outside it (the KL bias
correction left out on one side alone moves the gradient norm by 2e-4 to 1e-3 at beta 0.04).
RLOOTrainer scores through the same fused head (policy and reference); in
test_rloo_two_steps_a_generation_equal_trls TRL's RLOO against itself with exact scoring
patched in drifts by 1.2e-5, runner against either by 2.2e-5 and 2.6e-5; a baseline that
counts the completion itself moves the gradient norm by 25% at step 1, the KL penalty left
out of the advantages by 9e-3 at step 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_trl_rollouts import (BATCH, G, SEED, FixedCompletions, exact_trl_scores, fused_head_gap, runner_command,
                               runner_order, runner_sampler, runner_steps, save_model, tokenizer_dir, trl_generate,
                               trl_rloo_trainer, trl_steps, trl_trainer, write_prompts)
from runs import run_cli

pytestmark = [pytest.mark.e2e]

STEPS = 4
# TRL's fused head against the exact computation on one forward and backward (fp32, CPU),
# measured by test_trls_fused_head_is_within_float_error: log-probs (near -10.8, where an
# ulp is 9.5e-7) within 1.9e-6 (GPT-2) and 9.5e-7 (Llama); the gradient norm within 7e-9
# (GPT-2) and 1.8e-8 (Llama) relative. The bounds: those, doubled or more.
FUSED_LOGP_GAP, FUSED_GRAD_GAP = 4e-6, 5e-8
# Every step of the runs (see the module's docstring): the gradient norm relative, the
# others absolute (loss relative past 1; entropy is ~10.8, 1e-5 is ~10 ulp).
GRAD_NORM_TOLERANCE = 6e-5
TOLERANCE = {"loss": 2e-6, "kl": 2e-6, "entropy": 1e-5}
GENERATION_FIGURES = ("reward", "reward_std", "frac_reward_zero_std", "rewards/exact_match/mean",
                      "rewards/has_digit/mean")
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# TRL 1.16's GRPOConfig defaults use_bias_correction_kl=True (the KL term times the
# importance ratio, whose gradient is not 0 where its value is 1), and so does runner's
# rl.use_bias_correction_kl; one case holds both sides with it off.
CORRECTED_KL = {"beta": 0.04}
PLAIN_KL = {"beta": 0.04, "use_bias_correction_kl": False}


def prompts_for(tmp_path: Path, steps: int) -> tuple[Path, Path, list[dict]]:
    """As many prompts as the run trains groups (one epoch: every prompt once), and 2 held out."""
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    rows = write_prompts(train, steps * BATCH // G, 0)
    write_prompts(validation, 2, 1000)
    return train, validation, rows


def fixed_completions(*files: Path) -> FixedCompletions:
    import json

    from transformers import AutoTokenizer

    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    return FixedCompletions(records, AutoTokenizer.from_pretrained(tokenizer_dir()))


def both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, runner_extra: tuple[str, ...] = (),
         steps: int = STEPS, exact_trl: bool = False, rloo: bool = False,
         **trl_options: object) -> tuple[list[dict], ...]:
    """Runner's run and TRL's (and, with exact_trl, TRL's again with exact scoring patched
    in), each on the fixed completions: every logged step of each. rloo: TRL's RLOOTrainer
    (runner_extra then names objective=rloo), else its GRPOTrainer."""
    import transformers
    import trl.trainer.grpo_trainer as grpo_trainer
    import trl.trainer.rloo_trainer as rloo_trainer

    from runner.distributed.accelerator import reset_accelerate_state

    model = save_model(tmp_path / f"tiny_{arch}", arch)
    train, validation, rows = prompts_for(tmp_path, steps)
    ours_fixed = fixed_completions(train, validation)
    with monkeypatch.context() as patch:
        patch.setattr("runner.components.rollouts.sample_group", runner_sampler(ours_fixed))
        run = tmp_path / "runner"
        done = run_cli(runner_command(run, model, train, validation, steps, *runner_extra))
        assert done.returncode == 0, done.stderr[-3000:]
    assert ours_fixed.calls > 0
    results = [runner_steps(run)]
    assert all("sampling/logp_difference/mean" in r for r in results[0])

    order = runner_order(len(rows), len(rows), SEED)
    for exact in (False, True) if exact_trl else (False,):
        theirs_fixed = fixed_completions(train, validation)
        with monkeypatch.context() as patch:
            patch.setattr(transformers.GenerationMixin, "generate", trl_generate(theirs_fixed))
            module, cls, build = ((rloo_trainer, rloo_trainer.RLOOTrainer, trl_rloo_trainer) if rloo
                                  else (grpo_trainer, grpo_trainer.GRPOTrainer, trl_trainer))
            patch.setattr(module, "shuffle_sequence_dict", lambda batch: batch)  # runner trains shares in order
            if exact:
                patch.setattr(cls, "_get_per_token_logps_and_entropies", exact_trl_scores)
            try:
                trainer = build(tmp_path / f"trl_{exact}", model, rows, order, steps, **trl_options)
                results.append(trl_steps(trainer))
            finally:
                reset_accelerate_state()  # TRL's Accelerator is no later in-process run's
        assert theirs_fixed.calls > 0
    return tuple(results)


def assert_every_step_equal(ours: list[dict], theirs: list[dict], steps: int, beta: float, generation_every: int = 1,
                            title: str = "runner vs TRL", kl_at_generation: bool = False) -> dict[str, float]:
    """Every step's figures within the tolerances (the generation's figures within 1e-6:
    the same rewards of the same strings); prints both sides, each gap and the largest.
    kl_at_generation: kl is a generation figure (RLOO's, of the sampling pass), not a step's."""
    assert len(ours) == len(theirs) == steps, (len(ours), len(theirs))
    names = ["loss", "grad_norm", "entropy", *GENERATION_FIGURES, *CLIPS] + (["kl"] if beta else [])
    generation_figures = GENERATION_FIGURES + (("kl",) if kl_at_generation else ())
    worst: dict[str, float] = {}
    print(f"\n{title}\n{'step':>4} {'figure':<26} {'runner':>15} {'TRL':>15} {'gap':>9}")
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        assert a["step"] == b["step"] == step
        generated = (step - 1) % generation_every == 0
        for name in names:
            if name in generation_figures and not generated:
                assert name not in b  # TRL logs the generation's figures at the steps that generate
                continue
            if name == "grad_norm":
                gap, bound = abs(a[name] - b[name]) / abs(b[name]), GRAD_NORM_TOLERANCE
            else:
                scale = max(1.0, abs(b[name])) if name == "loss" else 1.0
                gap, bound = abs(a[name] - b[name]), TOLERANCE.get(name, 1e-6) * scale
            worst[name] = max(worst.get(name, 0.0), gap)
            print(f"{step:>4} {name:<26} {a[name]:>15.9g} {b[name]:>15.9g} {gap:>9.1e}")
            assert gap <= bound, (step, name, a[name], b[name])
        # logged with the generation's figures: the sampling pass against the log-probs at the
        # weights that sampled (TRL's measure), what the stand-in scored; the largest one too
        if "sampling/logp_difference/mean" in a:
            assert a["sampling/logp_difference/mean"] <= a["sampling/logp_difference/max"] < 1e-5, step
    print("largest gaps (grad_norm relative):", {k: f"{v:.1e}" for k, v in worst.items()})
    # Not two frozen copies agreeing: the rewards vary within groups and the model moves.
    assert any(b["reward_std"] > 0 for b in theirs if "reward_std" in b)
    assert all(b["grad_norm"] > 1e-3 for b in theirs)
    if beta and kl_at_generation:  # RLOO's k1 estimate of the sampling pass: 0 at the first, of any sign after
        assert any(abs(b["kl"]) > 1e-6 for b in theirs if "kl" in b), [b.get("kl") for b in theirs]
    elif beta:
        assert ours[-1]["kl"] > 0
    return worst


def test_trls_fused_head_is_within_float_error(tmp_path):
    """TRL's GRPOTrainer scores through add_fused_lm_head; on the test's models (fp32) its
    log-probs and the gradient norm of a DAPO-like loss equal the exact computation's
    (whole logits / T, torch's log_softmax) within float rounding. Printed per architecture."""
    from transformers import AutoTokenizer

    train, validation, rows = prompts_for(tmp_path, 2)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    fixed = fixed_completions(train, validation)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    for arch in ("gpt2", "llama"):
        logp_gap, grad_gap = fused_head_gap(save_model(tmp_path / arch, arch), fixed, prompts)
        print(f"\n{arch}: TRL's fused head vs exact: log-prob max |diff| {logp_gap:.2e}, "
              f"grad-norm relative diff {grad_gap:.2e}")
        assert logp_gap <= FUSED_LOGP_GAP and grad_gap <= FUSED_GRAD_GAP, (arch, logp_gap, grad_gap)


CASES = {
    # name: (arch, runner's overrides, TRL's options); GPT-2's dapo at beta 0 is
    # test_two_steps_a_generation_equal_trls[dapo]'s (its on-policy steps, and the rest)
    "gpt2-dapo-beta0.04": ("gpt2", ("rl.beta=0.04",), CORRECTED_KL),
    "gpt2-grpo-beta0.04-uncorrected": ("gpt2", ("rl.loss_type=grpo", "rl.beta=0.04", "rl.use_bias_correction_kl=false"),
                                       {"loss_type": "grpo", **PLAIN_KL}),
    "llama-dapo-beta0.04": ("llama", ("rl.beta=0.04",), CORRECTED_KL),
    "llama-grpo-beta0": ("llama", ("rl.loss_type=grpo",), {"loss_type": "grpo"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_equals_trls_grpo_trainer(tmp_path, monkeypatch, case):
    """One generation batch a step, the ratio 1: grpo's loss is ~0 (advantages centred),
    dapo's is not (completions of unequal length); the gradient norm discriminates."""
    arch, runner_extra, trl_options = CASES[case]
    ours, theirs = both(tmp_path, monkeypatch, arch, runner_extra, **trl_options)
    assert_every_step_equal(ours, theirs, STEPS, float(trl_options.get("beta", 0.0)), title=case)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_steps_a_generation_equal_trls(tmp_path, monkeypatch, loss_type):
    """runner's rl.steps_per_generation=2 is TRL's steps_per_generation=2 x accumulation (1):
    each second step trains the batch's second half under the weights the first moved, so
    the ratio leaves 1 and, at this learning rate and epsilon, the clip acts. dapo is also
    held to TRL with exact scoring patched in (its fused head out of the comparison)."""
    steps, lr, epsilon = 6, 3e-2, 0.05
    runs = both(tmp_path, monkeypatch, "gpt2", ("rl.steps_per_generation=2", f"rl.loss_type={loss_type}",
                                                f"optim.lr={lr}", f"rl.epsilon={epsilon}"),
                steps=steps, exact_trl=loss_type == "dapo", steps_per_generation=2, loss_type=loss_type,
                learning_rate=lr, epsilon=epsilon)
    ours, theirs = runs[0], runs[1]
    assert_every_step_equal(ours, theirs, steps, 0.0, generation_every=2, title=f"{loss_type}, 2 steps a generation")
    if len(runs) > 2:
        assert_every_step_equal(ours, runs[2], steps, 0.0, generation_every=2, title="runner vs TRL, exact scoring")
        assert_every_step_equal(runs[2], theirs, steps, 0.0, generation_every=2, title="TRL exact vs TRL fused head")
    assert any(b["clip_ratio/region_mean"] > 0 for b in theirs[1::2]), [b["clip_ratio/region_mean"] for b in theirs]
    assert any(abs(b["loss"]) > 1e-3 for b in theirs[1::2])  # off-policy steps: even grpo's loss leaves 0


# --------------------------------------------------------------------------- RLOO against TRL's RLOOTrainer


RLOO = ("objective=rloo", f"rl.num_generations={G}")  # the rloo group's default is RLOOConfig's 2
RLOO_CASES = {
    # name: (runner's overrides, TRL's options); beta 0.05 is both sides' default (conf/objective/rloo.yaml,
    # RLOOConfig), the reference the starting weights on both (runner's frozen copy, TRL's ref_model loaded
    # from the same folder)
    "gpt2-rloo-beta0.05": (RLOO, {}),
    # beta 0: test_rloo_two_steps_a_generation_equal_trls
}


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_every_step_equals_trls_rloo_trainer(tmp_path, monkeypatch, case):
    """One generation batch a step, the ratio 1: the loss is ~0 (leave-one-out advantages
    sum to 0 in a group), the gradient norm discriminates; beta 0.05's kl (k1 of the
    sampling pass, logged at generation) and its penalised rewards (frac_reward_zero_std)."""
    runner_extra, trl_options = RLOO_CASES[case]
    ours, theirs = both(tmp_path, monkeypatch, "gpt2", runner_extra, rloo=True, **trl_options)
    assert_every_step_equal(ours, theirs, STEPS, float(trl_options.get("beta", 0.05)), title=case,
                            kl_at_generation=True)


def test_rloo_two_steps_a_generation_equal_trls(tmp_path, monkeypatch):
    """rl.steps_per_generation=2 = TRL's steps_per_generation=2 (no accumulation), beta 0:
    each second step trains the batch's second half under moved weights, so the sequence
    ratio leaves 1 and, at this learning rate and epsilon, the clip acts."""
    steps, lr, epsilon = 6, 1e-2, 0.05
    ours, theirs = both(tmp_path, monkeypatch, "gpt2", RLOO + ("rl.beta=0", "rl.steps_per_generation=2",
                                                               f"optim.lr={lr}", f"rl.epsilon={epsilon}"),
                        steps=steps, rloo=True, beta=0.0, steps_per_generation=2, learning_rate=lr, epsilon=epsilon)
    assert_every_step_equal(ours, theirs, steps, 0.0, generation_every=2, title="rloo beta 0, 2 steps a generation",
                            kl_at_generation=True)
    assert any(b["clip_ratio/region_mean"] > 0 for b in theirs[1::2]), [b["clip_ratio/region_mean"] for b in theirs]
    assert any(abs(b["loss"]) > 1e-3 for b in theirs[1::2])  # off-policy steps: the loss leaves 0
