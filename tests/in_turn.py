"""Several runs on one launch of workers, one after another, as `runner certify` runs its
cells (runner.launch.launcher.launch_in_turn): the workers import torch, transformers and
DeepSpeed once for all of a test's cases. The runs must share their launch settings.

    python tests/in_turn.py RUNS.json   # [{"run_dir": ..., "overrides": [...]}, ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main(runs_file: str) -> None:
    from runner.certify.matrix import compose
    from runner.launch.launcher import launch_in_turn
    from runner.launch.start import claim

    runs = json.loads(Path(runs_file).read_text())
    specs, paths = [], []
    for run in runs:
        spec = compose(run["overrides"])
        path = claim(spec, Path(run["run_dir"]), overwrite=False)
        assert path is not None, run
        specs.append(spec)
        paths.append(path)
    launch_in_turn(specs[0], paths)


def run_in_turn(root: Path, runs: dict[str, list[str]], timeout: float) -> dict[str, Path]:
    """Run `runs` (name: overrides) in turn on one launch; their folders, by name."""
    root.mkdir(parents=True, exist_ok=True)
    folders = {name: root / name for name in runs}
    spec = root / "runs.json"
    spec.write_text(json.dumps([{"run_dir": str(folders[n]), "overrides": o} for n, o in runs.items()]))
    done = subprocess.run([sys.executable, __file__, str(spec)], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return folders


if __name__ == "__main__":
    main(sys.argv[1])
