"""launch.engine=ray without starting Ray (runner/launch/ray_engine.py): what is refused and
how, what the workers are handed, how a failure is told, and the names runner calls in the
installed Ray. The runs on a local Ray: tests/launch/test_ray_multiprocess.py."""

from __future__ import annotations

import inspect
import logging
import socket
from pathlib import Path

import pytest

from runner.config.errors import RunFailed, UserError
from runner.config.spec import LaunchEngine, LaunchSpec, RunSpec
from runner.config.validate import check_launch
from runner.launch import ray_engine
from runner.launch.failure_notes import FailureNote
from runner.train.checkpoint import add_checkpoint_hook, checkpoint_saved


def ray_launch(**fields) -> LaunchSpec:
    return LaunchSpec(engine=LaunchEngine.ray, **fields)


def problems(launch: LaunchSpec) -> list[str]:
    spec = RunSpec()
    spec.launch = launch
    return check_launch(spec)


def test_ray_places_every_worker_so_the_torch_rendezvous_settings_are_refused():
    assert problems(ray_launch(nnodes=2, nproc_per_node="2")) == []  # 4 workers that Ray places: no endpoint needed
    for fields in ({"nnodes": 2, "node_rank": 1}, {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29500"}):
        [problem] = problems(ray_launch(**fields))
        assert "launch.engine=ray places the workers itself" in problem and "run the command once" in problem
        assert "\n" not in problem
    # the local engine still needs its endpoint for several nodes
    assert any("rdzv_endpoint" in p for p in problems(LaunchSpec(nnodes=2)))


def test_the_ray_address_is_checked_and_read_only_by_the_ray_engine():
    assert problems(ray_launch(ray_address="10.0.0.1:6379")) == []
    assert problems(ray_launch(ray_address="ray://head.example:10001")) == []
    [bad] = problems(ray_launch(ray_address="head.example"))
    assert "launch.ray_address=head.example must be auto, HOST:PORT or ray://HOST:PORT" in bad
    [unused] = problems(LaunchSpec(ray_address="10.0.0.1:6379"))
    assert "read only under launch.engine=ray" in unused


def test_ray_not_installed_is_refused_naming_the_extra(monkeypatch, compose_spec):
    import importlib.util
    import sys

    from runner.launch import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    spec = compose_spec("recipe=gpt2_clm_tiny", "launch.engine=ray")
    [problem] = [p for p in preflight.check_machine(spec) if "Ray" in p]
    assert 'pip install "runner[ray]"' in problem
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is not installed
    with pytest.raises(UserError, match=r'pip install "runner\[ray\]"'):
        ray_engine.connect(ray_launch())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Without the probe, ray.init retries the address without end: fail in a minute, not at
# pytest-timeout's 15 (seen with the address parser broken on purpose).
@pytest.mark.timeout(60)
@pytest.mark.parametrize("via", ["launch.ray_address", "RAY_ADDRESS"])
def test_an_unreachable_address_is_refused_in_one_line_without_waiting_on_ray(via, monkeypatch):
    """ray.init retries an address nobody listens at for minutes on end; the launcher asks first."""
    import ray

    assert not ray.is_initialized()
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    if via == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
        launch = ray_launch()
    else:
        launch = ray_launch(ray_address=address)
    with pytest.raises(UserError) as refused:
        ray_engine.connect(launch)
    [line] = refused.value.problems
    assert line.startswith(f"{via}={address}: no Ray cluster answers there") and "ray start --head" in line
    assert not ray.is_initialized()


def test_more_workers_than_the_cluster_holds_are_refused():
    assert ray_engine.check_resources(ray_launch(nproc_per_node="2"), {"CPU": 2.0}, "auto") is False
    assert ray_engine.check_resources(ray_launch(nproc_per_node="2"), {"CPU": 8.0, "GPU": 2.0}, "auto") is True
    with pytest.raises(UserError) as cpus:
        ray_engine.check_resources(ray_launch(nproc_per_node="2", nnodes=2), {"CPU": 2.0}, "10.0.0.1:6379")
    assert "= 4 Ray workers, but the Ray cluster (10.0.0.1:6379) has 2 CPUs" in str(cpus.value)
    with pytest.raises(UserError, match="has 1 GPUs"):
        ray_engine.check_resources(ray_launch(nproc_per_node="2"), {"CPU": 32.0, "GPU": 1.0}, "auto")


def test_the_workers_get_runners_settings_and_not_the_devices_or_rays():
    environ = {"RUNNER_PLANNED_WORLD_SIZE": "2", "RUNNER_FAILURE_NOTES": "/tmp/n", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": "/x", "TORCH_EXTENSIONS_DIR": "/c", "DS_ACCELERATOR": "cpu",
               "CUDA_VISIBLE_DEVICES": "0,1", "RAY_ADDRESS": "h:1", "PATH": "/bin", "HOME": "/root",
               "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0"}
    assert sorted(ray_engine.forwarded_environment(environ)) == [
        "DS_ACCELERATOR", "HF_HUB_OFFLINE", "OMP_NUM_THREADS", "PYTHONPATH", "RUNNER_FAILURE_NOTES",
        "RUNNER_PLANNED_WORLD_SIZE", "TORCH_EXTENSIONS_DIR"]


def test_a_restarted_group_is_told_its_attempt():
    counter = ray_engine.AttemptCounter()
    assert [counter.next(), counter.next(), counter.next()] == [0, 1, 2]


def test_each_checkpoint_reaches_the_hooks_a_launch_engine_registered(tmp_path):
    seen = []
    remove = add_checkpoint_hook(lambda path, figures: seen.append((path, figures)))
    checkpoint_saved(tmp_path / "step_4", {"step": 4, "epoch": 0})
    remove()
    checkpoint_saved(tmp_path / "step_8", {"step": 8, "epoch": 0})  # after removal: nobody told
    assert seen == [(tmp_path / "step_4", {"step": 4, "epoch": 0})]


def test_a_checkpoint_is_reported_to_ray_in_place(monkeypatch, tmp_path):
    import ray.train
    from ray.train import CheckpointUploadMode

    reports = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kwargs: reports.append((metrics, kwargs)))
    ray_engine.report_checkpoint(tmp_path / "checkpoints" / "step_4", {"step": 4, "epoch": 0})
    [(metrics, kwargs)] = reports
    assert metrics == {"step": 4, "epoch": 0}
    assert kwargs["checkpoint"].path == str(tmp_path / "checkpoints" / "step_4")
    assert kwargs["checkpoint_upload_mode"] is CheckpointUploadMode.NO_UPLOAD  # nothing copied
    assert kwargs["checkpoint_dir_name"] == "step_4"


def test_a_failed_run_names_the_rank_that_failed_first_and_shows_its_traceback_once(capsys):
    notes = [FailureNote(0, 12.0, "RuntimeError: Connection closed by peer", "Traceback (peer)\n"),
             FailureNote(1, 10.0, "ValueError: injected", "Traceback (most recent call last):\nValueError: injected\n")]
    failed = ray_engine._run_failed(RuntimeError("Ray's summary"), notes)
    assert isinstance(failed, RunFailed) and str(failed) == "worker rank 1 failed under Ray Train: ValueError: injected"
    err = capsys.readouterr().err
    assert err.count("ValueError: injected") == 1 and err.startswith("[rank 1] Traceback") and "peer" not in err


def test_without_notes_the_failure_is_rays_record_of_it():
    class WorkerGroupError(Exception):
        worker_failures = {1: ValueError("boom\nmore"), 0: RuntimeError("")}

    assert str(ray_engine._run_failed(WorkerGroupError(), [])) == "worker rank 0 failed under Ray Train: RuntimeError"

    class ControllerError(Exception):
        controller_failure = TimeoutError("placement timed out")

    assert str(ray_engine._run_failed(ControllerError(), [])) == (
        "Ray Train failed: TimeoutError: placement timed out")


def test_the_launcher_hands_a_ray_launch_to_the_ray_engine(compose_spec, monkeypatch, tmp_path):
    from runner.launch import launcher

    seen = []
    monkeypatch.setattr(launcher, "prepare_environment", lambda *args, **kwargs: None)
    monkeypatch.setattr(ray_engine, "launch", lambda spec, path, launched: seen.append(("ray", path, launched)))
    monkeypatch.setattr(launcher, "_spawn", lambda *args: seen.append(("spawned",)))
    monkeypatch.setattr(launcher, "environment_for", lambda method: seen.append(("forkserver",)))
    spec = compose_spec("recipe=gpt2_clm_tiny", "launch.engine=ray", "launch.nproc_per_node=2")
    launcher.start_server_early(spec)  # Ray starts its own workers: no forkserver
    launcher.launch(spec, tmp_path / "run_spec.yaml", 12.5)
    assert seen == [("ray", tmp_path / "run_spec.yaml", 12.5)]


def test_the_names_runner_calls_exist_in_the_installed_ray():
    """Ray Train's v2 API moved fast; what runner passes must be what the installed release takes."""
    import ray.train
    import ray.train.v2._internal.execution.context as reporting
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, TrainingFailedError
    from ray.train.collective import broadcast_from_rank_zero
    from ray.train.torch import TorchConfig, TorchTrainer

    assert {"train_loop_config", "scaling_config", "torch_config", "run_config"} <= set(
        inspect.signature(TorchTrainer).parameters)
    assert {"name", "storage_path", "failure_config", "checkpoint_config", "worker_runtime_env",
            "logging_config"} <= set(inspect.signature(RunConfig).parameters)
    assert {"checkpoint", "checkpoint_dir_name", "checkpoint_upload_mode"} <= set(
        inspect.signature(ray.train.report).parameters)
    FailureConfig(max_failures=1), CheckpointConfig(num_to_keep=None), LoggingConfig(log_level="ERROR")
    TorchConfig(timeout_s=60)
    assert "worker_failures" in inspect.signature(ray.train.WorkerGroupError).parameters
    assert issubclass(ray.train.WorkerGroupError, TrainingFailedError) and callable(broadcast_from_rank_zero)
    # the loggers train_loop quiets: the failing function's traceback, each report's line
    assert logging.getLogger("ray.train.v2._internal.util") is not None
    assert Path(reporting.__file__).name == "context.py"
    assert "logging.getLogger(__file__)" in Path(reporting.__file__).read_text()
    import ray.train.v2._internal.util as util

    assert 'logger = logging.getLogger(__name__)' in Path(util.__file__).read_text()
    assert "Error in training function" in Path(util.__file__).read_text()


@pytest.mark.parametrize("strategy, kept", [("ddp", False), ("zero2", True)])
def test_one_ray_worker_runs_as_the_launchers_own_process_does(strategy, kept, compose_spec, monkeypatch, tmp_path):
    """Ray's variables for a world of one made Accelerate count the run as distributed (the
    banner said cpu:0); they stay only where a strategy needs a group of one (DeepSpeed)."""
    from runner.config.spec import spec_to_yaml

    spec_path = tmp_path / "run_spec.yaml"
    spec = compose_spec("recipe=gpt2_clm_tiny", f"strategy={strategy}", "launch.engine=ray")
    spec_path.write_text(spec_to_yaml(spec))
    ray_set = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0",
               "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "41000"}
    for key, value in ray_set.items():
        monkeypatch.setenv(key, value)
    ray_engine.as_one_process(str(spec_path))
    import os

    left = {key: os.environ.get(key) for key in ray_set}
    if kept:
        assert left["WORLD_SIZE"] == "1" and left["MASTER_ADDR"] == "127.0.0.1" and left["MASTER_PORT"] != "41000"
    else:
        assert left == {**dict.fromkeys(ray_set), "RANK": "0"}  # RANK: the rank's failure note is filed under it


def test_rays_switches_hold_for_the_launch_only(monkeypatch, tmp_path):
    """A sweep runs its jobs in the launcher's process: the next job starts without them."""
    import os

    for key in {**ray_engine.RAY_TRAIN_SETTINGS, **ray_engine.LOCAL_RAY_SETTINGS}:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")  # the user's own, kept
    seen = {}

    def fake_connect(launch):
        os.environ.update(ray_engine.LOCAL_RAY_SETTINGS)
        seen.update(os.environ)
        raise UserError("stop here")

    monkeypatch.setattr(ray_engine, "connect", fake_connect)
    with pytest.raises(UserError):
        ray_engine.launch(RunSpec(), tmp_path / "run_spec.yaml", None)
    assert seen["RAY_TRAIN_V2_ENABLED"] == "1" and seen["RAY_CHDIR_TO_TRIAL_DIR"] == "0"
    assert os.environ["RAY_DEDUP_LOGS"] == "1"
    assert not [key for key in {**ray_engine.RAY_TRAIN_SETTINGS, **ray_engine.LOCAL_RAY_SETTINGS}
                if key != "RAY_DEDUP_LOGS" and key in os.environ]
