"""Loss curves from metrics.jsonl, as a PNG people look at instead of reading logs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

PLOT_FILENAME = "loss_curves.png"


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curves(metrics_path: Path, out_path: Path, title: str = "") -> Optional[Path]:
    """The PNG; None, said once, where matplotlib is missing (a dependency of runner, but a
    machine running runner from a checkout, as scripts/gpu-check.sh does, may lack it)."""
    try:
        import matplotlib
    except ImportError:
        logging.getLogger("runner").warning(f"{out_path.name} not written: matplotlib is not installed (pip install matplotlib)")
        return None

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.4)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", linewidth=1.4, markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
