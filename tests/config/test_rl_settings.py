"""rl.* and train.objective=grpo: each impossible combination refused in one line naming
the fix: the spec's own fields (config/rl_checks.py), and through the real entry point what
needs the prompts or the rewards built (launch/preflight.py), before any folder is made."""

from __future__ import annotations

import pytest

from runner.cli import main
from runner.config.validate import spec_problems


@pytest.mark.parametrize("overrides, says", [
    (["rl.num_generations=1"], "rl.num_generations=1: a group needs at least 2"),
    (["train.per_device_batch_size=6"], "(6 completions: train.per_device_batch_size x 1 processes x accumulation) "
                                        "does not hold whole groups of rl.num_generations=8"),
    (["rl.loss_type=bnpo"], "rl.loss_type=bnpo normalises over each micro-batch's own tokens"),
    (["rl.rewards=[]"], "rl.rewards is empty: declare at least one"),
    (["rl.temperature=0"], "rl.temperature=0.0 must be above 0"),
    (["data.format=prompt_completion"], "train.objective=grpo trains on data.format=prompts"),
    (["recipe=gpt2_clm_tiny", "train.objective=grpo"], "train.objective=grpo trains on data.format=prompts"),
    (["recipe=gpt2_clm_tiny", "rl.beta=0.1"], "rl.beta set, but train.objective is not online RL"),
    (["objective=rloo", "rl.loss_type=grpo"], "rl.loss_type set: GRPO's, and objective=rloo's loss is RLOO's"),
])
def test_a_bad_rl_setting_is_refused_naming_the_fix(compose_spec, overrides, says):
    recipe = [] if any(o.startswith("recipe=") for o in overrides) else ["recipe=gpt2_grpo_tiny"]
    problems = spec_problems(compose_spec(*recipe, *overrides))
    assert any(says in problem for problem in problems), problems


def test_the_connected_recipe_composes_and_validates_offline(compose_spec):
    spec = compose_spec("recipe=qwen_grpo_lora")
    assert spec_problems(spec) == []
    assert (spec.data.dataset_name, spec.data.prompt_field, spec.rl.chat_prompts) == ("openai/gsm8k", "question", True)
    assert spec.peft.kind.value == "lora" and spec.rl.rewards[0].extract.value == "last_number"


def test_the_recipe_is_valid_and_rloo_takes_trls_defaults(compose_spec):
    assert spec_problems(compose_spec("recipe=gpt2_grpo_tiny")) == []
    rloo = compose_spec("objective=rloo", "data=arith", "rl.rewards=[{kind:exact_match,extract:last_number}]")
    assert spec_problems(rloo) == [] and (rloo.rl.num_generations, rloo.rl.beta) == (2, 0.05)


@pytest.mark.parametrize("overrides, says", [
    (["rl.rewards=[{kind:regex,pattern:'(ab'}]"], "does not compile"),
    (["rl.rewards=[{kind:function,function:'no_such_module_here:score'}]"], "no_such_module_here"),
    (["rl.max_completion_length=60"], "+ rl.max_completion_length=60 is longer than the model's 64 positions"),
])
def test_what_needs_the_prompts_or_the_rewards_is_refused_before_any_folder(capsys, tmp_path, overrides, says):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["recipe=gpt2_grpo_tiny", f"hydra.run.dir={run_dir}", *overrides])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("runner: error:")]
    assert len(lines) == 1 and says in lines[0], err
    assert not run_dir.exists()
