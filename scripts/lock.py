"""Write the verified set (runner/constraints.txt) from the environment that passed the tests.

    python scripts/lock.py                 # rewrite runner/constraints.txt from this python's packages
    python scripts/lock.py --out FILE      # write it elsewhere (scripts/newest.sh: the candidate lock)

Every installed distribution is pinned, but for runner itself, pip's own tools and what
belongs to a torch build (torch is recorded as a comment, not constrained, so that a GPU
build installed first is kept; nvidia-* and triton come with such a build). A pin whose
release does not install on every Python runner supports gets an environment marker, so
that an older Python keeps the rest of the lock and pip picks the rest itself.
Commit a new lock only after the tests pass with it (scripts/newest.sh prints the table
that goes in the commit message).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from pathlib import Path
from typing import Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from runner.config.versions import LOCK_FILE, canonical

# Not pinned: runner itself and the installer's tools.
LEFT_OUT = {"runner", "pip", "setuptools", "wheel"}
# Recorded as a comment: the build a user installs first wins.
RECORDED_ONLY = {"torch"}
# Paired with a torch build, not chosen by runner.
TORCH_BUILD_PREFIXES = ("nvidia-", "triton", "cuda-")
SUPPORTED_MINORS = range(10, 15)  # CPython 3.10 .. 3.14: pyproject.toml's requires-python and what follows


def python_marker(requires_python: Optional[str]) -> str:
    """The environment marker for a release whose Requires-Python leaves out some of the
    Pythons runner supports ('' where it installs on all of them)."""
    if not requires_python:
        return ""
    try:
        spec = SpecifierSet(requires_python)
    except InvalidSpecifier:
        return ""
    ok = [minor for minor in SUPPORTED_MINORS if spec.contains(f"3.{minor}.0", prereleases=True)]
    if len(ok) == len(SUPPORTED_MINORS):
        return ""
    if not ok:
        return ' ; python_version < "0"'  # installs on none of them: never applied
    parts = []
    if ok[0] > SUPPORTED_MINORS[0]:
        parts.append(f'python_version >= "3.{ok[0]}"')
    if ok[-1] < SUPPORTED_MINORS[-1]:
        parts.append(f'python_version < "3.{ok[-1] + 1}"')
    return " ; " + " and ".join(parts)


def installed_distributions() -> dict[str, importlib.metadata.Distribution]:
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist)
    return found


def lock_text(dists: dict[str, importlib.metadata.Distribution]) -> str:
    torch = dists.get("torch")
    torch_version = torch.version.split("+")[0] if torch else "not installed"
    lines = [
        "# runner's verified set (the lock): the exact versions its tests last passed with, written by",
        f"# scripts/lock.py on CPython {platform.python_version()}, {platform.system()} {platform.machine()}.",
        "# Install with it:   pip install torch==" + torch_version + " && pip install -c runner/constraints.txt .",
        "# Open ranges instead (the newest releases pyproject.toml allows):   pip install .",
        "# Try the newest releases against this lock: scripts/newest.sh (docs/versions.md).",
        "# torch is recorded, not constrained, so that a GPU build installed first is kept:",
        f"# torch=={torch_version}",
    ]
    for name in sorted(dists):
        if name in LEFT_OUT or name in RECORDED_ONLY or name.startswith(TORCH_BUILD_PREFIXES):
            continue
        dist = dists[name]
        lines.append(f"{name}=={dist.version}{python_marker(dist.metadata['Requires-Python'])}")
    return "\n".join(lines) + "\n"


def extra_requirement(name: str, pyproject: Path = Path(__file__).resolve().parent.parent / "pyproject.toml") -> str:
    """The one requirement of pyproject.toml's extra `name` (deepspeed's, which installs by
    itself after torch: scripts/test.sh, scripts/newest.sh)."""
    import tomllib

    [requirement] = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][name]
    return requirement


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/lock.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=LOCK_FILE, help=f"where to write (default {LOCK_FILE})")
    parser.add_argument("--extra", help="print pyproject.toml's requirement of this one-package extra, write nothing")
    args = parser.parse_args(argv)
    if args.extra:
        print(extra_requirement(args.extra))
        return 0
    args.out.write_text(lock_text(installed_distributions()))
    print(f"lock: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
