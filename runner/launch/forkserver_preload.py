"""Imported first, and only, by the forkserver that starts workers (runner/launch/start_method.py).

The forkserver shares the launcher's process group, so a signal sent to the group (Slurm's
SIGTERM at a requeue or preemption, `kill -TERM -<pgid>`) reaches it too, and by default
kills it. Its children's exit codes then read as 255 to torch elastic (the server reports
them), which shuts the workers down before they can checkpoint: a requeued Slurm job came
back with no checkpoint. So the server ignores the signals a worker answers (SIGINT it
ignores already); `start_method.adopt` restores the default in each worker, whose own
handlers (runner/train/signals.py) take over when training starts. The server still ends
when the launcher does (its alive pipe closes).
"""

import signal

from runner.launch.start_method import SERVER_IGNORES

for _signum in SERVER_IGNORES:
    signal.signal(_signum, signal.SIG_IGN)
