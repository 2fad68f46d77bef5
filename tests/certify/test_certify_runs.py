"""`runner certify` end to end: the matrix docs/architectures.md publishes is what the
command prints today, and a strategy that fails mid-launch is named while the others
still run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import patch_train_step

pytestmark = [pytest.mark.multiprocess]

PAGE = Path(__file__).parent.parent.parent / "docs" / "architectures.md"


def certify(*args: str, env: dict[str, str] | None = None, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", "certify", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def assert_published(out: Path, page: Path, marker: str, command: str) -> str:
    """The matrix `command` printed into `out` is the block between `marker`'s markers on `page`."""
    block = re.search(rf"<!-- {marker}:begin -->\n(.*?)<!-- {marker}:end -->", page.read_text(), re.S)
    assert block, f"docs/{page.name} has no {marker} block"
    assert out.read_text() == block.group(1), (
        f"docs/{page.name}'s matrix is not what `{command}` prints now; paste this between its markers:\n"
        + out.read_text())
    return out.read_text()


@pytest.mark.timeout(1800)  # eleven architectures x four strategies, two legs each, beside another xdist worker
def test_the_published_matrix_is_what_the_command_prints(tmp_path):
    out = tmp_path / "matrix.md"
    done = certify("--work-dir", str(tmp_path / "runs"), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, PAGE, "certify", "runner certify")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "architecture" not in line]
    assert len(rows) >= 8 and any(row.startswith("| mixtral |") for row in rows)


ADAPTERS_PAGE = PAGE.parent / "adapters.md"


@pytest.mark.timeout(1800)
def test_the_published_lora_matrix_is_what_the_command_prints(tmp_path):
    """Adapters under every strategy: GPT-2, a grouped-query Llama, Qwen3 and a mixture of
    experts, each strategy's adapter/ loaded with peft against one process's. And only the
    adapters train: each rank's Adam state is the adapters' (ddp: all of it on each rank;
    zero2, zero3, fsdp: split among the ranks), no frozen parameter gets a gradient."""
    out = tmp_path / "matrix.md"
    probe = Path(__file__).parent / "adapter_state_probe.py"
    env = patch_train_step(tmp_path, "self.state.step >= 1", f"exec(open({str(probe)!r}).read(), {{'self': self}})")
    done = certify("gpt2", "llama", "qwen3", "mixtral", "--peft", "lora", "--work-dir", str(tmp_path / "runs"),
                   "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, ADAPTERS_PAGE, "certify-lora", "runner certify --peft lora")
    assert text.count("| exact | exact | exact | exact |") == 4
    for arch in ("gpt2", "llama", "qwen3", "mixtral"):
        for run in ("reference", "ddp", "zero2", "zero3", "fsdp"):
            assert_only_adapters_hold_state(tmp_path / "runs" / arch / "fp32_lora" / run)


def assert_only_adapters_hold_state(run_dir: Path) -> None:
    import json

    trainable = json.loads((run_dir / "all_results.json").read_text())["trainable_parameters"]
    probes = [json.loads(p.read_text()) for p in sorted(run_dir.glob("state_probe_rank*.json"))]
    assert len(probes) == (1 if run_dir.name == "reference" else 2), run_dir
    for probe in probes:
        assert probe["frozen"] > 0 and probe["frozen_with_grad"] == [], (run_dir, probe)
    held = [p["adam_elements"] for p in probes]
    if run_dir.name in ("reference", "ddp"):
        assert held == [2 * trainable] * len(probes), (run_dir, held, trainable)
    else:  # each rank a part; DeepSpeed pads its flat partitions to a multiple of the ranks
        assert all(0 < h < 2 * trainable for h in held) and 2 * trainable <= sum(held) <= 2 * trainable + 64, (
            run_dir, held, trainable)


ELASTIC_PAGE = PAGE.parent / "elastic-checkpoints.md"


@pytest.mark.timeout(1200)
def test_the_published_reshard_matrix_is_what_the_command_prints(tmp_path):
    """Each strategy's checkpoint of 2 processes, resumed on 1 process under ddp (read
    across, runner/train/reshard.py): GPT-2, a grouped-query Llama, a mixture of experts."""
    out = tmp_path / "matrix.md"
    done = certify("gpt2", "llama", "mixtral", "--reshard", "--work-dir", str(tmp_path / "runs"), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, ELASTIC_PAGE, "certify-reshard", "runner certify --reshard")
    assert text.count("| exact | exact | exact | exact |") == 3
    read_across = list((tmp_path / "runs").glob("*/fp32_to_ddp_x1/*/run.log"))
    assert sum("reshard.py" in log.read_text() for log in read_across) == 9  # zero2, zero3, fsdp x 3; ddp loads its own


@pytest.mark.timeout(1200)
def test_the_published_lora_reshard_matrix_is_what_the_command_prints(tmp_path):
    """Adapters written by each strategy at 2 processes (zero2 partitions their optimizer
    state, zero3 them and the frozen base), resumed on 1 process under ddp: every step after
    the cut and the saved adapter/ against one process's uninterrupted run. GPT-2 (tied
    head) and a grouped-query Llama."""
    out = tmp_path / "matrix.md"
    done = certify("gpt2", "llama", "--peft", "lora", "--reshard", "--work-dir", str(tmp_path / "runs"), "--out",
                   str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, ELASTIC_PAGE, "certify-reshard-lora", "runner certify --peft lora --reshard")
    assert text.count("| exact | exact | exact | exact |") == 2
    read_across = list((tmp_path / "runs").glob("*/fp32_lora_to_ddp_x1/*/run.log"))
    assert sum("reshard.py" in log.read_text() for log in read_across) == 6  # zero2, zero3, fsdp x 2


def test_a_strategy_that_fails_is_named_and_the_others_still_run(tmp_path):
    """zero2's rank 1 crashes at step 3 of its first leg: that launch ends there; zero3
    and fsdp run in the next one, ddp's run before it stands, and the resumes follow."""
    env = patch_train_step(tmp_path, 'self.run_dir.name == "zero2" and os.environ.get("RANK") == "1" '
                                     'and self.state.step >= 2', 'raise RuntimeError("injected at step 3")')
    done = certify("gpt2", "--work-dir", str(tmp_path / "runs"), env=env, timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| gpt2 | exact | failed | exact | exact |" in done.stdout
    named = re.search(r"- gpt2 zero2 fp32: failed: worker rank 1 failed: .*injected at step 3", done.stdout)
    assert named, done.stdout[-2000:]


PREFERENCE_PAGE = PAGE.parent / "preference.md"


@pytest.mark.timeout(1800)
def test_the_published_dpo_matrix_is_what_the_command_prints(tmp_path):
    """DPO under every strategy, with every weight training (the reference precomputed once
    before training) and with LoRA (the reference: the adapters off), in the same two
    launches: GPT-2, a grouped-query Llama, Qwen3 and a mixture of experts with its router
    loss on (added once a micro-batch, as TRL's DPOTrainer adds it), 34 pairs at 8 a step
    (the epoch's last step holds 2), each against one process's run."""
    out = tmp_path / "matrix.md"
    done = certify("gpt2", "llama", "qwen3", "mixtral_router", "--objective", "dpo", "--peft", "none,lora",
                   "--work-dir", str(tmp_path / "runs"), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, PREFERENCE_PAGE, "certify-dpo", "runner certify --objective dpo --peft none,lora")
    assert text.count("| exact | exact | exact | exact | exact | exact | exact | exact |") == 4
    runs = tmp_path / "runs"
    for arch in ("gpt2", "llama", "qwen3", "mixtral_router"):
        for run in ("reference", "ddp", "zero2", "zero3", "fsdp"):  # scored once, before training, by each run
            assert (runs / arch / "fp32_dpo" / run / "reference_logps.pt").exists(), (arch, run)
            assert not (runs / arch / "fp32_dpo_lora" / run / "reference_logps.pt").exists(), (arch, run)


RL_PAGE = PAGE.parent / "rl.md"


@pytest.mark.timeout(1800)
def test_the_published_grpo_matrix_is_what_the_command_prints(tmp_path):
    """Online RL under every strategy against one process, GPT-2, a grouped-query Llama and
    a mixture of experts with its router loss: 7 prompts at 2 a step (an epoch ends mid-step),
    a generation every 2 steps, the first leg's checkpoint at step 7 in the middle of one;
    every step's loss, gradient norm, reward, reward_std, entropy and clip ratio, the saved
    model's logits, and the samples (completions.jsonl) to the byte."""
    out = tmp_path / "matrix.md"
    done = certify("gpt2", "llama", "mixtral_router", "--objective", "grpo", "--work-dir", str(tmp_path / "runs"),
                   "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, RL_PAGE, "certify-grpo", "runner certify gpt2 llama mixtral_router --objective grpo")
    assert text.count("| exact | exact | exact | exact |") == 3
    runs = tmp_path / "runs"
    for arch in ("gpt2", "llama", "mixtral_router"):
        for run in ("ddp", "zero2", "zero3", "fsdp"):
            assert (runs / arch / "fp32_grpo" / run / "completions.jsonl").read_bytes() == (
                runs / arch / "fp32_grpo" / "reference" / "completions.jsonl").read_bytes(), (arch, run)


@pytest.mark.timeout(1200)
def test_the_published_rloo_matrix_is_what_the_command_prints(tmp_path):
    """RLOO (the KL in the reward, a frozen reference prepared like the policy) under every
    strategy against one process: the grpo matrix's prompts, generations and resume."""
    out = tmp_path / "matrix.md"
    done = certify("gpt2", "--objective", "rloo", "--work-dir", str(tmp_path / "runs"), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, RL_PAGE, "certify-rloo", "runner certify gpt2 --objective rloo")
    assert text.count("| exact | exact | exact | exact |") == 1


@pytest.mark.timeout(2400)
def test_the_published_joins_array_is_what_the_command_prints(tmp_path):
    """Every pair of the features' values in one cell at least (objective, data, packing,
    peft, reference, model, strategy, precision), each cell's three legs held to the
    invariants that hold everywhere (runner/certify/joins.py), in three launches."""
    out = tmp_path / "joins.md"
    done = certify("--joins", "--work-dir", str(tmp_path / "runs"), "--out", str(out), timeout=2300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, PAGE, "certify-joins", "runner certify --joins")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    assert len(rows) >= 12 and all(row.endswith(("| exact |", "| within bf16 tolerance |")) for row in rows)
    assert "pairs no passing cell holds" not in text


@pytest.mark.timeout(1800)
def test_every_offline_recipe_runs_as_a_sweep_over_precision_and_strategy(tmp_path):
    """The usage runner was made for, in full: each shipped offline recipe as
    `runner -m recipe=<it> precision=fp32,bf16 strategy=ddp,zero2 train.max_steps=2
    data.max_eval_samples=32`, every job finishing with its summary; the connected ones
    composed and validated offline."""
    out = tmp_path / "recipes.md"
    done = certify("--recipes", "--work-dir", str(tmp_path / "runs"), "--out", str(out), timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = assert_published(out, PAGE, "certify-recipes", "runner certify --recipes")
    for recipe in ("gpt2_clm_tiny", "gpt2_sft_tiny", "gpt2_dpo_tiny", "gpt2_mix_tiny"):
        assert f"| {recipe} | finished | finished | finished | finished |" in text, recipe
