"""preference.* and train.objective=dpo: each impossible combination refused in one line naming the fix."""

from __future__ import annotations

import pytest

from runner.config.spec import ReferenceMode
from runner.config.validate import reference_mode, spec_problems


@pytest.mark.parametrize("overrides, says", [
    (["objective=dpo", "data.format=prompt_completion"], "train.objective=dpo trains on data.format=preference"),
    (["data.format=preference"], "data.format=preference is trained by train.objective=dpo"),
    (["recipe=gpt2_sft_tiny", "train.objective=dpo"], "train.objective=dpo trains on data.format=preference"),
    (["recipe=gpt2_dpo_tiny", "preference.beta=0"], "preference.beta=0.0 must be > 0"),
    (["recipe=gpt2_dpo_tiny", "preference.label_smoothing=0.5"], "must be in [0, 0.5)"),
    (["recipe=gpt2_dpo_tiny", "preference.loss_type=ipo", "preference.label_smoothing=0.1"],
     "preference.label_smoothing is for loss_type=sigmoid or simpo, not ipo"),
    (["recipe=gpt2_dpo_tiny", "preference.gamma=1.0"], "preference.gamma is SimPO's margin, not sigmoid's"),
    (["recipe=gpt2_dpo_tiny", "preference.loss_type=orpo", "preference.reference=precomputed"],
     "preference.loss_type=orpo is reference-free"),
    (["recipe=gpt2_dpo_tiny", "preference.reference=none"], "compares against a reference model"),
    (["recipe=gpt2_dpo_tiny", "preference.reference=adapter_off"], "this run has none: set peft=lora"),
    (["recipe=gpt2_clm_tiny", "preference.beta=0.5"], "preference.* is set but train.objective is not dpo"),
])
def test_a_bad_preference_setting_is_refused_naming_the_fix(compose_spec, overrides, says):
    problems = spec_problems(compose_spec(*overrides))
    assert any(says in problem for problem in problems), problems


def test_the_recipe_and_its_variants_are_valid_and_pick_their_reference(compose_spec):
    assert spec_problems(compose_spec("recipe=gpt2_dpo_tiny")) == []
    assert reference_mode(compose_spec("recipe=gpt2_dpo_tiny")) is ReferenceMode.precomputed
    assert reference_mode(compose_spec("recipe=gpt2_dpo_tiny", "peft=lora")) is ReferenceMode.adapter_off
    # frozen: a copy of the starting weights; with peft too (the base, as adapter_off scores it, but a second copy)
    for frozen in (compose_spec("recipe=gpt2_dpo_tiny", "preference.reference=frozen"),
                   compose_spec("recipe=gpt2_dpo_tiny", "preference.reference=frozen", "peft=lora",
                                "model.name_or_path=/a/saved/model")):
        assert spec_problems(frozen) == [] and reference_mode(frozen) is ReferenceMode.frozen
    simpo = compose_spec("recipe=gpt2_dpo_tiny", "preference.loss_type=simpo", "preference.gamma=1.0")
    assert spec_problems(simpo) == [] and reference_mode(simpo) is ReferenceMode.none
