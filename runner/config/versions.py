"""The verified set: the exact library versions CI last passed with (runner/constraints.txt).

pip installs the newest release a package's ranges allow, so a library's release day can
change what a fresh `pip install .` runs. The lock file names the versions that passed
together; `pip install -c runner/constraints.txt .` installs them. torch is recorded but
not constrained (a comment line): a GPU build installed first must be kept.
scripts/lock.py writes the file from a verified environment, scripts/newest.sh tries the
newest releases against it; `runner env`, the banner and run_spec.yaml say where the
installed set differs.
"""

from __future__ import annotations

import importlib.metadata
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

from runner.config.paths import PACKAGE_DIR

LOCK_FILE = PACKAGE_DIR / "constraints.txt"
# The libraries whose versions change what a run computes or how it is launched: runner's
# direct dependencies, the tokenizer, weights and hub clients under transformers, and the
# test oracles. `runner env` and scripts/newest.sh report these; the lock pins more.
KEY_LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "peft", "trl", "lm_eval",
                 "tokenizers", "safetensors", "huggingface_hub", "hydra-core", "omegaconf", "torchdata",
                 "tensorboard", "liger_kernel")
# A pin line `name==version` (constrained), or `# name==version` alone on a line (recorded
# only: torch); an environment marker may follow a pin.
_PIN = re.compile(r"^(#\s*)?([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(;.*)?$")


def canonical(name: str) -> str:
    """PEP 503's normalised name: lm-eval, lm_eval and LM.Eval are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """{canonical name: version} of every pin in a lock file, recorded-only ones included."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[canonical(match.group(2))] = match.group(3)
    return pins


@lru_cache(maxsize=None)
def locked_versions() -> dict[str, str]:
    """The shipped lock's pins; empty where the file is missing (a copy of the package
    without it)."""
    return read_lock(LOCK_FILE) if LOCK_FILE.is_file() else {}


def installed(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_hint(*libraries: str) -> str:
    """The pip command that puts `libraries` (or, with none, runner's whole set) back on
    their verified versions."""
    what = " ".join(libraries) if libraries else "<runner's source folder or wheel>"
    return f"pip install -c {LOCK_FILE} {what}"


def differences(names: tuple[str, ...] = KEY_LIBRARIES) -> list[tuple[str, Optional[str], str]]:
    """(name, installed version or None, locked version) for each of `names` that is
    installed at another version than the lock's. torch is left out where a local build
    (a `+cu...` or `+cpu` suffix) carries the locked release."""
    lock = locked_versions()
    found = []
    for name in names:
        want = lock.get(canonical(name))
        have = installed(name)
        if want is None or have is None or have.split("+")[0] == want:
            continue
        found.append((name, have, want))
    return found
