"""Each private patch runs only on the library versions it was verified on; elsewhere the
library's own behaviour runs, and the banner and run_spec.yaml say so."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.config.spec import PrecisionKind, PrecisionSpec, RunSpec, StrategyKind, StrategySpec
from runner.distributed import patches
from runner.distributed.accelerator import build_accelerator, reset_accelerate_state, skip_output_upcast
from runner.distributed.zero_patches import forget_world_group, share_zero3_fp32_master
from runner.distributed.strategies import build_strategy
from runner.launch.rundir import freeze


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def unverified(monkeypatch, library: str, version: str = "99.0.0") -> None:
    """Pretend `library` is installed at a version no patch was verified on."""
    real = patches.installed_version
    monkeypatch.setattr(patches, "installed_version", lambda name: version if name == library else real(name))


def test_every_patch_is_engaged_on_the_versions_it_names():
    for patch in patches.PATCHES:
        assert patch.verified and patch.does and patch.without
        installed = patches.installed_version(patch.library)
        assert patches.engaged(patch) is (installed in patch.verified)
    assert patches.fence_notes() == []  # CI installs the verified versions: every patch engaged


def test_an_unverified_version_leaves_the_patch_out_and_says_so(monkeypatch):
    unverified(monkeypatch, "accelerate", "1.99.0")
    assert not patches.engaged(patches.SKIP_OUTPUT_UPCAST) and not patches.engaged(patches.FSDP2_ON_CPU)
    assert patches.engaged(patches.ZERO3_SHARE_FP32_MASTER) == (patches.installed_version("deepspeed") == "0.19.8")
    notes = patches.fence_notes()
    assert any("skip_output_upcast not engaged: accelerate 1.99.0" in n and "1.15.0" in n for n in notes)
    assert patches.fence_notes({"deepspeed"}) == []  # a run that does not use accelerate's patches hears nothing of them


def test_unverified_accelerate_keeps_its_fp32_copy_of_the_outputs(monkeypatch):
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec(kind=PrecisionKind.bf16)),
                                    grad_accum_steps=1, max_grad_norm=1.0)
    model = accelerator.prepare(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=100)))
    unverified(monkeypatch, "accelerate")
    assert skip_output_upcast(accelerator, model) is False
    ids = torch.randint(0, 100, (2, 8))
    assert model(input_ids=ids, labels=ids).logits.dtype == torch.float32  # Accelerate's own wrapper still runs


def test_unverified_deepspeed_keeps_its_own_memory_behaviour(monkeypatch):
    working = [torch.arange(6, dtype=torch.float32)]
    master = [working[0].clone()]
    engine = SimpleNamespace(optimizer=SimpleNamespace(fp16_partitioned_groups_flat=working, fp32_partitioned_groups_flat=master))
    unverified(monkeypatch, "deepspeed")
    assert share_zero3_fp32_master(engine) == 0 and master[0].data_ptr() != working[0].data_ptr()
    groups = pytest.importorskip("deepspeed.utils.groups")
    cached = object()
    monkeypatch.setattr(groups, "_WORLD_GROUP", cached)
    forget_world_group()
    assert groups._WORLD_GROUP is cached


def test_run_spec_yaml_names_a_patch_left_out(monkeypatch, tmp_path):
    unverified(monkeypatch, "deepspeed", "0.20.1")
    spec = RunSpec(strategy=StrategySpec(kind=StrategyKind.zero3))
    text = freeze(spec, tmp_path).read_text()
    assert "# patch zero3_release_gradient_partition not engaged: deepspeed 0.20.1" in text
    ddp = freeze(RunSpec(), tmp_path).read_text()  # ddp uses no DeepSpeed: nothing about its patches
    assert not [line for line in ddp.splitlines() if line.startswith("# patch") and "deepspeed" in line]


def test_a_patch_left_out_names_the_command_that_installs_its_verified_version(monkeypatch):
    from runner.config.versions import LOCK_FILE

    unverified(monkeypatch, "accelerate", "1.99.0")
    notes = patches.fence_notes({"accelerate"})
    assert notes and all(n.endswith(f"the verified set: pip install -c {LOCK_FILE} accelerate") for n in notes)


def test_each_patch_names_tests_that_exist():
    repo = Path(__file__).resolve().parents[2]
    for patch in patches.PATCHES:
        assert patch.tests, patch.name
        for test in patch.tests:
            path, _, function = test.partition("::")
            source = (repo / path).read_text()
            assert not function or f"def {function}(" in source, test


def test_every_patchs_library_is_locked_at_a_version_it_was_verified_on():
    from runner.config.versions import canonical, locked_versions

    for patch in patches.PATCHES:
        assert locked_versions()[canonical(patch.library)] in patch.verified, patch.name
