"""launch.min_workers, Ray Train's elastic range (runner/launch/elastic.py): what is refused
before any worker starts, the global batch the spec is frozen with, and the accumulation
each group size derives from it. A node lost on a real cluster, and the run continuing on
one worker equal to the uninterrupted one: tests/launch/test_ray_multiprocess.py."""

from __future__ import annotations

import pytest

from runner.config.batch import accumulation_at
from runner.config.errors import UserError
from runner.config.spec import LaunchEngine, PrecisionKind, RunSpec, StrategyKind
from runner.launch import ray_engine
from runner.launch.elastic import elastic_problems, freeze_global_batch


def elastic(nproc: int = 2, per_device: int = 2, accum: int = 1, **launch) -> RunSpec:
    spec = RunSpec()
    spec.launch.engine, spec.launch.nproc_per_node, spec.launch.max_restarts = LaunchEngine.ray, str(nproc), 1
    spec.launch.min_workers = 1
    for key, value in launch.items():
        setattr(spec.launch, key, value)
    spec.train.per_device_batch_size, spec.train.grad_accum_steps = per_device, accum
    return spec


def test_a_range_every_size_of_which_holds_the_global_batch_is_accepted():
    assert elastic_problems(elastic(), 2) == []
    assert elastic_problems(elastic(nproc=4, per_device=1, accum=3), 4) == []  # 12 sequences: 1, 2, 3 and 4 divide
    assert elastic_problems(elastic(nproc=4, min_workers=4), 4) == []  # a range of one size: Ray's fixed group
    assert elastic_problems(elastic(min_workers=None, max_restarts=0), 2) == []  # not elastic: nothing to check


def test_each_refusal_is_one_line_naming_its_fix():
    local = elastic(engine=LaunchEngine.local)
    [problem] = elastic_problems(local, 2)
    assert "launch.min_workers=1 is Ray Train's elastic range: add launch.engine=ray" in problem
    [problem] = elastic_problems(elastic(min_workers=3), 2)
    assert problem.startswith("launch.min_workers=3 must be 1..2")
    [problem] = elastic_problems(elastic(max_restarts=0), 2)
    assert "each loss is a restart: set launch.max_restarts=1 or more" in problem
    streamed = elastic()
    streamed.data.streaming = True
    [problem] = elastic_problems(streamed, 2)
    assert "a stream resumes only in its own layout" in problem and "data.streaming=false" in problem
    for problems in (elastic_problems(local, 2), elastic_problems(streamed, 2)):
        assert all("\n" not in p for p in problems)


def test_a_group_size_that_does_not_divide_the_global_batch_is_refused():
    # 4 workers x 2 = 8 sequences: a group of 3 would need micro-batches of 2 x 3 = 6
    [problem] = elastic_problems(elastic(nproc=4), 4)
    assert "the global batch of 8 is not a whole number of micro-batches of 2 at 3 workers" in problem
    assert "every group size from 1 to 4 must hold it" in problem
    assert "a multiple of 24 (train.global_batch_size)" in problem  # 2 x lcm(1, 2, 3, 4)
    [problem] = elastic_problems(elastic(nproc=6, per_device=1), 6)  # 6 sequences: 4 and 5 do not divide
    assert "at 4 and 5 workers" in problem


def test_a_strategy_that_cannot_run_or_resume_on_the_smaller_group_is_refused():
    fsdp = elastic()
    fsdp.strategy.kind = StrategyKind.fsdp
    [problem] = elastic_problems(fsdp, 2)
    assert "a group of 1 workers could not run this (strategy=fsdp shards the model over 2 or more" in problem
    assert problem.endswith("Raise launch.min_workers to 2.")
    fsdp_from_2 = elastic(nproc=4, per_device=1, accum=3, min_workers=2)  # 12 sequences on 2, 3 or 4 workers
    fsdp_from_2.strategy.kind = StrategyKind.fsdp
    assert elastic_problems(fsdp_from_2, 4) == []  # FSDP2 reads its checkpoint at any world size
    fp16 = elastic()
    fp16.strategy.kind, fp16.precision.kind = StrategyKind.zero2, PrecisionKind.fp16
    [problem] = elastic_problems(fp16, 2)
    assert "a smaller group resumes the checkpoints on another world size, which this run cannot" in problem
    assert "precision=fp16" in problem


def test_the_frozen_spec_names_its_global_batch_and_each_group_derives_its_accumulation():
    spec = elastic(nproc=4, per_device=1, accum=3)
    freeze_global_batch(spec, 4)
    assert spec.train.global_batch_size == 12
    assert [accumulation_at(spec.train, size) for size in (1, 2, 3, 4)] == [12, 6, 4, 3]
    with pytest.raises(ValueError, match="a group of 5 workers cannot hold the global batch of 12"):
        accumulation_at(spec.train, 5)
    fixed = elastic(min_workers=None)
    freeze_global_batch(fixed, 2)
    assert fixed.train.global_batch_size is None  # only an elastic run's spec changes


def test_a_worker_runs_at_its_groups_size_with_the_global_batch_kept(monkeypatch):
    from runner.train import worker

    seen = []
    monkeypatch.setattr(worker, "train", lambda spec, launched: seen.append(spec.train.grad_accum_steps))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for group, expected in (("1", 2), ("2", 1)):
        spec = elastic()
        freeze_global_batch(spec, 2)
        monkeypatch.setenv("RUNNER_PLANNED_WORLD_SIZE", group)  # what train_loop sets for an elastic group
        worker.run(spec)
        assert seen[-1] == expected


def test_the_launcher_refuses_it_before_any_worker_starts(compose_spec):
    from runner.launch import preflight

    spec = compose_spec("recipe=gpt2_clm_tiny", "launch.nproc_per_node=2", "launch.min_workers=1")
    with pytest.raises(UserError, match="launch.min_workers=1 is Ray Train's elastic range"):
        preflight.validate(spec, 2)


def test_ray_is_given_the_range_and_the_cluster_need_only_hold_its_fewest():
    assert ray_engine.num_workers(elastic().launch) == (1, 2)
    assert ray_engine.num_workers(elastic(min_workers=2).launch) == 2
    assert ray_engine.num_workers(elastic(min_workers=None).launch) == 2
    assert ray_engine.check_resources(elastic().launch, {"CPU": 1.0}, "auto") is False  # starts with 1, grows to 2
    with pytest.raises(UserError) as short:
        ray_engine.check_resources(elastic(nproc=4, min_workers=2).launch, {"CPU": 1.0}, "10.0.0.1:6379")
    assert "launch.min_workers=2 Ray workers at least, but the Ray cluster (10.0.0.1:6379) has 1 CPUs" in str(short.value)
    with pytest.raises(UserError, match="set launch.min_workers to go on with fewer"):
        ray_engine.check_resources(elastic(min_workers=None).launch, {"CPU": 1.0}, "auto")


def test_the_installed_ray_takes_an_elastic_range():
    from ray.train import ScalingConfig

    config = ScalingConfig(num_workers=(1, 2))
    assert config.elasticity_enabled and (config.min_workers, config.max_workers) == (1, 2)


def test_an_automatic_micro_batch_is_refused_for_an_elastic_run():
    from runner.launch import auto_batch

    spec = elastic()
    spec.train.per_device_batch_size, spec.train.global_batch_size = auto_batch.AUTO, 8
    with pytest.raises(UserError, match=r"an elastic run \(launch.min_workers\) runs at several"):
        auto_batch.check_request(spec, 2)
    spec.launch.min_workers = None
    auto_batch.check_request(spec, 2)  # the same request, not elastic: accepted


def test_the_smallest_group_must_fit_where_sharded_states_grow_per_rank(compose_spec):
    """ZeRO-3 splits the weights, gradients and Adam's moments among the ranks: one worker
    holds twice what each of two holds. Memory between the two peaks fits the full group
    and not the smallest: refused, naming launch.min_workers; a ddp run holds the same per
    rank at any size."""
    from runner.launch import fit

    def spec_with(strategy: str, memory: str = "80GB") -> RunSpec:
        return compose_spec("recipe=gpt2_clm_tiny", f"strategy={strategy}", "launch.engine=ray", "launch.nproc_per_node=2",
                            "launch.min_workers=1", "launch.max_restarts=1", "data.block_size=64",
                            f"launch.device_memory={memory}")

    zero3 = spec_with("zero3")
    two, one = (fit.Planner(zero3, 64, world).estimate("zero3").device_total for world in (2, 1))
    assert one > two
    between = spec_with("zero3", f"{(one + two) / 2 / 2**20:.0f}MiB")
    with pytest.raises(UserError) as refused:
        fit.check_fit(between, fit.Planner(between, 64, 2), fit.budget(between, 2))
    [problem] = refused.value.problems
    assert problem.startswith("launch.min_workers=1: in a group of 1 worker(s), this run is predicted not to fit")
    assert problem.endswith("Or raise launch.min_workers.")
    between.launch.min_workers = None  # the same run, not elastic: it fits
    fit.check_fit(between, fit.Planner(between, 64, 2), fit.budget(between, 2))
    ddp = spec_with("ddp")
    two, one = (fit.Planner(ddp, 64, world).estimate("ddp").device_total for world in (2, 1))
    assert one == two
