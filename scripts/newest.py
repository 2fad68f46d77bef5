"""scripts/newest.sh's Python half: what to test, what the registry has, and the table.

    python scripts/newest.py patch-tests              # the pytest node ids every fenced patch names
    python scripts/newest.py registry OUT.json        # the registry's newest release of each key library (pip index)
    python scripts/newest.py table --checks C.json --registry R.json [--lock FILE]

The table has a row per key library (runner/config/versions.py KEY_LIBRARIES): the
locked version, the one installed here (the newest pyproject.toml's ranges allow, in
newest.sh's venv), the registry's newest, and a verdict. Only `registry` reaches the
network; the rest reads files, so tests/test_newest.py runs it on fixtures.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from packaging.version import InvalidVersion, Version

from runner.config.versions import KEY_LIBRARIES, LOCK_FILE, canonical, installed, read_lock
from runner.distributed.patches import PATCHES


@dataclass(frozen=True)
class Row:
    library: str
    locked: str
    installed: str
    newest: str
    verdict: str


def patch_tests() -> list[str]:
    """Every fenced patch's tests, each once, in order."""
    return list(dict.fromkeys(test for patch in PATCHES for test in patch.tests))


def parse_pip_index(text: str) -> Optional[str]:
    """The newest version in `pip index versions NAME`'s answer ('NAME (X.Y.Z)' first)."""
    match = re.search(r"^\S+ \(([^)]+)\)", text, re.MULTILINE)
    return match.group(1) if match else None


def _newer(a: str, b: str) -> bool:
    try:
        return Version(a) > Version(b)
    except InvalidVersion:
        return a != b


def unverified_patches(library: str, version: str) -> list[str]:
    return [p.name for p in PATCHES if canonical(p.library) == canonical(library) and version not in p.verified]


def verdict(library: str, locked: Optional[str], have: Optional[str], newest: Optional[str],
            failed: list[str]) -> str:
    if have is None:
        return "not installed"
    notes = []
    base = have.split("+")[0]
    if locked is None:
        notes.append("not in the lock")
    elif base == locked:
        notes.append("as locked")
    elif failed:
        notes.append(f"NEWER, checks failed ({', '.join(failed)}): not verified")
    else:
        notes.append("NEWER, every check passed: verified")
    patches = unverified_patches(library, base)
    if patches and locked is not None and base != locked:
        notes.append(f"fence to extend: {', '.join(patches)}")
    if newest and _newer(newest, base):
        notes.append(f"registry's {newest} not tried (pyproject.toml's range, or the machine's cap)")
    return "; ".join(notes)


def rows(lock: dict[str, str], checks: dict[str, int], registry: dict[str, Optional[str]],
         have: Callable[[str], Optional[str]] = installed) -> list[Row]:
    failed = [name for name, code in checks.items() if code != 0]
    out = []
    for library in KEY_LIBRARIES:
        locked = lock.get(canonical(library))
        version = have(library)
        newest = registry.get(library)
        out.append(Row(library, locked or "-", version or "-", newest or "?",
                       verdict(library, locked, version, newest, failed)))
    return out


def render(table: list[Row], checks: dict[str, int]) -> str:
    lines = ["| library | locked | newest allowed (installed) | registry's newest | verdict |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.library} | {r.locked} | {r.installed} | {r.newest} | {r.verdict} |" for r in table]
    lines.append("")
    lines.append("checks: " + ", ".join(f"{name} {'passed' if code == 0 else f'FAILED (exit {code})'}"
                                        for name, code in checks.items()))
    return "\n".join(lines)


def query_registry(libraries: tuple[str, ...] = KEY_LIBRARIES) -> dict[str, Optional[str]]:
    found: dict[str, Optional[str]] = {}
    for library in libraries:
        done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", library],
                              capture_output=True, text=True, timeout=120)
        found[library] = parse_pip_index(done.stdout) if done.returncode == 0 else None
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/newest.py")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("patch-tests")
    registry = sub.add_parser("registry")
    registry.add_argument("out", type=Path)
    table = sub.add_parser("table")
    table.add_argument("--checks", type=Path, required=True, help="JSON {check name: exit code}")
    table.add_argument("--registry", type=Path, required=True, help="JSON {library: newest version or null}")
    table.add_argument("--lock", type=Path, default=LOCK_FILE)
    args = parser.parse_args(argv)
    if args.command == "patch-tests":
        print("\n".join(patch_tests()))
    elif args.command == "registry":
        args.out.write_text(json.dumps(query_registry(), indent=1))
    else:
        checks = json.loads(args.checks.read_text())
        print(render(rows(read_lock(args.lock), checks, json.loads(args.registry.read_text())), checks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
