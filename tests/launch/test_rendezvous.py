"""The multi-node rendezvous: its timeouts follow launch.rdzv_timeout, and failing to meet
is one line naming the endpoint and the setting, never a hang.

All traffic here is loopback, or none at all (a bind to an address this machine lacks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MICRO
from runner.config.errors import UserError
from runner.launch.launcher import free_port
from runner.launch.rendezvous import check_endpoint, rendezvous_configs
from runner.config.spec import LaunchSpec

TWO_NODES = ["launch.nnodes=2", "launch.nproc_per_node=1"]


def test_rendezvous_timeouts_follow_the_setting():
    configs = rendezvous_configs(LaunchSpec(nnodes=2, node_rank=1, rdzv_timeout=42))
    assert configs == {"is_host": False, "join_timeout": 42, "read_timeout": 42}
    assert rendezvous_configs(LaunchSpec(nnodes=2, node_rank=0))["is_host"] is True


def test_an_endpoint_nothing_answers_is_one_message_naming_it_and_the_setting():
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as err:
        check_endpoint(LaunchSpec(nnodes=2, node_rank=1, rdzv_endpoint=endpoint, rdzv_timeout=2), endpoint)
    message = str(err.value)
    assert f"nothing answered at launch.rdzv_endpoint={endpoint}" in message
    assert "launch.rdzv_timeout=2 s" in message and "\n" not in message


def test_node_0_must_be_able_to_listen_at_the_endpoint():
    # 10.213.0.250 is on no interface of this machine: the bind fails, nothing is sent.
    endpoint = "10.213.0.250:29500"
    with pytest.raises(UserError, match="node 0 hosts the rendezvous there but cannot listen"):
        check_endpoint(LaunchSpec(nnodes=2, node_rank=0, rdzv_endpoint=endpoint), endpoint)


def _node(run_dir: Path, rank: int, endpoint: str, timeout: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *MICRO, *TWO_NODES, f"launch.node_rank={rank}",
         f"launch.rdzv_endpoint={endpoint}", f"launch.rdzv_timeout={timeout}", f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
    )


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.multiprocess
@pytest.mark.parametrize("first", [0, 1])
def test_a_node_that_starts_late_still_joins_within_the_timeout(tmp_path, first):
    """One node starts 20 s after the other (either order) and the two still train together."""
    endpoint = f"127.0.0.1:{free_port()}"
    early = _node(tmp_path / "run", first, endpoint, timeout=60)
    time.sleep(20)
    late = _node(tmp_path / "run", 1 - first, endpoint, timeout=60)
    outputs = [node.communicate(timeout=600)[0] for node in (early, late)]
    assert [early.returncode, late.returncode] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert len(_losses(tmp_path / "run")) == 8


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank, expected", [(0, "not all 2 nodes joined"), (1, "nothing answered")])
def test_a_node_alone_stops_after_the_timeout_with_one_line(tmp_path, rank, expected):
    endpoint = f"127.0.0.1:{free_port()}"
    node = _node(tmp_path / "run", rank, endpoint, timeout=10)
    output = node.communicate(timeout=300)[0]
    assert node.returncode == 2, output[-2000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("runner: error: ") and expected in last, output[-2000:]
    assert f"launch.rdzv_endpoint={endpoint}" in last and "launch.rdzv_timeout=10 s" in last
    assert "Traceback" not in output and "frame #" not in output
