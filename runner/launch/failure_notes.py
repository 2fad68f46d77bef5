"""Which rank failed first, as the ranks tell it themselves.

torch elastic records one failure: the first worker exit its monitor sees. When a rank
raises, its peers' collectives break and they raise too, often exiting first (and a
forkserver reports exits in rank order when several are ready); the run then named a
peer's "Connection closed by peer ... GLHF" instead of the rank's own error. So each rank
that raises notes the time, its one-line reason and its traceback in a folder the
launcher made for the launch (RUNNER_FAILURE_NOTES), and the launch reports the earliest.
A rank killed by a fatal signal (an abort, as NCCL's watchdog ends a stuck collective; a
segfault) cannot raise: faulthandler writes its Python stack to the same folder, and that
rank is the cause (its peers raise only on its absence), whenever its peers noted theirs.
A rank that dies of SIGKILL or os._exit leaves nothing; then elastic's record is all there is.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from runner.launch.environ import restored

NOTES_ENV = "RUNNER_FAILURE_NOTES"


@dataclass(frozen=True)
class FailureNote:
    rank: int
    time: float
    reason: str  # one line
    callstack: str  # the traceback; '' for a UserError, whose line the rank printed
    signal: Optional[signal.Signals] = None  # the fatal signal that ended the rank, if one did

# faulthandler's first line for each fatal signal it handles
_FATAL_HEADERS = {
    "Aborted": signal.SIGABRT, "Segmentation fault": signal.SIGSEGV, "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE, "Illegal instruction": signal.SIGILL,
}
_fatal_file = None  # kept open for faulthandler for the worker's life


def note(reason: str, callstack: str = "") -> None:
    """In a worker that is failing: note why, for the launcher (best effort: the failure
    itself goes on either way)."""
    folder, rank = os.environ.get(NOTES_ENV), os.environ.get("RANK", "")
    if not folder or not rank.isdigit():
        return
    record = {"rank": int(rank), "time": time.time(), "reason": reason, "callstack": callstack}
    try:
        (Path(folder) / f"rank_{rank}.json").write_text(json.dumps(record))
    except OSError:
        pass


def watch_fatal_signals() -> None:
    """In a worker: on a fatal signal, faulthandler writes the Python stack where the
    launcher looks (the rank cannot raise, so note() never runs)."""
    global _fatal_file
    folder, rank = os.environ.get(NOTES_ENV), os.environ.get("RANK", "")
    if not folder or not rank.isdigit():
        return
    try:
        _fatal_file = open(Path(folder) / f"rank_{rank}.fatal", "w")
    except OSError:
        return
    faulthandler.enable(file=_fatal_file, all_threads=False)


@contextmanager
def collecting() -> Iterator[Path]:
    """A folder for this launch's notes, named in the environment workers start with
    (set it before a forked worker's environment is taken); removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="runner-failures-"))
    with restored([NOTES_ENV]):
        os.environ[NOTES_ENV] = str(folder)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def read(folder: Path) -> list[FailureNote]:
    notes = []
    for path in sorted(folder.glob("rank_*.json")):
        try:
            notes.append(FailureNote(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):  # a note cut short by the rank's death
            continue
    for path in sorted(folder.glob("rank_*.fatal")):
        try:
            stack, when = path.read_text(errors="replace"), path.stat().st_mtime
        except OSError:
            continue
        header = stack.partition("\n")[0].removeprefix("Fatal Python error: ").strip()
        if header in _FATAL_HEADERS:
            sig = _FATAL_HEADERS[header]
            rank = int(path.stem.removeprefix("rank_"))
            notes.append(FailureNote(rank, when, f"Signal {int(sig)} ({sig.name}) received", stack, sig))
    return notes


def first(notes: Sequence[FailureNote]) -> Optional[FailureNote]:
    """The rank that failed first (the cause; the others failed on its absence). A rank a
    fatal signal ended comes before any that raised: its peers raise on its absence, and
    under load may note that before faulthandler's file is closed."""
    return min(notes, key=lambda n: (n.signal is None, n.time, n.rank), default=None)
