"""peft=lora across layouts (2 CPU processes, gloo): a resume in another layout continues
at the exact sample, as full training does (tests/train/test_checkpoint_multiprocess.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MICRO
from in_turn import run_in_turn
from runner.certify.matrix import LOGITS_ATOL
from runner.report.parity import parity_problems, step_records
from test_adapters_run import base, logits  # noqa: F401 (base is a fixture)

pytestmark = pytest.mark.multiprocess

# Dropout off, the model's and the adapters': other layouts sum in another order, so
# equal math (1e-4) is expected. 64 samples at a global batch of 8: 8 steps an epoch.
RUN = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "data.max_train_samples",
                                             "train.per_device_batch_size", "model.config_overrides"))] + [
    "model.config_overrides='resid_pdrop=0,embd_pdrop=0,attn_pdrop=0'", "train.max_steps=12", "train.eval_every=0", "data.max_train_samples=64",
    "schedule=constant", "peft=lora", "peft.dropout=0", "optim.lr=1e-2"]
LAYOUTS = {"2x4x1": ["launch.nproc_per_node=2", "train.per_device_batch_size=4"],
           "1x4x2": ["train.per_device_batch_size=4", "train.grad_accum_steps=2"],
           "1x8x1": ["train.per_device_batch_size=8"]}


def test_a_resume_in_another_layout_continues_at_the_exact_sample(base, tmp_path):  # noqa: F811
    """2 processes x 4 to step 3 (odd, mid-epoch), then 1 x 4 x 2 accumulation to step 12,
    past the epoch boundary: every step's loss and gradient norm match one uninterrupted
    1 x 8 run, and the adapters give its logits (within the 1e-4 another layout's
    summation order allows)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def run(run_dir, layout, *extra):
        return [sys.executable, "-m", "runner", *RUN, f"model.name_or_path={base}", *LAYOUTS[layout], *extra,
                f"hydra.run.dir={run_dir}"]

    reference, cut = tmp_path / "reference", tmp_path / "cut"
    done = subprocess.run(run(reference, "1x8x1"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    first = subprocess.run(run(cut, "2x4x1", "train.max_steps=3", "train.save_every=3"), capture_output=True, text=True,
                           timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run(run(cut, "1x4x2", "resume=auto"), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "accepted change layout 2x4x1 -> 1x4x2" in resumed.stderr and "not exact" not in resumed.stderr
    assert parity_problems(step_records(reference / "metrics.jsonl"), step_records(cut / "metrics.jsonl")) == []

    def adapted(run_dir):
        return logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter"))

    # Another layout sums in another order, so after 12 steps the weights differ by
    # rounding: held to certify's allowance for that (1e-4; seen up to 1.9e-5).
    assert (adapted(cut) - adapted(reference)).abs().max().item() <= LOGITS_ATOL["fp32"]
    assert (adapted(reference) - logits(AutoModelForCausalLM.from_pretrained(base))).abs().max().item() > 1e-3  # trained


STRATEGIES = ["ddp", "zero2", "zero3", "fsdp"]


@pytest.fixture(scope="module")
def strategy_runs(base, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """Each strategy's 5-step adapter run at 2 processes, in turn on one launch of workers
    (tests/in_turn.py): the workers import once for all four."""
    return run_in_turn(tmp_path_factory.mktemp("adapter_strategies"), {
        strategy: [*RUN, f"model.name_or_path={base}", *LAYOUTS["2x4x1"], f"strategy={strategy}", "train.max_steps=5",
                   "train.save_every=5", "peft.save_merged=true"] for strategy in STRATEGIES}, timeout=1800)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adapter_gives_the_trained_models_logits_under_every_strategy(base, strategy_runs, tmp_path, strategy):  # noqa: F811
    """adapter/ against the run's own trained model: its last checkpoint at 2 processes,
    whose parameters each library reads with its own tool (DeepSpeed's zero_to_fp32 for
    ZeRO's partitions, torch's dcp_to_torch_save for FSDP2's DTensor shards; ddp's is
    one safetensors file), independently of runner's gathering save, loaded into a fresh
    PeftModel. Within 1e-5. And model/ (peft.save_merged, written by rank 0 alone; under
    zero3 it hung in collectives only rank 0 entered) gives the adapter's logits, within 1e-5."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from runner.components.adapters import lora_config
    from runner.config.spec import PeftKind, PeftSpec

    run_dir = strategy_runs[strategy]
    checkpoint = run_dir / "checkpoints" / "step_5"
    if strategy == "ddp":
        from safetensors.torch import load_file

        state = load_file(checkpoint / "model.safetensors")
    elif strategy in ("zero2", "zero3"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(checkpoint / "pytorch_model_fsdp_0", tmp_path / "consolidated.pt")
        state = torch.load(tmp_path / "consolidated.pt", weights_only=True)["model"]  # Accelerate saves {"model": ...}
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora_config(PeftSpec(kind=PeftKind.lora)))
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    assert adapters and all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # trained, not zero
    missing, unexpected = trained.load_state_dict(adapters, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k], (missing, unexpected)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")
    torch.testing.assert_close(logits(adapter), logits(trained), rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert not any(".lora_" in k for k in merged.state_dict())  # a plain model, the adapters merged in
    torch.testing.assert_close(logits(merged), logits(adapter), rtol=0, atol=1e-5)
