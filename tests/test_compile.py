"""torch.compile under two processes: ddp and zero2 train as their eager runs do.

Slow: four spawned two-process runs, two of them compiling with inductor.
"""

from __future__ import annotations

import json

import pytest

from test_multiprocess import losses, runner

pytestmark = pytest.mark.multiprocess

STEPS = ["train.max_steps=4"]


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_compiled_losses_equal_eager_at_two_processes(tmp_path, strategy):
    common = ["launch.nproc_per_node=2", "train.per_device_batch_size=4", f"strategy={strategy}", *STEPS]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    for run_dir, extra in ((eager, []), (compiled, ["model.compile=true"])):
        done = runner(run_dir, *common, *extra, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]
    assert len(losses(compiled)) == 4
    assert losses(compiled) == pytest.approx(losses(eager), abs=1e-4)
    assert losses(compiled, "grad_norm") == pytest.approx(losses(eager, "grad_norm"), abs=1e-4)
    fingerprints = json.loads((compiled / "all_results.json").read_text())["rank_param_fingerprints"]
    assert len(fingerprints) == 2 and fingerprints[0] == pytest.approx(fingerprints[1], rel=1e-9)
