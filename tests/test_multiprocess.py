"""Two CPU processes (gloo): ddp, zero2, zero3 and fsdp do the same math as one process.

Slow (each run spawns real workers); CI runs them with `-m "slow or not slow"`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MICRO, patch_train_step
from in_turn import run_in_turn
from runner.report.parity import parity_problems, step_records

# Each launch group of layouts runs once, when a test first asks for one of its layouts (Runs).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2400)]

CONFIGS = Path(__file__).parent / "launch" / "data" / "accelerate_configs"
# 13 eval blocks: 2 ranks x eval batch 4 pad the last batch, which gather_for_metrics must drop.
# 26 training blocks at a global batch of 8 make 4 steps an epoch, the last of 2 blocks:
# under 2 x 4 rank 0's batch is half fillers and rank 1's all (runner/components/
# epoch_batches.py), under 2 x 2 x 2 rank 1's last micro-batch is, and one process's last
# accumulation window is one micro-batch. 12 steps cross two epoch boundaries (new
# shuffles, loaders restarted). Dropout is off (MICRO).
STEPS = 12
BASE = [o for o in MICRO if not o.startswith(("train.per_device_batch_size", "train.eval_every", "data.max_eval_samples",
                                             "data.max_train_samples", "train.max_steps"))] + [
    "train.eval_every=0", "data.max_eval_samples=13", "data.max_train_samples=26", f"train.max_steps={STEPS}",
]
LAYOUTS = {
    "single_8": ["train.per_device_batch_size=8"],
    "single_4x2": ["train.per_device_batch_size=4", "train.grad_accum_steps=2"],
    # Spawned, as on a GPU machine (launch.start_method=auto spawns with CUDA); the other
    # layouts fork from the forkserver, as auto does on a CPU (runner/launch/start_method.py).
    "ddp_2x4": ["launch.nproc_per_node=2", "train.per_device_batch_size=4", "launch.start_method=spawn"],
    "zero2_2x4": ["launch.nproc_per_node=2", "train.per_device_batch_size=4", "strategy=zero2"],
    "zero3_2x4": ["launch.nproc_per_node=2", "train.per_device_batch_size=4", "strategy=zero3"],
    "zero2_2x2x2": ["launch.nproc_per_node=2", "train.per_device_batch_size=2", "train.grad_accum_steps=2", "strategy=zero2"],
    "zero3_2x2x2": ["launch.nproc_per_node=2", "train.per_device_batch_size=2", "train.grad_accum_steps=2", "strategy=zero3"],
    "fsdp_2x4": ["launch.nproc_per_node=2", "train.per_device_batch_size=4", "strategy=fsdp"],
    "fsdp_2x2x2": ["launch.nproc_per_node=2", "train.per_device_batch_size=2", "train.grad_accum_steps=2", "strategy=fsdp"],
    # Parameters kept gathered from forward to backward, and activations recomputed in backward.
    "fsdp_2x4_gathered_recompute": ["launch.nproc_per_node=2", "train.per_device_batch_size=4", "strategy=fsdp",
                                    "strategy.reshard_after_forward=false", "model.gradient_checkpointing=true"],
}
SHARDED = ["ddp_2x4", "zero2_2x4", "zero3_2x4", "fsdp_2x4"]


def runner(run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", *BASE, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def losses(run_dir: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r and "loss" in r]


def launch_group(name: str) -> str:
    """Layouts that share their launch settings run in turn on one launch of workers
    (tests/in_turn.py): the one-process layouts on one, the forked two-process ones on
    another. ddp_2x4 runs alone through the CLI: it is the spawned layout."""
    if "launch.start_method=spawn" in LAYOUTS[name]:
        return name
    return "two" if "launch.nproc_per_node=2" in LAYOUTS[name] else "one"


class Runs:
    """Each layout's run folder, made when a test first asks for it or for a layout of
    its launch group, and kept for the module."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.done:
            group = launch_group(name)
            if group == name:
                result = runner(self.root / name, *LAYOUTS[name])
                assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
                self.done[name] = self.root / name
            else:
                members = {n: [*BASE, *LAYOUTS[n]] for n in LAYOUTS if launch_group(n) == group}
                self.done.update(run_in_turn(self.root / group, members, timeout=2400))
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single_8"])
def test_loss_and_grad_norm_agree_with_one_process_at_every_step(runs, name):
    """Loss within 1e-4 and gradient norm within 0.1% at each of 12 steps, over two epoch ends."""
    reference = step_records(runs["single_8"] / "metrics.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] for r in reference.values())
    assert parity_problems(reference, step_records(runs[name] / "metrics.jsonl")) == []


# Every layout reports the float64-accumulated norm of the gradients it holds
# (runner/distributed/grad_norm.py; DeepSpeed's own under ZeRO): measured within 6e-8 of one
# process at every step. torch's float32 CPU norm had read 5.4e-4 low on one process's
# embedding gradient and 2.7e-4 low on fsdp's half shards, inside the 0.1% above.
SAME_NORM_RTOL = 1e-6


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single_8"])
def test_grad_norm_is_the_same_number_in_every_layout(runs, name):
    reference = step_records(runs["single_8"] / "metrics.jsonl")
    other = step_records(runs[name] / "metrics.jsonl")
    apart = {k: abs(other[k]["grad_norm"] - r["grad_norm"]) / r["grad_norm"] for k, r in reference.items()}
    assert max(apart.values()) < SAME_NORM_RTOL, apart


def test_a_gradient_off_by_the_accumulation_factor_fails_the_comparison(runs, tmp_path):
    """Skip Accelerate's division of the loss by the accumulation steps (a test-only patch):
    the gradients double. The comparison above must see it."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import accelerate\n"
        "original = accelerate.Accelerator.backward\n"
        "def backward(self, loss, **kwargs):\n"
        "    return original(self, loss * self.gradient_accumulation_steps, **kwargs)\n"
        "accelerate.Accelerator.backward = backward\n"
    )
    done = runner(tmp_path / "broken", *LAYOUTS["single_4x2"], env={"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert done.returncode == 0, done.stderr[-3000:]
    broken = step_records(tmp_path / "broken" / "metrics.jsonl")
    reference = step_records(runs["single_8"] / "metrics.jsonl")
    problems = parity_problems(reference, broken)
    assert any("grad_norm" in p for p in problems), problems
    ratios = [broken[k]["grad_norm"] / reference[k]["grad_norm"] for k in (1, 2)]
    assert ratios == pytest.approx([2.0, 2.0], rel=1e-3)  # steps 1-2 still share the weights (lr 0 at step 1)


@pytest.mark.parametrize("name", SHARDED)
def test_distributed_eval_equals_single_process(runs, name):
    """Evaluation gathers across ranks and drops the padding duplicates: same numbers."""
    single = json.loads((runs["single_8"] / "all_results.json").read_text())
    multi = json.loads((runs[name] / "all_results.json").read_text())
    assert multi["eval_samples"] == single["eval_samples"] == 13
    for key in ("eval_loss", "perplexity", "eval_accuracy"):
        assert multi[key] == pytest.approx(single[key], abs=1e-4, rel=1e-4), key


@pytest.mark.parametrize("name", SHARDED)
def test_lr_per_step_is_the_same_at_two_processes(runs, name):
    assert losses(runs[name], "lr") == pytest.approx(losses(runs["single_8"], "lr"), rel=1e-9)


@pytest.mark.parametrize("name", SHARDED)
def test_ranks_hold_identical_parameters(runs, name):
    results = json.loads((runs[name] / "all_results.json").read_text())
    a, b = results["rank_param_fingerprints"]
    assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_saved_model_reloads_with_the_same_weights(runs, name):
    """Every key of model/ and every value, by name, against one process's (a key
    missing from the file would be filled in by from_pretrained's initialisation, so
    the files are compared too, not only the reloaded models)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved, reference_saved = (load_file(str(runs[n] / "model" / "model.safetensors")) for n in (name, "single_8"))
    assert sorted(saved) == sorted(reference_saved)
    model = AutoModelForCausalLM.from_pretrained(runs[name] / "model").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(runs["single_8"] / "model").state_dict()
    assert sorted(model) == sorted(reference)
    for mine, theirs in ((saved, reference_saved), (model, reference)):
        for key, expected in theirs.items():
            got = mine[key]
            assert got.dtype == expected.dtype == torch.float32 and got.shape == expected.shape, key
            assert torch.allclose(got, expected, atol=1e-4, rtol=0), (key, (got - expected).abs().max().item())


@pytest.mark.parametrize("name", ["zero2_2x4", "fsdp_2x4"])
def test_banner_shows_the_batch_arithmetic(runs, name):
    log = (runs[name] / "run.log").read_text()
    assert f"{name.split('_')[0]} on 2 process(es)" in log
    assert "global batch   8 = 4 per device x 2 process(es) x 1 accumulation" in log


def test_fsdp_saves_a_full_fp32_model_like_ddp(runs):
    """model/ is the gathered model, not one rank's shard, in ddp's dtype."""
    from transformers import AutoModelForCausalLM

    # One process saves what ddp saves (test_saved_model_reloads_with_the_same_weights).
    fsdp, ddp = (AutoModelForCausalLM.from_pretrained(runs[n] / "model") for n in ("fsdp_2x4", "single_8"))
    assert type(fsdp).__name__ == "GPT2LMHeadModel"
    assert fsdp.num_parameters() == ddp.num_parameters()
    assert {p.dtype for p in fsdp.parameters()} == {p.dtype for p in ddp.parameters()} == {torch.float32}
    config = json.loads((runs["fsdp_2x4"] / "model" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]


def test_accelerate_config_file_runs_like_zero2(runs, tmp_path):
    done = runner(tmp_path / "acc", "strategy=accelerate_config",
                  f"strategy.config_file={CONFIGS / 'cpu_zero2_2proc.yaml'}", "train.per_device_batch_size=4")
    assert done.returncode == 0, done.stderr[-3000:]
    spec = (tmp_path / "acc" / "run_spec.yaml").read_text()
    assert "kind: zero2" in spec and "nproc_per_node: '2'" in spec
    assert losses(tmp_path / "acc") == pytest.approx(losses(runs["zero2_2x4"]), abs=1e-4)


def test_accelerate_fsdp2_config_file_runs_like_fsdp(runs, tmp_path):
    done = runner(tmp_path / "acc", "strategy=accelerate_config",
                  f"strategy.config_file={CONFIGS / 'cpu_fsdp2_2proc.yaml'}", "train.per_device_batch_size=4")
    assert done.returncode == 0, done.stderr[-3000:]
    spec = (tmp_path / "acc" / "run_spec.yaml").read_text()
    assert "kind: fsdp" in spec and "reshard_after_forward: false" in spec and "nproc_per_node: '2'" in spec
    assert losses(tmp_path / "acc") == pytest.approx(losses(runs["fsdp_2x4"]), abs=1e-4)


def test_global_batch_size_derives_accumulation(runs, tmp_path):
    done = runner(tmp_path / "gbs", "launch.nproc_per_node=2", "train.per_device_batch_size=2", "train.global_batch_size=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "grad_accum_steps: 2" in (tmp_path / "gbs" / "run_spec.yaml").read_text()
    assert losses(tmp_path / "gbs") == pytest.approx(losses(runs["single_8"]), abs=1e-4)


def test_two_nodes_on_one_machine_equal_single_node_ddp(runs, tmp_path):
    """Two launchers as two 'nodes' (one worker each) meet at one c10d endpoint."""
    from runner.launch.launcher import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    common = ["launch.nnodes=2", "launch.nproc_per_node=1", f"launch.rdzv_endpoint={endpoint}", "train.per_device_batch_size=4"]
    run_dir = tmp_path / "two_nodes"
    cmd = [sys.executable, "-m", "runner", *BASE, *common, f"hydra.run.dir={run_dir}"]
    nodes = [subprocess.Popen([*cmd, f"launch.node_rank={rank}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert losses(run_dir) == pytest.approx(losses(runs["ddp_2x4"]), abs=1e-4)


def test_multi_node_needs_an_explicit_shared_run_folder():
    done = subprocess.run([sys.executable, "-m", "runner", *BASE, "launch.nnodes=2", "launch.rdzv_endpoint=127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "hydra.run.dir" in done.stderr


def test_a_rank_that_raises_stops_the_run(tmp_path):
    """Rank 1 raises at its second step: the launcher stops everyone and exits non-zero."""
    env = patch_train_step(tmp_path, 'os.environ.get("RANK") == "1" and self.state.step >= 1',
                           'raise RuntimeError("injected failure on rank 1")')
    done = runner(tmp_path / "fail", "launch.nproc_per_node=2", "train.per_device_batch_size=4", env=env, timeout=300)
    assert done.returncode != 0
    assert "injected failure on rank 1" in done.stderr
    assert "worker rank 1 failed" in done.stderr
    # "its error is shown above": the rank's traceback is, once, above the one line
    above = done.stderr.split("runner: worker rank 1 failed")[0]
    assert above.count("Traceback (most recent call last)") == 1 and "in fit" in above, done.stderr[-3000:]
    assert not (tmp_path / "fail" / "all_results.json").exists()


def test_joins_a_torchrun_launch_instead_of_spawning(runs, tmp_path):
    """Under torchrun every process runs `runner`; rank 0 composes, one run folder results."""
    run_dir = tmp_path / "torchrun"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "runner", *BASE,
         "train.per_device_batch_size=4", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=600,
    )
    # Each rank's own lines first: the tail alone is the launcher's report of the first failure.
    rank_lines = "\n".join(line for line in done.stderr.splitlines() if line.startswith(("[rank1]", "[rank0]")))[-4000:]
    assert done.returncode == 0, f"{rank_lines}\n---\n{done.stderr[-3000:]}"
    assert losses(run_dir) == pytest.approx(losses(runs["ddp_2x4"]), abs=1e-4)
    assert "ddp on 2 process(es)" in (run_dir / "run.log").read_text()


def test_joined_ranks_stop_when_rank_0_refuses_the_config(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "runner", *BASE,
         "data.block_size=4096", f"hydra.run.dir={tmp_path / 'bad'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert "data.block_size=4096" in done.stderr


def test_a_collective_timeout_names_the_rank_and_the_setting(tmp_path):
    """Rank 1 stalls; rank 0's collective times out after launch.timeout_minutes."""
    env = patch_train_step(tmp_path, 'os.environ.get("RANK") == "1" and self.state.step >= 1', "time.sleep(20)")
    done = runner(tmp_path / "hang", "launch.nproc_per_node=2", "train.per_device_batch_size=4", "launch.timeout_minutes=0.1",
                  env=env, timeout=300)
    assert done.returncode != 0
    assert "launch.timeout_minutes=0.1" in done.stderr and "When a run hangs" in done.stderr
    assert "rank 0 waited" in done.stderr
