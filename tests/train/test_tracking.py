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


@pytest.mark.e2e
def test_a_preference_evaluation_goes_to_tensorboard_under_eval_names(tmp_path):
    """A DPO evaluation's rewards/* and logps/* are eval_rewards/* and eval_logps/* (TRL's
    names), as eval_loss is prefixed: one series a name, one value a step (issue 61, 8)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runner.cli import main

    run_dir = tmp_path / "run"
    main(["recipe=gpt2_dpo_tiny", "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=128'",
          "data.block_size=128", "data.max_train_samples=8", "data.max_eval_samples=4", "train.per_device_batch_size=4",
          "train.max_steps=2", "train.log_every=1", "train.eval_every=1", f"hydra.run.dir={run_dir}"])
    [log_dir] = [p.parent for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*") if p.parent.name == "gpt2_dpo_tiny"]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    for name in ("rewards/margins", "rewards/chosen", "logps/chosen"):
        trained = [e.step for e in events.Scalars(name)]
        assert trained == [1, 2], (name, trained)  # the training steps' values alone
        assert [e.step for e in events.Scalars(f"eval_{name}")] == [1, 2], name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if "eval_loss" in r]
    assert evaluations and all("rewards/margins" not in r and "eval_rewards/margins" in r for r in evaluations)
