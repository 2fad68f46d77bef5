"""Registers what Hydra composes from: the schema, the recipes and our resolvers.

Called by the launcher (cli) and by tests before composing; workers never call it.
"""

from __future__ import annotations

import hashlib

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner.config.paths import asset_path, recipes_dir
from runner.config.spec import SCHEMA_NAME, RunSpec


def short_hash(text: str) -> str:
    """Twelve hex chars naming a set of overrides: a sweep job's folder, and a run's
    beside its start time. 48 bits: two of 10,000 jobs share a name with a chance of
    about 2e-7 (six chars, 24 bits, gave 3% at 1,000 jobs, and a collision would keep
    one job's results as another's)."""
    return hashlib.sha1(str(text).encode()).hexdigest()[:12]


def register() -> None:
    if not OmegaConf.has_resolver("asset"):
        # YAML names vendored files (`${asset:austen.txt.gz}`); the frozen spec
        # holds the resolved absolute path.
        OmegaConf.register_new_resolver("asset", lambda name: str(asset_path(name)))
    if not OmegaConf.has_resolver("short_hash"):
        OmegaConf.register_new_resolver("short_hash", short_hash)

    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=RunSpec)
    # Hydra maps a group to a folder of that name, so the top-level recipes/
    # folder is not found as the group `recipe` by itself: register each file.
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
