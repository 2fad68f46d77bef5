"""One rank-aware logger: rank 0 speaks (console and run.log); other ranks only warn."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

LOG_FILENAME = "run.log"


def setup_logging(run_dir: Optional[Path], is_main: bool, rank: int = 0) -> logging.Logger:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    level = logging.INFO if is_main else logging.WARNING
    root.setLevel(level)
    console = logging.StreamHandler(sys.stderr)
    prefix = "" if is_main else f"[rank {rank}] "
    console.setFormatter(logging.Formatter(prefix + "%(message)s"))
    root.addHandler(console)
    if is_main and run_dir is not None:
        file_handler = logging.FileHandler(run_dir / LOG_FILENAME, mode="a", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(file_handler)
    # Libraries are chatty at INFO; keep their warnings.
    for name in ("datasets", "transformers", "accelerate", "torch", "DeepSpeed", "deepspeed", "filelock", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return logging.getLogger("runner")
