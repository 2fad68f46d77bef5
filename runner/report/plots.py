"""Loss curves (and online RL's reward) from metrics.jsonl, as a PNG people look at instead of reading logs."""

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

    panels = curves(read_metrics(metrics_path))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), dpi=110, squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels.items()):
        for label, points in series.items():
            if points:
                ax.plot(*zip(*points), "o-" if label.startswith("eval") else "-", label=label, linewidth=1.4,
                        markersize=4)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_title(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def curves(rows: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The plot's panels, each its y label and its lines of (step, value): the losses, and
    for online RL the mean reward, trained and evaluated (the curve its users watch)."""
    def series(name: str) -> list[tuple[int, float]]:
        return [(r["step"], r[name]) for r in rows if r.get(name) is not None]

    panels = {"loss": {"train loss": series("loss"), "eval loss": series("eval_loss")}}
    if any("reward" in r for r in rows):
        panels["mean reward"] = {"train reward": series("reward"), "eval reward": series("eval_reward")}
    else:
        panels = {"cross-entropy loss (nats/token)": panels["loss"]}
    return panels
