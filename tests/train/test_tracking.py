"""The default tracker writes TensorBoard events that read back."""

import json

import pytest

from conftest import MICRO


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """A run that logged steps 5-8 after its step-4 checkpoint and is resumed from it logs
    5-8 again; TensorBoard must show each step once, with the resumed run's values."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runner.cli import main

    run_dir = tmp_path / "run"
    # GPT-2's dropout on, as the recipes train: the resumed steps continue its random stream
    dropout_on = [o for o in MICRO if not o.startswith("model.config_overrides")] + [
        "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64'"]
    main([*dropout_on, "train.save_every=4", "train.eval_every=0", f"hydra.run.dir={run_dir}"])
    shutil.rmtree(run_dir / "checkpoints" / "step_8")  # as if it died after logging step 8, before saving it
    (run_dir / "all_results.json").unlink()
    main(["--spec", str(run_dir / "run_spec.yaml"), "--run-dir", str(run_dir), "--resume", "auto"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "all_results.json").read_text())["resumed_from_step"] == 4

    [log_dir] = {p.parent for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*") if p.parent.name == "gpt2_clm_tiny"}
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one file per attempt
    events = EventAccumulator(str(log_dir))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("loss")]
    logged = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [step for step, _ in shown] == list(range(1, 9))
    assert [value for _, value in shown] == pytest.approx([value for _, value in logged], rel=1e-6)
