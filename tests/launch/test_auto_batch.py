"""train.per_device_batch_size=auto: the largest micro-batch that fits, the global batch and
the math kept (dropout off, so layouts can be compared), over an epoch boundary. Runs go
through the CLI in this process (runs.run_cli); the probe's peak is the run's own
(runner/report/metrics.py reset_peak_memory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import MICRO
from runner.config.spec import load_spec
from runner.report.parity import parity_problems, step_records
from runs import Ran, run_cli

# 96 blocks, global batch 8: 12 steps an epoch, so 14 steps cross an epoch boundary.
BASE = [*(o for o in MICRO if not o.startswith(("train.per_device_batch_size", "train.max_steps"))),
        "train.max_steps=14", "train.global_batch_size=8", "schedule=constant"]
AMPLE = "launch.device_memory=64GiB"
# Between the plan's peaks for micro-batches 4 (~105 MiB) and 8 (~173 MiB) of this model:
# the plan proposes 4 at most, and the probe may step lower (peak RSS on a CPU varies).
SMALL = "launch.device_memory=130MiB"


def run(run_dir: Path, *extra: str) -> Ran:
    done = run_cli([*BASE, *extra, f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def chosen(done: Ran) -> tuple[int, int]:
    match = re.search(r"auto chose (\d+) per device x 1 process\(es\) x (\d+) accumulation = global batch 8",
                      done.stderr)
    assert match, done.stderr[-3000:]
    return int(match.group(1)), int(match.group(2))


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("by_hand") / "run"
    run(run_dir, "train.per_device_batch_size=8")
    return run_dir


@pytest.mark.e2e
def test_auto_with_room_is_the_hand_layout_bit_for_bit(by_hand, tmp_path):
    done = run(tmp_path / "auto", "train.per_device_batch_size=auto", AMPLE)
    assert chosen(done) == (8, 1)
    assert "global batch   8 = 8 per device x 1 process(es) x 1 accumulation" in done.stdout + done.stderr
    frozen = load_spec(tmp_path / "auto" / "run_spec.yaml").train
    assert (frozen.per_device_batch_size, frozen.grad_accum_steps) == (8, 1)
    header = (tmp_path / "auto" / "run_spec.yaml").read_text().splitlines()
    assert any(line.startswith("# train.per_device_batch_size=auto chose 8 per device") for line in header)
    hand, auto = step_records(by_hand / "metrics.jsonl"), step_records(tmp_path / "auto" / "metrics.jsonl")
    assert sorted(auto) == list(range(1, 15))
    assert auto == hand  # identical losses and gradient norms at every step, over the epoch boundary


@pytest.mark.e2e
def test_a_small_budget_picks_a_smaller_micro_batch_with_more_accumulation(by_hand, tmp_path):
    done = run(tmp_path / "auto", "train.per_device_batch_size=auto", SMALL)
    micro, accumulation = chosen(done)
    assert micro < 8 and micro * accumulation == 8
    frozen = load_spec(tmp_path / "auto" / "run_spec.yaml").train
    assert (frozen.per_device_batch_size, frozen.grad_accum_steps, frozen.global_batch_size) == (micro, accumulation, 8)
    # the tolerance of any accumulation change (equal math, other summation order)
    assert parity_problems(step_records(by_hand / "metrics.jsonl"), step_records(tmp_path / "auto" / "metrics.jsonl")) == []


@pytest.mark.e2e
def test_a_resume_on_smaller_hardware_chooses_again_and_continues_the_same_math(by_hand, tmp_path):
    run_dir = tmp_path / "run"
    first = run(run_dir, "train.per_device_batch_size=auto", AMPLE, "train.max_steps=5", "train.save_every=5")
    assert chosen(first) == (8, 1)
    resumed = run(run_dir, "train.per_device_batch_size=auto", SMALL, "train.save_every=5", "resume=auto")
    micro, accumulation = chosen(resumed)
    assert micro < 8
    assert f"accepted change layout 1x8x1 -> 1x{micro}x{accumulation}" in resumed.stderr
    assert parity_problems(step_records(by_hand / "metrics.jsonl"), step_records(run_dir / "metrics.jsonl")) == []


@pytest.mark.e2e
def test_auto_without_a_global_batch_is_refused_in_one_line(tmp_path):
    done = run_cli([*MICRO, "train.per_device_batch_size=auto", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "set train.global_batch_size=<sequences per optimizer step> too" in done.stderr


def test_auto_without_a_global_batch_names_only_that_at_any_world_size(compose_spec):
    """The check of the global batch's share per process must not run on a missing one."""
    from runner.config.errors import UserError
    from runner.launch.auto_batch import check_request

    for world in (None, 1, 2):
        with pytest.raises(UserError) as err:
            check_request(compose_spec("recipe=gpt2_clm_tiny", "train.per_device_batch_size=auto"), world)
        assert len(err.value.problems) == 1 and "set train.global_batch_size=" in err.value.problems[0]
