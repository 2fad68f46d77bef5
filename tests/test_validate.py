"""Cross-field validation: settings that would be accepted and then ignored are refused."""

import pytest

from runner.validate import check_accelerate_environment, check_strategy


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
