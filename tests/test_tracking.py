"""The default tracker writes TensorBoard events that read back."""

import json

import pytest

from conftest import MICRO


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runner.cli import main

    run_dir = tmp_path / "run"
    main([*MICRO, "train.max_steps=4", f"hydra.run.dir={run_dir}"])
    [log_dir] = [p.parent for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*") if p.parent.name == "gpt2_clm_tiny"]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    losses = [e.value for e in events.Scalars("loss")]
    logged = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses == pytest.approx(logged, rel=1e-6) and len(losses) == 4
    assert {"lr", "tokens_per_s", "mfu", "eval_loss"} <= set(events.Tags()["scalars"])
    hparams = (run_dir / "tensorboard").rglob("hparams.yml")
    assert "optim.lr" in next(hparams).read_text()
