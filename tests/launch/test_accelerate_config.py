"""Reading the classic accelerate config files into the equivalent spec."""

from pathlib import Path

import pytest

from runner.launch.accelerate_config import apply_accelerate_config
from runner.config.errors import UserError
from runner.config.spec import OffloadDevice, PrecisionKind, RunSpec, StrategyKind

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


def test_fsdp2_as_accelerate_config_writes_it():
    spec, notes = read("fsdp2.yaml")
    assert spec.strategy.kind is StrategyKind.fsdp
    assert spec.strategy.reshard_after_forward is True and spec.strategy.offload_params is OffloadDevice.none
    assert spec.precision.kind is PrecisionKind.bf16 and spec.model.gradient_checkpointing is False
    assert (spec.launch.nproc_per_node, spec.launch.nnodes) == ("8", 1)
    # CPU-RAM-efficient loading (accelerate's default) is explained; the wrap it asks for is the runner's own.
    assert [n for n in notes if "fsdp_config" in n] == [
        "fsdp2.yaml: fsdp_config.fsdp_cpu_ram_efficient_loading=True not applied (every rank builds the same seeded "
        "model, so nothing is loaded on rank 0 alone)."
    ]


def test_fsdp2_settings_reach_the_spec(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
                    "  fsdp_offload_params: true\n  fsdp_activation_checkpointing: true\n"
                    "  fsdp_state_dict_type: FULL_STATE_DICT\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n"
                    "  fsdp_min_num_params: 1000\n")
    spec, notes = read(str(path))
    assert spec.strategy.kind is StrategyKind.fsdp and spec.strategy.reshard_after_forward is False
    assert spec.strategy.offload_params is OffloadDevice.cpu and spec.model.gradient_checkpointing is True
    for key in ("fsdp_state_dict_type=FULL_STATE_DICT", "fsdp_auto_wrap_policy=SIZE_BASED_WRAP", "fsdp_min_num_params"):
        assert any(key in n for n in notes), (key, notes)


@pytest.mark.parametrize(
    "body, message",
    [
        ("distributed_type: FSDP\n", "fsdp_version=1: the runner runs FSDP2"),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n", "Set fsdp_version: 2"),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: maybe\n", "not true or false"),
        ("distributed_type: MEGATRON_LM\n", "MEGATRON_LM is not offered"),
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
