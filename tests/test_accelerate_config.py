"""Reading the classic accelerate config files into the equivalent spec."""

from pathlib import Path

import pytest

from runner.accelerate_config import apply_accelerate_config
from runner.errors import UserError
from runner.spec import OffloadDevice, PrecisionKind, RunSpec, StrategyKind

CONFIGS = Path(__file__).parent / "data" / "accelerate_configs"


def read(name: str, **strategy) -> tuple[RunSpec, list[str]]:
    spec = RunSpec()
    spec.strategy.config_file = str(CONFIGS / name) if "/" not in name else name
    notes = apply_accelerate_config(spec)
    return spec, notes


def test_multi_gpu_ddp():
    spec, notes = read("multi_gpu_ddp.yaml")
    assert spec.strategy.kind is StrategyKind.ddp
    assert spec.precision.kind is PrecisionKind.fp16
    assert (spec.launch.nproc_per_node, spec.launch.nnodes, spec.launch.node_rank) == ("8", 1, 0)
    assert any("rdzv_backend" in n for n in notes)  # explained, not silently dropped


def test_deepspeed_zero2():
    spec, notes = read("deepspeed_zero2.yaml")
    assert spec.strategy.kind is StrategyKind.zero2
    assert spec.strategy.offload_optimizer is OffloadDevice.cpu
    assert spec.train.grad_accum_steps == 4 and spec.optim.max_grad_norm == 1.0
    assert spec.precision.kind is PrecisionKind.bf16


def test_deepspeed_zero3_multi_node():
    spec, notes = read("deepspeed_zero3.yaml")
    assert spec.strategy.kind is StrategyKind.zero3
    assert spec.strategy.offload_params is OffloadDevice.cpu and spec.strategy.zero3_save_16bit_model
    assert spec.optim.max_grad_norm == 0.5
    assert (spec.launch.nproc_per_node, spec.launch.nnodes, spec.launch.node_rank) == ("8", 2, 1)
    assert spec.launch.rdzv_endpoint == "10.0.0.1:29501"
    assert any("zero3_init_flag" in n for n in notes)


@pytest.mark.parametrize(
    "body, message",
    [
        ("distributed_type: FSDP\n", "FSDP"),
        ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 1\n", "stages 2 and 3"),
        ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  offload_param_device: nvme\n", "none or cpu"),
        ("mixed_precision: fp8\n", "fp8"),
        ("num_processes: 3\nnum_machines: 2\n", "does not divide"),
        ("- just a list\n", "mapping"),
    ],
)
def test_what_cannot_be_honoured_is_refused_with_a_reason(tmp_path, body, message):
    path = tmp_path / "cfg.yaml"
    path.write_text(body)
    with pytest.raises(UserError, match=message):
        read(str(path))


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(UserError, match="strategy.config_file"):
        read(str(tmp_path / "nope.yaml"))


def test_through_the_cli_with_unset_file(capsys, tmp_path):
    from runner.cli import main

    with pytest.raises(SystemExit) as info:
        main(["recipe=gpt2_clm_tiny", "strategy=accelerate_config", f"hydra.run.dir={tmp_path}"])
    assert info.value.code == 2
    assert "strategy.config_file" in capsys.readouterr().err
