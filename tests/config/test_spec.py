"""Composition against the schema: every recipe and group option, and bad keys/types."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from runner.config.errors import compose_error
from runner.config.paths import conf_dir, recipes_dir
from runner.config.spec import PrecisionKind, RunSpec, StrategyKind, load_spec, save_spec
from runner.config.validate import check_data_source, check_numbers
from runner.launch.preflight import check_model

RECIPES = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
GROUP_OPTIONS = sorted(
    (group.name, option.stem) for group in conf_dir().iterdir() if group.is_dir() for option in group.glob("*.yaml")
)


def test_there_are_recipes_and_groups():
    assert {"gpt2_clm", "gpt2_clm_tiny", "gpt2_dpo_tiny", "qwen_dpo_lora"} <= set(RECIPES)
    groups = {g for g, _ in GROUP_OPTIONS}
    assert {"model", "data", "optim", "schedule", "train", "launch", "strategy", "precision"} <= groups
    assert {"ddp", "zero2", "zero3"} <= {o for g, o in GROUP_OPTIONS if g == "strategy"}
    assert {o for g, o in GROUP_OPTIONS if g == "precision"} == {"fp32", "bf16", "fp16"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(compose_spec, recipe):
    spec = compose_spec(f"recipe={recipe}")
    assert isinstance(spec, RunSpec)
    assert spec.name == recipe
    assert check_numbers(spec) == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_opens_with_a_header(recipe):
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    header = text.split("\ndefaults:")[0]
    for word in ("Trains:", "Hardware:", "Launch:", "Batch:"):
        assert word in header, f"{recipe}.yaml header lacks '{word}'"


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_every_group_option_composes_and_validates(compose_spec, group, option):
    spec = compose_spec("recipe=gpt2_clm_tiny", f"{group}={option}")
    assert check_numbers(spec) == []
    if group == "strategy":
        assert spec.strategy.kind is StrategyKind(option)
    if group == "precision":
        assert spec.precision.kind is PrecisionKind(option)


def test_tiny_recipe_validates_offline(compose_spec):
    spec = compose_spec("recipe=gpt2_clm_tiny")
    assert check_data_source(spec) == []
    assert check_model(spec) == []
    assert Path(spec.data.train_file).name == "austen.txt.gz"  # resolved to the vendored file


def test_gpt2_clm_is_run_clm_faithful(compose_spec):
    spec = compose_spec("recipe=gpt2_clm")
    assert spec.model.name_or_path == "gpt2"
    assert (spec.data.dataset_name, spec.data.dataset_config_name) == ("wikitext", "wikitext-2-raw-v1")
    assert spec.data.block_size is None  # min(1024, positions), resolved at run time
    assert spec.train.per_device_batch_size == 8
    assert spec.optim.lr == 5e-5
    assert spec.train.num_epochs == 3 and spec.train.max_steps is None
    assert spec.data.validation_split_percentage == 5


def test_gpt2_clm_offline_names_the_fix(compose_spec):
    problems = check_model(compose_spec("recipe=gpt2_clm"))
    assert problems and "gpt2_clm_tiny" in problems[0] and "model.name_or_path=/local/dir" in problems[0]


def test_the_dpo_lora_recipe_is_a_valid_run_spec_offline(compose_spec, tmp_path):
    """recipe=qwen_dpo_lora composes and validates to the run spec it says (the model and
    the data are the hub's: the launcher's pre-flight names the way out offline, as for
    gpt2_clm); its data is read from a local copy in tests/components/data/test_preference.py."""
    from runner.config.spec import DataFormat, ObjectiveKind, PeftKind, PreferenceLoss, ReferenceMode
    from runner.config.validate import spec_problems
    from runner.launch.preflight import check_data_files

    spec = compose_spec("recipe=qwen_dpo_lora")
    assert spec_problems(spec) == []
    assert spec.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    d = spec.data
    assert (d.dataset_name, d.train_file, d.train_split, d.validation_split) == (
        "HuggingFaceH4/ultrafeedback_binarized", None, "train_prefs", "test_prefs")
    assert (d.format, d.prompt_field, d.chosen_field, d.rejected_field) == (DataFormat.preference, "prompt", "chosen", "rejected")
    assert d.chat_template is None and d.block_size == 1024  # Qwen's own template; TRL's max_length
    assert (spec.train.objective, spec.preference.loss_type, spec.preference.beta) == (ObjectiveKind.dpo, PreferenceLoss.sigmoid, 0.1)
    assert spec.preference.reference is ReferenceMode.adapter_off
    assert (spec.peft.kind, spec.peft.rank, spec.peft.alpha) == (PeftKind.lora, 32, 16.0)
    t = spec.train
    assert (t.per_device_batch_size, t.grad_accum_steps, t.num_epochs, spec.optim.reference_global_batch) == (2, 8, 1, 16)
    save_spec(spec, tmp_path / "run_spec.yaml")
    assert load_spec(tmp_path / "run_spec.yaml") == spec
    assert "model.name_or_path=/local/dir" in check_model(spec)[0]
    assert "data.train_file=" in check_data_files(spec)[0]


def test_user_facing_names_exist(compose_spec):
    spec = compose_spec(
        "recipe=gpt2_clm_tiny",
        "train.per_device_batch_size=16",
        "train.grad_accum_steps=4",
        "train.max_steps=7",
        "train.num_epochs=2",
        "train.seed=3",
        "train.log_every=0",
        "train.eval_every=0",
        "train.save_every=0",
        "data.validation_split_percentage=10",
        "data.text_column=text",
        "data.block_size=64",
        "model.config_overrides='n_embd=10,resid_pdrop=0.2'",
        "optim.lr=0.1",
        "launch.nproc_per_node=2",
        "overwrite=true",
    )
    assert (spec.train.per_device_batch_size, spec.train.grad_accum_steps, spec.train.max_steps) == (16, 4, 7)
    assert spec.model.config_overrides == "n_embd=10,resid_pdrop=0.2"
    assert spec.launch.nproc_per_node == "2" and spec.overwrite is True


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.per_device_batchsize=4", "unknown key 'train.per_device_batchsize'. Did you mean 'train.per_device_batch_size'?"),
        ("optim.learning_rate=0.1", "unknown key 'optim.learning_rate'"),
        ("train.max_steps=ten", "bad value for 'train.max_steps'"),
        ("strategy.kind=zero4", "expected one of [ddp, zero2, zero3, fsdp, accelerate_config]"),
        ("precision.kind=fp8", "expected one of [fp32, bf16, fp16]"),
    ],
)
def test_schema_rejects_unknown_keys_and_wrong_types(compose_spec, override, expected):
    with pytest.raises(ConfigCompositionException) as info:
        compose_spec("recipe=gpt2_clm_tiny", override)
    assert expected in compose_error(info.value).render()


def test_spec_round_trips_through_yaml(compose_spec, tmp_path):
    spec = compose_spec("recipe=gpt2_clm_tiny", "precision=bf16", "train.grad_accum_steps=2")
    save_spec(spec, tmp_path / "run_spec.yaml")
    assert load_spec(tmp_path / "run_spec.yaml") == spec
    assert "${" not in (tmp_path / "run_spec.yaml").read_text()  # fully resolved


def test_frozen_spec_rejects_a_hand_edited_typo(compose_spec, tmp_path):
    path = tmp_path / "run_spec.yaml"
    save_spec(compose_spec("recipe=gpt2_clm_tiny"), path)
    data = OmegaConf.load(path)
    data.train["max_stepz"] = 3
    OmegaConf.save(data, path)
    with pytest.raises(Exception, match="max_stepz"):
        load_spec(path)
