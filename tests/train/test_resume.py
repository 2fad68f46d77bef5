"""Which layout changes a resume may make: exact continuation or a named refusal."""

from __future__ import annotations

from runner.train.resume import compare, layout_change_problems

MARKER = {"samples_in_epoch": 32}


def test_an_equal_global_batch_in_another_layout_is_accepted(compose_spec):
    old = compose_spec("train.per_device_batch_size=4")
    new = compose_spec("train.per_device_batch_size=4", "train.grad_accum_steps=2")
    assert layout_change_problems(old, new, 2, 1, marker=MARKER) == []
    # Accepted, and said: a change of layout is printed with the other accepted changes.
    assert compare(old, new, 2, 1, MARKER) == (
        [], ["layout 2x4x1 -> 1x4x2 (processes x per-device batch x accumulation), the same global batch of 8"])


def test_a_short_last_step_no_longer_refuses_a_change_of_layout(compose_spec):
    """Every layout trains an epoch's short last step alike (runner/components/data/epoch_batches.py),
    so a resume in another layout continues at the exact sample whatever the sample count."""
    old, new = compose_spec("train.per_device_batch_size=8"), compose_spec("train.per_device_batch_size=4", "train.grad_accum_steps=2")
    assert layout_change_problems(old, new, 1, 1, marker=MARKER) == []


def test_zero_onto_another_world_size_is_read_across_but_an_old_position_is_refused(compose_spec):
    old = compose_spec("strategy=zero2", "train.per_device_batch_size=4")
    new = compose_spec("strategy=zero2", "train.per_device_batch_size=8")
    assert layout_change_problems(old, new, 2, 1, marker=MARKER) == []
    [problem] = layout_change_problems(old, new, 2, 1, marker={"batches_in_epoch": 4})
    assert "predates sample-exact positions" in problem


def test_zero2_on_an_unverified_deepspeed_is_refused_and_names_the_way(compose_spec, monkeypatch):
    """Setting a read-across state into zero2 calls a private DeepSpeed method, fenced by version."""
    import runner.distributed.zero_checkpoint as zero_checkpoint

    monkeypatch.setattr(zero_checkpoint, "engaged", lambda patch: False)
    old = compose_spec("strategy=fsdp", "train.per_device_batch_size=4")
    [problem] = compare(old, compose_spec("strategy=zero2", "train.per_device_batch_size=4"), 2, 2, MARKER)[0]
    assert "needs DeepSpeed 0.19.8" in problem and "strategy=zero3, ddp or fsdp" in problem
    assert "2 processes under strategy=fsdp" in problem


def test_a_sharded_checkpoint_is_read_across_into_another_strategy(compose_spec):
    """zero3 on 2 -> ddp on 1 and fsdp -> ddp are accepted and said, adapters under ZeRO
    too; fp16 is refused with its reason."""
    old = compose_spec("strategy=zero3", "train.per_device_batch_size=4")
    new = compose_spec("strategy=ddp", "train.per_device_batch_size=8")
    breaking, harmless = compare(old, new, 2, 1, MARKER)
    assert breaking == [] and any("strategy zero3 -> ddp: the checkpoint is read across" in h for h in harmless)
    same_layout = compose_spec("strategy=fsdp", "train.per_device_batch_size=4")
    assert compare(same_layout, compose_spec("strategy=ddp", "train.per_device_batch_size=4"), 2, 2, MARKER)[0] == []
    fp16 = compare(compose_spec("strategy=zero3", "precision=fp16"), compose_spec("strategy=ddp", "precision=fp16"), 2, 2,
                   MARKER)[0]
    assert len(fp16) == 1 and "dynamic loss scale" in fp16[0]
    for source in ("zero2", "zero3"):  # adapters move as any trained parameter (certify --peft lora --reshard)
        lora = compare(compose_spec(f"strategy={source}", "peft=lora", "train.per_device_batch_size=4"),
                       compose_spec("strategy=ddp", "peft=lora", "train.per_device_batch_size=8"), 2, 1, MARKER)
        assert lora[0] == [] and any(f"strategy {source} -> ddp: the checkpoint is read across" in h for h in lora[1])
    offload = ("strategy=zero3", "strategy.offload_optimizer=cpu")
    offloaded = compare(compose_spec(*offload, "train.per_device_batch_size=4"),
                        compose_spec(*offload, "train.per_device_batch_size=8"), 2, 1, MARKER)[0]
    assert len(offloaded) == 1 and "offload_optimizer or offload_params set is not verified" in offloaded[0]
    # ddp holds everything on each rank: Accelerate's own load_state reads it at any world size
    assert compare(compose_spec("train.per_device_batch_size=4"), compose_spec("train.per_device_batch_size=2"), 1, 2,
                   MARKER)[0] == []


def test_a_position_between_micro_batches_is_refused(compose_spec):
    old, new = compose_spec("train.per_device_batch_size=2"), compose_spec("train.per_device_batch_size=8")
    [problem] = layout_change_problems(old, new, 4, 1, marker={"samples_in_epoch": 4})
    assert "not a whole number of this layout's micro-batches" in problem


def test_the_same_layout_needs_no_check(compose_spec):
    spec = compose_spec()
    assert layout_change_problems(spec, spec, 1, 1, marker={}) == []


def _folder(tmp_path, steps, results_step=None):
    """A run folder as a run leaves it: complete checkpoints, and results at `results_step`."""
    import json

    from runner.train.checkpoint import COMPLETE_MARKER

    run_dir = tmp_path / "run"
    for step in steps:
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step}" / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
    if results_step is not None:
        (run_dir / "all_results.json").write_text(json.dumps({"train_steps": results_step}))
        (run_dir / "model").mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    return run_dir


def test_a_finished_run_is_found_finished_only_at_its_end_with_its_results(compose_spec, tmp_path):
    from runner.train.resume import finished_message

    run_dir = _folder(tmp_path, [4, 8], results_step=8)
    newest = run_dir / "checkpoints" / "step_8"
    message = finished_message(compose_spec("train.max_steps=8"), run_dir, newest, {"step": 8}, 1, 64)
    assert message is not None and "finished: step 8" in message and "raise train.max_steps" in message
    assert "past" in finished_message(compose_spec("train.max_steps=6"), run_dir, newest, {"step": 8}, 1, 64)
    assert finished_message(compose_spec("train.max_steps=12"), run_dir, newest, {"step": 8}, 1, 64) is None  # more to train
    older = run_dir / "checkpoints" / "step_4"
    assert finished_message(compose_spec("train.max_steps=4"), run_dir, older, {"step": 4}, 1, 64) is None  # a branch
    (run_dir / "model").rename(run_dir / "removed")  # the results, but no model: the worker writes it again
    assert finished_message(compose_spec("train.max_steps=8"), run_dir, newest, {"step": 8}, 1, 64) is None
    (run_dir / "removed").rename(run_dir / "model")
    (run_dir / "all_results.json").unlink()  # killed after the last save, before the results
    assert finished_message(compose_spec("train.max_steps=8"), run_dir, newest, {"step": 8}, 1, 64) is None


def test_a_resume_at_the_last_step_finds_what_is_written_for_it(compose_spec, tmp_path):
    """The final evaluation is reused from eval_results.json beside results of that step,
    else from metrics.jsonl's line at that step, and only on the same evaluation data."""
    import json

    from runner.train.resume import recorded_at_end

    spec = compose_spec("train.max_steps=8", "data.max_eval_samples=16")
    run_dir = _folder(tmp_path, [8], results_step=8)
    full = {"eval_loss": 9.5, "perplexity": 13359.7, "eval_accuracy": 0.1, "eval_samples": 16, "eval_runtime": 0.4,
            "eval_samples_per_second": 40.0}
    (run_dir / "eval_results.json").write_text(json.dumps(full))
    logged = {"eval_loss": 9.25, "perplexity": 10404.6, "eval_accuracy": 0.125}
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "eval_loss": 1.0, "perplexity": 2.7, "eval_accuracy": 0.5}) + "\n")
        f.write(json.dumps({"step": 8, **logged}) + "\n" + '{"step": 8, "eval_l')  # a line torn by kill -9
    found = recorded_at_end(run_dir, 8, spec, spec, eval_samples=16)
    assert (found.results, found.outputs, found.evaluation, found.source) == (True, True, full, "eval_results.json")
    assert found.note(8) == "resume: step 8 is this run's last and its results and model are written: nothing to redo"
    (run_dir / "model").rmdir()
    assert recorded_at_end(run_dir, 8, spec, spec, eval_samples=16).outputs is False
    (run_dir / "all_results.json").unlink()  # killed before the results: the evaluation line logged before it
    found = recorded_at_end(run_dir, 8, spec, spec, eval_samples=16)
    assert (found.results, found.source) == (False, "metrics.jsonl")
    assert found.evaluation == {**logged, "eval_samples": 16, "eval_runtime": None, "eval_samples_per_second": None}
    assert found.note(8) == ("resume: step 8's final evaluation is recorded in metrics.jsonl (eval_loss 9.2500): reused, "
                             "not run again")
    other = compose_spec("train.max_steps=8", "data.max_eval_samples=32")  # other evaluation data: run it again
    assert recorded_at_end(run_dir, 8, spec, other, eval_samples=32).evaluation is None
    assert recorded_at_end(run_dir, 6, spec, spec, eval_samples=16).evaluation is None  # nothing logged at step 6


def test_an_epoch_count_is_planned_as_the_worker_plans_it(compose_spec):
    from runner.train.resume import planned_total_steps

    spec = compose_spec("train.max_steps=null", "train.num_epochs=2", "train.per_device_batch_size=4",
                        "train.grad_accum_steps=2")
    assert planned_total_steps(spec, 2, train_samples=64, marker={}) == 8  # 64 / (4 x 2 x 2) = 4 a pass
    assert planned_total_steps(spec, 2, train_samples=None, marker={"steps_per_epoch": 5}) == 10
    assert planned_total_steps(spec, 2, train_samples=None, marker={}) is None


def test_an_older_checkpoint_sets_the_newer_branch_aside_and_deletes_nothing(tmp_path):
    from runner.train.checkpoint import complete_checkpoints
    from runner.train.resume import set_aside_newer_branch

    run_dir = _folder(tmp_path, [4, 16, 20], results_step=20)
    note = set_aside_newer_branch(run_dir, run_dir / "checkpoints" / "step_4", 4)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_4"]  # pruning and resume=auto see this branch only
    [aside] = (run_dir / "abandoned").iterdir()
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_16", "step_20"]
    assert (aside / "all_results.json").is_file() and (aside / "model").is_dir() and (aside / "metrics.jsonl").is_file()
    assert not (run_dir / "all_results.json").exists()
    assert str(aside) in note and "step_16, step_20" in note and "newest checkpoint (step_20)" in note
    assert set_aside_newer_branch(run_dir, run_dir / "checkpoints" / "step_4", 4) is None  # nothing newer now


def _every_file(run_dir) -> dict[str, str]:
    """Each file's content by name and content: what a branch switch may move, never lose."""
    return {p.read_text(): p.name for p in run_dir.rglob("*") if p.is_file() and p.name != "metrics.jsonl"}


def test_going_back_to_a_set_aside_branch_sets_the_current_one_aside(tmp_path):
    import json

    from runner.train.checkpoint import COMPLETE_MARKER, complete_checkpoints
    from runner.train.resume import start_branch

    run_dir = _folder(tmp_path, [2, 4, 6, 8], results_step=8)  # branch A: 8 steps
    for step in (6, 8):  # tell A's checkpoints from B's
        (run_dir / "checkpoints" / f"step_{step}" / COMPLETE_MARKER).write_text(json.dumps({"step": step, "b": "A"}))
    loaded, note = start_branch(run_dir, run_dir / "checkpoints" / "step_4", 4)  # branch B from step 4
    assert loaded == run_dir / "checkpoints" / "step_4" and "set the newer branch aside" in note
    [a_aside] = (run_dir / "abandoned").iterdir()
    for step in (6, 8, 10):  # B trains to 10
        (run_dir / "checkpoints" / f"step_{step}").mkdir()
        (run_dir / "checkpoints" / f"step_{step}" / COMPLETE_MARKER).write_text(json.dumps({"step": step, "b": "B"}))
    (run_dir / "all_results.json").write_text(json.dumps({"train_steps": 10, "b": "B"}))
    (run_dir / "model").mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "b": "B"}) + "\n" for s in range(1, 11)))
    before = _every_file(run_dir)

    loaded, note = start_branch(run_dir, a_aside / "checkpoints" / "step_6", 6)  # back to A at step 6
    assert loaded == run_dir / "checkpoints" / "step_6"
    assert json.loads((loaded / COMPLETE_MARKER).read_text())["b"] == "A"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_6"]  # resume=auto and pruning see A only
    assert sorted(p.name for p in (a_aside / "checkpoints").iterdir()) == ["step_8"]  # A's later part stays aside
    [b_aside] = [p for p in (run_dir / "abandoned").iterdir() if p != a_aside]
    assert sorted(p.name for p in (b_aside / "checkpoints").iterdir()) == ["step_10", "step_2", "step_4", "step_6", "step_8"]
    assert json.loads((b_aside / "all_results.json").read_text())["b"] == "B" and (b_aside / "model").is_dir()
    assert not (run_dir / "all_results.json").exists() and not (run_dir / "model").exists()
    assert '"b": "B"' in (b_aside / "metrics.jsonl").read_text()
    assert (run_dir / "metrics.jsonl").read_text() == (a_aside / "metrics.jsonl").read_text()  # A's own lines
    assert _every_file(run_dir) == before  # moved, not one file lost or written over
    assert str(b_aside) in note and "step_6 back into checkpoints/" in note


def test_a_resume_from_a_copy_elsewhere_in_the_folder_is_not_in_place(tmp_path):
    from runner.launch.rundir import continues_in_place

    run_dir = _folder(tmp_path, [4])
    assert continues_in_place(run_dir, run_dir / "abandoned" / "after_step_2_x" / "checkpoints" / "step_3")
    assert not continues_in_place(run_dir, run_dir / "mine" / "step_4")


def test_a_save_never_writes_over_another_branchs_complete_checkpoint(tmp_path):
    import json

    import torch
    from accelerate import Accelerator

    from runner.train.checkpoint import COMPLETE_MARKER, save_checkpoint

    run_dir = _folder(tmp_path, [4])
    (run_dir / "checkpoints" / "step_4" / COMPLETE_MARKER).write_text(json.dumps({"step": 4, "b": "other"}))
    accelerator = Accelerator(cpu=True)
    accelerator.register_for_checkpointing(torch.nn.Linear(2, 2))
    save_checkpoint(accelerator, run_dir, 4, keep=3)
    [kept] = (run_dir / "abandoned").iterdir()
    assert kept.name.startswith("replaced_step_4_") and json.loads((kept / COMPLETE_MARKER).read_text())["b"] == "other"
    assert json.loads((run_dir / "checkpoints" / "step_4" / COMPLETE_MARKER).read_text()) == {"step": 4}


def test_resuming_the_newest_checkpoint_sets_nothing_aside(tmp_path):
    from runner.train.resume import set_aside_newer_branch

    run_dir = _folder(tmp_path, [4, 8])  # a run killed after step 8's save
    assert set_aside_newer_branch(run_dir, run_dir / "checkpoints" / "step_8", 8) is None
    assert not (run_dir / "abandoned").exists()


def test_a_stream_resumes_only_in_its_own_layout_and_loader_workers(compose_spec):
    """Each rank's stream position is in its own share, and its loader workers each read
    their own files: another layout or worker count would read other blocks."""
    old = compose_spec("data.streaming=true", "train.max_steps=10", "train.per_device_batch_size=4")
    new = compose_spec("data.streaming=true", "train.max_steps=10", "train.per_device_batch_size=4", "train.grad_accum_steps=2")
    breaking, _ = compare(old, new, 2, 1, {"samples_in_epoch": 32})
    assert breaking == ["layout 2x4x1 -> 1x4x2 (processes x per-device batch x accumulation) of a stream "
                        "(each rank's position is in its own share of it)"]
    workers = compose_spec("data.streaming=true", "train.max_steps=10", "train.per_device_batch_size=4",
                           "train.dataloader_num_workers=1")
    breaking, harmless = compare(old, workers, 1, 1, {})
    assert breaking == ["train.dataloader_num_workers: 0 -> 1"] and harmless == []
    longer = compose_spec("data.streaming=true", "train.max_steps=20", "train.per_device_batch_size=4")
    assert compare(old, longer, 1, 1, {}) == ([], ["train.max_steps: 10 -> 20"])
