"""data.mixture's settings: each impossible one refused in one line naming the fix, each
source checked as a run of it alone, and the offline recipe valid as shipped."""

from __future__ import annotations

import pytest

from runner.config.mixture import evaluation_quota, row_format, shares_asked, source_names, source_specs
from runner.config.spec import DataFormat
from runner.config.validate import spec_problems

MIX = "recipe=gpt2_mix_tiny"


def test_the_offline_mixture_recipe_is_valid_and_reads_as_two_sources(compose_spec):
    spec = compose_spec(MIX)
    assert spec_problems(spec) == []
    assert source_names(spec.data) == ["novels", "instructions"] and shares_asked(spec.data) == [0.7, 0.3]
    assert [s.format for s in source_specs(spec.data)] == [DataFormat.text, DataFormat.prompt_completion]
    assert all(s.block_size == 256 and s.packing for s in source_specs(spec.data))  # the run's settings
    assert row_format(spec.data) is DataFormat.prompt_completion


@pytest.mark.parametrize("overrides, says", [
    (["data.mixture.0.weight=-1"], "source novels has weight -1.0: a weight is a finite number >= 0"),
    (["data.mixture.0.weight=0", "data.mixture.1.weight=0"], "every weight is 0"),
    (["data.mixture.1.weight=nan"], "source instructions has weight nan"),
    (["data.train_file=/data/x.txt"], "set data.train_file=null (or make it a source of the mixture)"),
    # a stream reads text blocks only: the instruction source is refused, named
    (["data.streaming=true", "train.max_steps=4"], "source instructions: data.format=prompt_completion reads its "
                                                   "examples into the cache; data.streaming=true is for data.format=text"),
    (["data.mixture.1.format=preference", "objective=dpo"], "preference pairs train a preference objective and mix "
                                                           "with nothing else"),
    # two text sources: data.packing (the recipe's) is an instruction format's, refused as for one source
    (["data.mixture.1.format=text"], "source instructions: data.packing set with data.format=text"),
    (["data.mixture.0.format=chat"], "source novels: data.format=chat reads .json or .jsonl records"),
    (["data.mixture=[]"], "data.mixture is an empty list"),
])
def test_a_bad_mixture_is_refused_naming_the_fix(compose_spec, overrides, says):
    problems = spec_problems(compose_spec(MIX, *overrides))
    assert any(says in problem for problem in problems), problems


def test_a_weight_that_is_not_a_number_is_refused_by_the_schema(compose_spec):
    from hydra.errors import ConfigCompositionException

    from runner.config.errors import compose_error

    with pytest.raises(ConfigCompositionException) as refused:
        compose_spec(MIX, "data.mixture.0.weight=heavy")
    message = str(compose_error(refused.value))
    assert "data.mixture.0.weight" in message and "could not be converted to Float" in message, message


def test_the_connected_mixture_recipe_composes_and_validates_offline(compose_spec):
    """recipe=gpt2_mix names hub datasets (unreachable here): its spec composes and
    validates, its sources are a chat set and run_clm text, with the run's settings."""
    spec = compose_spec("recipe=gpt2_mix")
    assert spec_problems(spec) == []
    assert source_names(spec.data) == ["no_robots", "wikitext"] and shares_asked(spec.data) == [0.6, 0.4]
    chat, text = source_specs(spec.data)
    assert (chat.dataset_name, chat.format, text.dataset_config_name, text.format) == (
        "HuggingFaceH4/no_robots", DataFormat.chat, "wikitext-103-raw-v1", DataFormat.text)
    assert chat.chat_template and chat.block_size == text.block_size == 1024 and chat.packing


@pytest.mark.parametrize("sizes, cap, quota", [
    ([50, 40], None, [50, 40]),  # no cap: every row
    ([50, 40], 9, [5, 4]),  # an even share, the remainder to the first source
    ([2, 40, 40], 12, [2, 5, 5]),  # a short source's leftover goes to the others
    ([0, 3, 100], 10, [0, 3, 7]),
    ([10, 10], 1, [1, 0]),
    ([3, 4], 100, [3, 4]),  # a cap above the rows there are
])
def test_max_eval_samples_is_shared_evenly_and_never_wasted(sizes, cap, quota):
    assert evaluation_quota(sizes, cap) == quota
