"""A sweep job's outcome, in its folder: job_status.json (ok, failed or stopped, why, how long)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

JOB_STATUS = "job_status.json"


def write_job_status(job_dir: Path, status: str, wall_s: float, overrides: list[str], reason: Optional[str] = None,
                     objective: Optional[str] = None) -> None:
    """`objective`: the job's train.objective as composed, when known: a job refused before
    its run_spec.yaml was written still says which figures its summary row has."""
    job_dir.mkdir(parents=True, exist_ok=True)
    record = {"status": status, "wall_s": round(wall_s, 2), "overrides": overrides, "reason": reason}
    if objective is not None:
        record["objective"] = objective
    (job_dir / JOB_STATUS).write_text(json.dumps(record, indent=2) + "\n")


def job_status(job_dir: Path) -> Optional[str]:
    """The status a job recorded; None when it recorded none (or the file was torn)."""
    path = job_dir / JOB_STATUS
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text()).get("status"))
    except ValueError:  # torn by a kill mid-write: the job did not finish
        return None


def job_reason(job_dir: Path) -> Optional[str]:
    """Why the job ended as it did, as it recorded (None: nothing recorded)."""
    try:
        return json.loads((job_dir / JOB_STATUS).read_text()).get("reason")
    except (OSError, ValueError):
        return None
