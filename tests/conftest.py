"""Shared fixtures: offline, CPU-only, a private cache, a compose helper, and the tiers.

Every test has one tier marker, by what it costs (registered in pyproject.toml):
  unit          in this process, no training run (unmarked tests get it)
  e2e           a training run through the CLI or the worker, in this process or one child
  multiprocess  two or more worker processes (torch elastic, torchrun)
  cluster       the two-node Slurm cluster in network namespaces (scripts/test-cluster.sh)
The guard below fails a test that costs more than its marker says: a unit test that
trains or starts a process, or an e2e test that starts several workers.
"""

from __future__ import annotations

import logging
import os

# Before any HF import: datasets/transformers must never try the network in tests.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the runner sets it (see runner/cli.py)
# pytest-xdist's workers share the machine's cores: each test process, and each run it
# starts, takes its share of threads, before torch is imported here or in a child. Two
# workers of 2-thread OpenMP on 2 cores spin against each other: two 1-process tiny runs
# side by side took 41-57 s at 2 threads each and 25 s at 1 (the launcher keeps an
# OMP_NUM_THREADS it is given, runner/launch/launcher.py prepare_environment).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").isdigit():
    from runner.launch.cpus import usable_cpus  # no torch: affinity and cgroup quota, as the launcher counts

    os.environ.setdefault("OMP_NUM_THREADS", str(max(usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), 1)))

import multiprocessing.process
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from runner.config.paths import conf_dir
from runner.config.spec import RunSpec, to_spec
from runner.config.store import register

# A micro GPT-2 and a few blocks: whole runs in seconds on a 2-core CPU.
MICRO = [
    "recipe=gpt2_clm_tiny",
    # Dropout off: runs that differ only in batch layout must give equal losses.
    "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0'",
    "data.block_size=32",
    "data.max_train_samples=96",
    "data.max_eval_samples=16",
    "train.per_device_batch_size=4",
    "train.max_steps=8",
    "train.log_every=1",
    "train.eval_every=4",
    "schedule.warmup_steps=2",
]


def patch_train_step(tmp_path: Path, condition: str, action: str) -> dict[str, str]:
    """Environment that makes spawned workers run `action` inside Trainer.train_step when
    `condition` holds (a sitecustomize.py on PYTHONPATH): failure injection for tests,
    with no switch in product code. Both are Python expressions/statements over
    `os`, `time` and `self`."""
    inject = tmp_path / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(
        "import os, time\n"
        "import runner.train.trainer as trainer\n"
        "original = trainer.Trainer.train_step\n"
        "def patched(self, batch):\n"
        f"    if {condition}:\n"
        f"        {action}\n"
        "    return original(self, batch)\n"
        "trainer.Trainer.train_step = patched\n"
    )
    return {"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_or_dump(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run for a launch of several processes, which fails with every process's
    Python stacks instead of hanging: past `timeout`, py-spy (a test dependency) dumps each
    process of the launch's session, then they are killed."""
    import signal

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        listed = subprocess.run(["ps", "-o", "pid=,cmd=", "-s", str(proc.pid)], capture_output=True, text=True).stdout
        stacks = [f"{line[:200]}\n" + subprocess.run(["py-spy", "dump", "--pid", line.split()[0]], capture_output=True,
                                                    text=True, timeout=60).stdout for line in listed.splitlines()[:12]]
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launch ran past {timeout:.0f} s. Its stderr's end:\n{err[-3000:]}\n"
                    f"Its processes' stacks:\n" + "\n".join(stacks))
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tokenized data goes to a per-session cache, never the user's."""
    cache = tmp_path_factory.mktemp("runner_cache")
    # DeepSpeed's JIT-built CPU ops (minutes to compile on 2 cores) are not data: keep
    # them where runner keeps them for the user, built once per machine, not per session.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "runner" / "torch_extensions"))
    old = os.environ.get("RUNNER_CACHE_DIR")
    os.environ["RUNNER_CACHE_DIR"] = str(cache)
    yield
    if old is None:
        os.environ.pop("RUNNER_CACHE_DIR", None)
    else:
        os.environ["RUNNER_CACHE_DIR"] = old


@contextmanager
def environment_restored() -> Iterator[None]:
    """os.environ as it was before, whatever the body set or removed. Accelerate writes
    ACCELERATE_USE_DEEPSPEED / _FSDP, RANK, MASTER_PORT... into the process when it builds
    a plugin or a state; a later test on the same xdist worker then built DeepSpeed without
    a process group (CI: 10 failures, mpi4py and "Default process group has not been
    initialized", in tests that never asked for DeepSpeed)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test starts with the environment the session's fixtures set, never one an
    earlier test left (environment_restored)."""
    with environment_restored():
        yield


def _muted_runner_loggers() -> list[str]:
    loggers = logging.root.manager.loggerDict.items()
    return sorted(name for name, logger in loggers
                  if isinstance(logger, logging.Logger) and name.split(".")[0] == "runner" and logger.disabled)


@pytest.fixture(autouse=True)
def _runner_logging_left_on() -> Iterator[None]:
    """A test that leaves runner's loggers switched off fails here, and they are switched
    back on: a `logging.config.dictConfig` in this process (import-linter's CLI calls one
    with disable_existing_loggers) silenced every later in-process run's run.log and its
    logged lines on that xdist worker (CI: 3 e2e failures far from the cause)."""
    disabled = logging.root.manager.disable
    yield
    muted = _muted_runner_loggers()
    for name in muted:
        logging.getLogger(name).disabled = False
    changed = logging.root.manager.disable != disabled
    logging.disable(disabled)
    assert not muted and not changed, (
        f"this test left runner's loggers off (disabled: {muted}; logging.disable changed: {changed}); "
        "restore what it switched off")


@pytest.fixture
def compose_spec() -> Callable[..., RunSpec]:
    """Compose the shipped config with overrides, as the launcher does, into a RunSpec."""

    def _compose(*overrides: str) -> RunSpec:
        register()
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=list(overrides))
        return to_spec(cfg)

    return _compose


@pytest.fixture
def micro_overrides(tmp_path: Path) -> list[str]:
    return [*MICRO, f"hydra.run.dir={tmp_path / 'run'}"]


@pytest.fixture
def one_rank_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-process gloo group, as a spawned rank has: enough for FSDP2 and DeepSpeed to
    wrap a model in-process (one shard), in seconds."""
    import torch.distributed as dist

    from runner.distributed.accelerator import reset_accelerate_state

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}.items():
        monkeypatch.setenv(key, value)
    # What Accelerate sets for the whole process (ACCELERATE_USE_FSDP...) is undone after
    # the test by _environment_restored.
    reset_accelerate_state()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    reset_accelerate_state()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- tiers
TIERS = ("unit", "e2e", "multiprocess", "cluster")
# What a child process's command line says about its cost: several workers, or the cluster.
_MANY_WORKERS = ("nproc_per_node=2", "nproc_per_node=3", "nproc_per_node=4", "--nproc-per-node", "--nproc_per_node",
                 "torchrun", "nnodes=2", "--num_processes")
# Children that are tools, not runs: DeepSpeed JIT-compiles its CPU ops once per machine,
# and libraries probe the machine (uname, ldconfig; matplotlib's fc-list when it first
# builds a user's font cache); they cost no tier.
_TOOLS = {"gcc", "g++", "cc", "c++", "ld", "ninja", "nvcc", "uname", "ldconfig", "lscpu", "numactl", "nvidia-smi", "which", "git",
          "fc-list"}
_COMPILERS = {"gcc", "g++", "cc", "c++", "ld"}  # also under a target prefix: Debian's Python builds with x86_64-linux-gnu-gcc


def _is_tool(program: str) -> bool:
    return program in _TOOLS or program.rsplit("-", 1)[-1] in _COMPILERS


_CLUSTER = ("srun", "sbatch", "squeue", "scontrol", "sacct", "ip netns", "test-cluster.sh", "nsenter")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers:
            item.add_marker(pytest.mark.unit)
        elif len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} has tiers {tiers}: give it the one it costs")
        # Under `-n N --dist loadgroup` (scripts/test.sh) the cluster tier stays on one
        # worker: its session fixture brings up the one Slurm cluster this machine can hold
        # (CI runs it alone). The training tests that share a module-scoped fixture (runs
        # their tests read) stay on one worker too, or it would be built on each worker
        # they land on. Every other test goes wherever a worker is free.
        if item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif not item.get_closest_marker("unit") and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def refuse_a_loadgroup_that_cannot_group(config: pytest.Config) -> None:
    """--dist loadgroup (scripts/test.sh) groups a test by appending its group to its node
    id on the worker, which pytest 9.2 no longer takes (pytest-dev/pytest-xdist#1386).
    Nothing fails then: every test is scheduled alone and each shared fixture is built on
    both workers (a fresh clone with pytest 9.2.0: tests/test_compile.py's runs built
    twice, 142 and 139 s; so were the other training modules'). Refuse to start instead.
    pyproject.toml's dev extras keep pytest below 9.2."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    pytest_version = tuple(int(part) for part in pytest.__version__.split(".")[:2] if part.isdigit())
    xdist_version = version("pytest-xdist")
    if pytest_version >= (9, 2) and xdist_version.startswith(("3.8.", "3.7.", "3.6.", "3.5.")):
        raise pytest.UsageError(
            f"pytest-xdist {xdist_version} does not group tests under pytest {pytest.__version__} "
            "(pytest-dev/pytest-xdist#1386), so --dist loadgroup would build each shared fixture on "
            "every worker: pip install -e '.[dev]' (pytest<9.2)")


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


def _tier(item: pytest.Item) -> str:
    return next(t for t in TIERS if item.get_closest_marker(t))


class TierGuard:
    """Notes what a test, or a fixture it uses, starts: child processes (their command
    lines), spawned multiprocessing workers, and in-process training runs."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.spawned = 0
        self.trained = 0

    def needed(self) -> str:
        text = " ".join(self.commands)
        if any(word in text for word in _CLUSTER):
            return "cluster"
        if self.spawned or any(word in text for word in _MANY_WORKERS):
            return "multiprocess"
        return "e2e" if self.commands or self.trained else "unit"


_ACTIVE: list[TierGuard] = []  # the test's guard, and a fixture's while it is set up
# What setting up each fixture cost (a module fixture's run counts for its tests), keyed by
# the fixture's definition: two modules' fixtures of one name cost what each costs.
_FIXTURE_TIER: dict[tuple[str, str], str] = {}


def _costlier(*tiers: str) -> str:
    return max(tiers, key=TIERS.index)


def pytest_configure(config: pytest.Config) -> None:
    """Wrap what starts processes or trains, once for the session, noting it on the
    innermost active guard."""
    refuse_a_loadgroup_that_cannot_group(config)
    import runner.train.worker as worker

    popen_init, process_start, train = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start, worker.train

    def noting_popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        command = args if isinstance(args, str) else " ".join(map(str, args))
        if _ACTIVE and not _is_tool(Path(command.split(" ", 1)[0]).name):
            _ACTIVE[-1].commands.append(command)
        popen_init(self, args, *rest, **kwargs)

    def noting_start(self: Any) -> None:
        if _ACTIVE:
            _ACTIVE[-1].spawned += 1
        process_start(self)

    def noting_train(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE:
            _ACTIVE[-1].trained += 1
        return train(*args, **kwargs)

    subprocess.Popen.__init__ = noting_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = noting_start  # type: ignore[method-assign]
    worker.train = noting_train


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Iterator[None]:
    guard = TierGuard()
    _ACTIVE.append(guard)
    try:
        yield
    finally:
        _ACTIVE.remove(guard)
        key = _fixture_key(fixturedef)
        _FIXTURE_TIER[key] = _costlier(_FIXTURE_TIER.get(key, "unit"), guard.needed())


def _fixture_key(fixturedef: Any) -> tuple[str, str]:
    return fixturedef.baseid, fixturedef.argname


def _fixture_tiers(item: pytest.Item) -> list[str]:
    """What each fixture the test uses cost, by the definition it resolves to."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    return [_FIXTURE_TIER.get(_fixture_key(defs[name][-1]), "unit") if defs.get(name) else "unit"
            for name in getattr(item, "fixturenames", ())]


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    guard = TierGuard()
    _ACTIVE.append(guard)
    yield
    _ACTIVE.remove(guard)
    fixtures = _fixture_tiers(request.node)
    needed, marked = _costlier(guard.needed(), *fixtures), _tier(request.node)
    report = os.environ.get("RUNNER_TIER_REPORT")  # a file: note each test's tier there, for re-marking
    if report:
        with open(report, "a") as out:
            out.write(f"{request.node.nodeid}\t{marked}\t{needed}\t{guard.commands[:2]}\n")
    if not report and TIERS.index(needed) > TIERS.index(marked):
        pytest.fail(f"this test is marked {marked} but costs {needed} (started: {guard.commands[:3]}, "
                    f"{guard.spawned} spawned workers, {guard.trained} in-process runs, fixtures {fixtures}): "
                    f"mark it @pytest.mark.{needed}", pytrace=False)
