"""Cross-field validation: settings that would be accepted and then ignored are refused."""

import pytest

from runner.config.validate import check_strategy
from runner.launch.preflight import check_accelerate_environment, check_fsdp


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["strategy=zero2", "strategy.offload_params=cpu"], "only ZeRO-3 partitions (and so offloads) the parameters"),
        (["strategy=ddp", "strategy.offload_params=cpu"], "strategy.offload_params=none"),
        (["strategy=ddp", "strategy.offload_optimizer=cpu"], "strategy.offload_optimizer=cpu needs ZeRO"),
    ],
)
def test_offload_a_strategy_cannot_do_is_refused(compose_spec, overrides, expected):
    [problem] = check_strategy(compose_spec("recipe=gpt2_clm_tiny", *overrides))
    assert expected in problem


@pytest.mark.parametrize("overrides", [["strategy=zero2", "strategy.offload_optimizer=cpu"],
                                       ["strategy=zero3", "strategy.offload_params=cpu", "strategy.offload_optimizer=cpu"]])
def test_offload_a_strategy_can_do_is_accepted(compose_spec, overrides):
    assert check_strategy(compose_spec("recipe=gpt2_clm_tiny", *overrides)) == []


def test_an_outer_accelerate_launch_must_agree_with_the_spec(compose_spec, monkeypatch):
    spec = compose_spec("recipe=gpt2_clm_tiny", "train.grad_accum_steps=2", "precision=bf16")
    assert check_accelerate_environment(spec) == []
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert check_accelerate_environment(spec) == []
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    accum, mixed = check_accelerate_environment(spec)
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4" in accum and "set train.grad_accum_steps=4" in accum
    assert "ACCELERATE_MIXED_PRECISION=no" in mixed and "set precision=fp32" in mixed


def test_zero2_with_parameter_offload_is_refused_even_in_a_dry_run(capsys, tmp_path):
    from runner.cli import main

    with pytest.raises(SystemExit) as info:
        main(["recipe=gpt2_clm_tiny", "strategy=zero2", "strategy.offload_params=cpu", "dry_run=true",
              f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "strategy.offload_params=cpu" in err and "Traceback" not in err


# ---------------------------------------------------------------- every leaf field, from the schema
# Bad values are generated from each field's type: a wrong type for int / float / bool /
# enum fields, -1 for numbers (no setting takes a negative), a missing option for enums.
# A string can hold anything, so each string field names its bad value here; a string
# field added to the schema without one fails test_every_string_field_has_a_bad_value.
import copy
import dataclasses
import enum
import typing
from pathlib import Path

BAD_STRINGS: dict[str, typing.Callable[[Path], str]] = {
    "name": lambda tmp: "a/b",
    "model.name_or_path": lambda tmp: str(tmp),  # a folder with no model in it
    "model.model_type": lambda tmp: "no_such_model_type",
    "model.config_overrides": lambda tmp: "n_embd",
    "model.tokenizer_name": lambda tmp: str(tmp),  # a folder with no tokenizer in it
    "data.dataset_name": lambda tmp: "no_such_dataset",  # besides the recipe's train_file
    "data.dataset_config_name": lambda tmp: "wikitext-2-raw-v1",  # without a dataset_name
    "data.train_split": lambda tmp: "train_prefs",  # a hub dataset's split, beside the micro run's train_file
    "data.validation_split": lambda tmp: "test_prefs",
    "data.train_file": lambda tmp: str(tmp / "missing.txt"),
    "data.validation_file": lambda tmp: str(tmp / "missing.txt"),
    "data.text_column": lambda tmp: "body",  # the recipe's data is a .txt file
    "data.cache_dir": lambda tmp: str(tmp / "a_file" / "cache"),
    # instruction settings, refused with the micro run's data.format=text
    "data.prompt_field": lambda tmp: "question",
    "data.completion_field": lambda tmp: "answer",
    "data.messages_field": lambda tmp: "conversation",
    "data.chat_template": lambda tmp: "{{ messages }}",
    "data.chosen_field": lambda tmp: "better",  # preference fields, with the micro run's data.format=text
    "data.rejected_field": lambda tmp: "worse",
    "launch.nproc_per_node": lambda tmp: "two",
    "launch.rdzv_endpoint": lambda tmp: "localhost",
    "launch.ray_address": lambda tmp: "nowhere",  # read only under launch.engine=ray (and no HOST:PORT there)
    "launch.device_memory": lambda tmp: "A4O",  # neither a GPU's name nor a size
    "strategy.config_file": lambda tmp: str(tmp / "missing.yaml"),
    "resume": lambda tmp: str(tmp / "no_checkpoint"),
    "run_dir": lambda tmp: str(tmp / "elsewhere"),
    "sweep.parity_baseline": lambda tmp: "strategy",  # neither an index nor key=value overrides
    "eval.device": lambda tmp: "gpu0",
    "eval.dtype": lambda tmp: "fp8",
}


def leaf_fields(node: type = None, prefix: str = "") -> list[tuple[str, type]]:
    from runner.config.spec import RunSpec

    node = node or RunSpec
    out = []
    for f in dataclasses.fields(node):
        kind = typing.get_type_hints(node)[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if typing.get_origin(kind) is typing.Union else kind
        if dataclasses.is_dataclass(kind):
            out += leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", kind))
    return out


def bad_values(key: str, kind: type) -> list[object]:
    if kind is bool:
        return ["maybe"]
    if kind in (int, float):
        return ["many", -1]
    if key == "train.per_device_batch_size":  # a whole number or auto (typed Any in the schema)
        return ["many", -1, 2.5]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return ["no_such_option"]
    return [BAD_STRINGS[key]] if key in BAD_STRINGS else []


CASES = [(key, value) for key, kind in leaf_fields() for value in bad_values(key, kind)]


def test_every_string_field_has_a_bad_value():
    strings = [key for key, kind in leaf_fields() if kind in (str, typing.Any)]
    assert sorted(key for key in strings if key not in BAD_STRINGS and not bad_values(key, typing.Any)) == []


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """The micro run on a small local file (reading the whole corpus per case is slow)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from conftest import MICRO
    from runner.config.store import register
    from runner.config.paths import conf_dir

    text = tmp_path_factory.mktemp("data") / "train.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune.\n" * 200)
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=[*MICRO, f"data.train_file={text}"])


class Launched(Exception):
    """The bad value got past every check."""


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v if not callable(v) else 'bad'}" for k, v in CASES])
def test_every_bad_value_is_refused_in_one_line(composed, key, value, tmp_path, monkeypatch):
    """Through the launcher's own path (runner/launch/start.py): compose-time type errors and validation
    alike end in a UserError naming the field, before anything is launched."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import runner.launch.start
    from runner.launch.start import start
    from runner.config.errors import UserError, compose_error
    from runner.config.spec import to_spec

    (tmp_path / "a_file").write_text("")
    value = value(tmp_path) if callable(value) else value
    monkeypatch.setattr(runner.launch.start, "launch", lambda *a, **k: (_ for _ in ()).throw(Launched()))
    cfg = copy.deepcopy(composed)
    try:
        OmegaConf.update(cfg, key, value, merge=False)
        spec = to_spec(cfg)
        start(spec, tmp_path / "run", overwrite=False)
    except OmegaConfBaseException as err:  # what Hydra's compose raises for the same override
        error = compose_error(err)
    except UserError as err:
        error = err
    else:
        pytest.fail(f"{key}={value!r} was accepted")
    message = error.render()
    assert key in message, message
    assert "Traceback" not in message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["strategy=ddp", "strategy.reshard_after_forward=false"], "reshard_after_forward=false is an FSDP2 setting"),
        (["strategy=fsdp", "strategy.offload_optimizer=cpu"], "FSDP2 offloads the optimizer state only together"),
    ],
)
def test_fsdp_settings_elsewhere_or_impossible_are_refused(compose_spec, overrides, expected):
    [problem] = check_strategy(compose_spec("recipe=gpt2_clm_tiny", *overrides))
    assert expected in problem


def test_fsdp_options_it_has_are_accepted(compose_spec):
    spec = compose_spec("recipe=gpt2_clm_tiny", "strategy=fsdp", "strategy.reshard_after_forward=false")
    assert check_strategy(spec) == [] and check_fsdp(spec) == []
    assert spec.strategy.reshard_after_forward is False


def test_fsdp_cpu_offload_needs_a_gpu(compose_spec, monkeypatch):
    import torch

    spec = compose_spec("recipe=gpt2_clm_tiny", "strategy=fsdp", "strategy.offload_params=cpu")
    assert check_strategy(spec) == []  # fsdp partitions parameters, so it may offload them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    [problem] = check_fsdp(spec)
    assert "on a CPU-only machine they are there already" in problem and "strategy.offload_params=none" in problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_fsdp(spec) == []


def test_fsdp_at_one_process_is_refused_naming_the_fix(capsys, tmp_path):
    from runner.cli import main

    with pytest.raises(SystemExit) as info:
        main(["recipe=gpt2_clm_tiny", "strategy=fsdp", "launch.nproc_per_node=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "strategy=fsdp shards the model over 2 or more processes" in err and "launch.nproc_per_node=2" in err
    assert not (tmp_path / "run" / "run_spec.yaml").exists()
