"""Where the shipped configuration and assets live, installed or in a checkout.

`conf/` and `recipes/` sit at the repository's top level; a wheel carries them as
`runner/_conf` and `runner/_recipes` (see pyproject.toml). An editable install or
a source checkout finds them next to the package instead.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # runner/, this file being runner/config/paths.py


def _shipped(installed_name: str, checkout_name: str) -> Path:
    installed = PACKAGE_DIR / installed_name
    if installed.is_dir():
        return installed
    return PACKAGE_DIR.parent / checkout_name


def conf_dir() -> Path:
    return _shipped("_conf", "conf")


def recipes_dir() -> Path:
    return _shipped("_recipes", "recipes")


def asset_path(name: str) -> Path:
    """A vendored asset (tokenizer folder, corpus) by name, e.g. `gpt2_tokenizer`."""
    return PACKAGE_DIR / "assets" / name


def default_cache_dir() -> Path:
    root = os.environ.get("RUNNER_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "runner"
