"""Shared fixtures: offline, CPU-only, a private cache, and a compose helper."""

from __future__ import annotations

import os

# Before any HF import: datasets/transformers must never try the network in tests.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the runner sets it (see runner/cli.py)

from pathlib import Path
from typing import Callable, Iterator

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from runner.config.store import register
from runner.config.paths import conf_dir
from runner.config.spec import RunSpec, to_spec

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
    # Accelerate sets these for the whole process when given an FSDP plugin; later tests'
    # Accelerators would read them and build FSDP too.
    for key in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.setenv(key, "unset")  # recorded, so teardown removes what Accelerate sets
        monkeypatch.delenv(key)
    reset_accelerate_state()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    reset_accelerate_state()
    dist.destroy_process_group()
