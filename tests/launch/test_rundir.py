"""The run folder: results are never overwritten unless overwrite=true, or continued in place."""

import pytest

from runner.config.errors import UserError
from runner.launch.rundir import continues_in_place, prepare_run_dir


def finished_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_4").mkdir(parents=True)
    (run_dir / "all_results.json").write_text('{"train_loss": 3.2}')
    (run_dir / "notes.txt").write_text("mine")
    return run_dir


def test_a_folder_with_results_is_refused_naming_both_ways_out(tmp_path):
    run_dir = finished_run(tmp_path)
    with pytest.raises(UserError, match=r"already holds results \(all_results.json, checkpoints\); resume=auto found.*"
                                        r"hydra.run.dir=PATH.*overwrite=true"):
        prepare_run_dir(run_dir, overwrite=False, why="; resume=auto found no checkpoint in it to continue from")
    assert (run_dir / "all_results.json").read_text() == '{"train_loss": 3.2}'


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    run_dir = finished_run(tmp_path)
    prepare_run_dir(run_dir, overwrite=True)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_continuing_in_place_keeps_everything(tmp_path):
    run_dir = finished_run(tmp_path)
    prepare_run_dir(run_dir, overwrite=False, continuing=True)
    assert (run_dir / "all_results.json").exists() and (run_dir / "checkpoints" / "step_4").is_dir()


def test_only_a_checkpoint_of_this_folder_continues_in_place(tmp_path):
    run_dir = finished_run(tmp_path)
    assert continues_in_place(run_dir, run_dir / "checkpoints" / "step_4")
    assert not continues_in_place(run_dir, tmp_path / "other" / "checkpoints" / "step_4")
    assert not continues_in_place(run_dir, None)


POLICIES = {
    ("ddp", "bf16"): "# precision: bf16 autocast over fp32 weights: matmuls in bf16; weights, gradients and AdamW in fp32\n",
    ("zero2", "bf16"): "# precision: DeepSpeed bf16: the whole module in bf16 (weights, activations, the backward); fp32 master "
                       "weights and AdamW state in ZeRO's partitions\n",
    ("zero3", "bf16"): "# precision: DeepSpeed bf16: the whole module in bf16 (weights, activations, the backward); fp32 master "
                       "weights and AdamW state in ZeRO's partitions\n",
    ("fsdp", "bf16"): "# precision: FSDP2 MixedPrecisionPolicy: parameters gathered and computed in bf16 (param_dtype), under "
                      "autocast; gradients reduce-scattered in fp32 onto fp32 sharded weights and AdamW state\n",
    ("zero2", "fp32"): "# precision: fp32 throughout (TF32 off)\n",
}


@pytest.mark.parametrize(("strategy", "precision"), list(POLICIES), ids=lambda v: v)
def test_run_spec_says_what_the_precision_means_under_the_strategy(tmp_path, strategy, precision):
    """precision=bf16 is three numerics (ddp, zero2/zero3, fsdp): run_spec.yaml says which
    (the banner prints the same notes), as a comment the loader ignores."""
    from runner.config.spec import PrecisionKind, PrecisionSpec, RunSpec, StrategyKind, StrategySpec, load_spec
    from runner.launch.rundir import freeze

    spec = RunSpec(strategy=StrategySpec(kind=StrategyKind(strategy)), precision=PrecisionSpec(kind=PrecisionKind(precision)))
    path = freeze(spec, tmp_path)
    text = path.read_text()
    assert [line for line in text.splitlines(keepends=True) if line.startswith("# precision:")] == [POLICIES[strategy, precision]]
    assert load_spec(path).precision.kind.value == precision
