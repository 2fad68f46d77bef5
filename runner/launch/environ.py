"""Environment variables a launch sets for its workers, taken back after it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable, Iterator


@contextmanager
def restored(keys: Iterable[str]) -> Iterator[None]:
    """What the block sets of `keys` in this process's environment is undone after it: each
    as it was, or unset. The launcher's process outlives a launch (a sweep's next job,
    runner certify's next leg, a test session), and a setting meant for one launch's
    workers must not reach the next."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
