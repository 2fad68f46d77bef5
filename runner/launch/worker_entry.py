"""A started worker's runs and how it fails, the same under every launch engine: torch
elastic's workers (runner/launch/launcher.py `_worker_entry`) and Ray Train's
(runner/launch/ray_engine.py `train_loop`)."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Optional, Sequence

from runner.config.errors import USAGE_EXIT_CODE, UserError
from runner.distributed.accelerator import reset_accelerate_state
from runner.launch import failure_notes
from runner.train import worker


def run_worker(spec_paths: Sequence[str], launched: Optional[float]) -> None:
    """A started worker's runs (torch elastic's or Ray Train's, runner/launch/ray_engine.py),
    and how it fails: a UserError as one line and exit 2, anything else noted for the
    launcher (runner/launch/failure_notes.py) and raised."""
    failure_notes.watch_fatal_signals()
    try:
        for spec_path in spec_paths:
            worker.main(spec_path, launched)
            # The next run in this process (runner certify) starts from nothing: a
            # finished run closed its process group; Accelerate and DeepSpeed keep theirs.
            reset_accelerate_state()
    except UserError as err:
        # A problem the user can fix, found on this rank (rank 0 or not): one line and
        # exit 2, as in the launcher, instead of @record's traceback.
        sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] {err.render()}\n")
        sys.stderr.flush()
        failure_notes.note(f"exit code {USAGE_EXIT_CODE}")
        raise SystemExit(USAGE_EXIT_CODE) from None
    except Exception as err:
        failure_notes.note(traceback.format_exception_only(err)[-1].strip(), traceback.format_exc())
        raise
