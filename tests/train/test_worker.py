"""Worker outputs: model/ holds the same fp32 weights whatever the strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import MICRO
from in_turn import run_in_turn
from runner.config.errors import UserError
from runner.config.validate import check_zero_save


def test_zero3_without_the_full_gather_is_refused_at_validation(compose_spec):
    spec = compose_spec("recipe=gpt2_clm_tiny", "strategy=zero3", "strategy.zero3_save_16bit_model=false")
    problems = check_zero_save(spec)
    assert len(problems) == 1 and "strategy.zero3_save_16bit_model=false" in problems[0]
    assert check_zero_save(compose_spec("recipe=gpt2_clm_tiny", "strategy=zero3")) == []


def _saved_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


@pytest.mark.multiprocess
def test_saved_model_is_fp32_and_the_same_under_ddp_zero2_and_zero3_in_bf16(tmp_path):
    """Two CPU processes, bf16, a tiny lr: the runs differ only by bf16 compute (at most
    ~lr per Adam step on a weight), far below bf16's storage rounding (2**-8 relative:
    8e-5 on a 0.02 weight). A 16-bit model/, or ZeRO starting from 16-bit-rounded
    weights, is off by that much; the fp32 master weights agree to 1e-5."""
    common = [*MICRO, "train.max_steps=2", "optim.lr=1e-6", "precision=bf16", "tracking=none",
              "launch.nproc_per_node=2", "train.per_device_batch_size=4", "train.eval_every=0"]
    weights, banners = {}, {}
    # The three share their launch settings: in turn on one launch of workers (tests/in_turn.py).
    runs = run_in_turn(tmp_path, {s: [*common, f"strategy={s}"] for s in ("ddp", "zero2", "zero3")}, timeout=1800)
    for strategy, run_dir in runs.items():
        weights[strategy] = _saved_weights(run_dir)
        banners[strategy] = [line for line in (run_dir / "run.log").read_text().splitlines() if " parameters" in line][0]
    assert banners["zero3"] == banners["ddp"] == banners["zero2"]  # ZeRO-3's partitioned parameters counted in full
    ddp = weights["ddp"]
    for strategy in ("zero2", "zero3"):
        saved = weights[strategy]
        assert saved.keys() == ddp.keys()
        for name, tensor in saved.items():
            assert tensor.dtype == torch.float32, (strategy, name, tensor.dtype)
            difference = (tensor - ddp[name]).abs().max().item()
            assert difference < 1e-5, (strategy, name, difference)


@pytest.mark.parametrize("machine", ["cpu", "gpu without liger", "gpu with liger"])
def test_the_banner_names_the_loss_kernel_and_how_to_get_liger(compose_spec, monkeypatch, machine):
    from runner.components import liger_loss
    from runner.train import worker

    gpu = machine != "cpu"
    monkeypatch.setattr(liger_loss, "gpu_present", lambda: gpu)
    monkeypatch.setattr(worker, "gpu_present", lambda: gpu)
    if machine == "gpu without liger":
        monkeypatch.setattr(liger_loss, "installed_version", lambda library: None)
    built = worker.build_seeded_model(compose_spec("recipe=gpt2_clm_tiny"))
    kernel = {"cpu": "runner's chunks of 1,024 tokens", "gpu without liger": "runner's chunks of 1,024 tokens",
              "gpu with liger": "Liger's fused linear cross-entropy (liger-kernel "}[machine]
    assert built.loss_note.startswith(f"output head and loss by {kernel}")
    assert ('pip install "runner[liger]"' in built.loss_note) is (machine == "gpu without liger")


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_the_banner_of_a_preference_run_names_its_chunks_of_pairs(compose_spec, monkeypatch, gpu):
    """DPO's loss goes through the head a chunk of pairs at a time, not the token loss's
    chunks (nor Liger's kernel, so no hint to install it)."""
    from runner.components import liger_loss
    from runner.train import worker

    monkeypatch.setattr(liger_loss, "gpu_present", lambda: gpu)
    monkeypatch.setattr(worker, "gpu_present", lambda: gpu)
    monkeypatch.setattr(liger_loss, "installed_version", lambda library: None)
    built = worker.build_seeded_model(compose_spec("recipe=gpt2_dpo_tiny"))
    assert built.loss_note.startswith("output head and loss by runner's chunks of pairs"), built.loss_note
    assert "liger" not in built.loss_note
