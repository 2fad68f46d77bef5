"""Imported first, and only, by the forkserver that starts workers (runner/launch/start_method.py).

The forkserver shares the launcher's process group, so a signal sent to the group (Slurm's
SIGTERM at a requeue or preemption, `kill -TERM -<pgid>`) reaches it too, and by default
kills it. Its children's exit codes then read as 255 to torch elastic (the server reports
them), which shuts the workers down before they can checkpoint: a requeued Slurm job came
back with no checkpoint. So the server ignores the signals a worker answers (SIGINT it
ignores already); `start_method.adopt` restores the default in each worker, whose own
handlers (runner/train/signals.py) take over when training starts. The server still ends
when the launcher does (its alive pipe closes).

It ends without the interpreter's teardown: its exit handler, registered before the
server imports anything else, so run after the handlers of every library it imports
(atexit runs the last registered first), flushes the streams and calls os._exit.
Unloading what it imported for its workers (torch, transformers, datasets) costs about
2.6 CPU-s, and the launcher's caller waits on it (the server holds the launcher's stdout
and stderr). Only multiprocessing's own handler, registered before, is skipped: it
joins the Process objects this process started, and the server starts none (its
workers are bare forks, which leave through os._exit and never run the handler).
"""

import atexit
import os
import sys


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


atexit.register(_leave)  # first: before the import below brings torch and its handlers

import signal  # noqa: E402

from runner.launch.start_method import SERVER_IGNORES  # noqa: E402

for _signum in SERVER_IGNORES:
    signal.signal(_signum, signal.SIG_IGN)
