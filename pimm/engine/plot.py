"""PNGs: training loss and validation mIoU from metrics.jsonl, and a confusion matrix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pimm.files import atomic_path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib  # deferred: about a second to import; only the end of a run or evaluation draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above

    return plt


def plot_metrics(metrics_path: Path, out_path: Path, metric: str = "miou") -> Path | None:
    """Draw loss vs step and the validation `metric` (the task's best_metric) vs step; returns the PNG
    path (None without data)."""
    if not metrics_path.exists():
        return None
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if not train and not val:
        return None
    fig, (ax_loss, ax_metric) = pyplot().subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss (mean over events)")
    ax_loss.legend()
    ax_metric.plot([r["step"] for r in val], [r.get(metric) for r in val], "o-")  # None (not finite): a gap
    ax_metric.set_xlabel("optimizer step")
    ax_metric.set_ylabel("validation mIoU" if metric == "miou" else f"validation {metric}")
    if metric != "loss":
        ax_metric.set_ylim(0, 1)
    return save_png(fig, out_path)


def save_png(fig, out_path: Path) -> Path:
    """Write a matplotlib figure as a PNG in one rename (never half-written) and close it."""
    fig.tight_layout()
    with atomic_path(out_path, durable=False) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    pyplot().close(fig)
    return out_path


def plot_confusion(confusion, class_names: list[str], out_path: Path, title: str = "") -> Path:
    """The confusion matrix (rows truth, columns prediction) normalised per row (each truth class's
    points sum to 1), each cell annotated with its fraction and count; returns the PNG path."""
    counts = np.asarray(confusion, dtype=np.int64)
    rows = counts.sum(1, keepdims=True)
    fraction = np.divide(counts, rows, out=np.zeros(counts.shape), where=rows > 0)
    n = len(class_names)
    fig, ax = pyplot().subplots(figsize=(1.2 * n + 2.5, 1.1 * n + 1.8))
    image = ax.imshow(fraction, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, label="fraction of the truth class's points")
    ax.set_xticks(range(n), class_names, rotation=45, ha="right")
    ax.set_yticks(range(n), class_names)
    ax.set_xlabel("prediction")
    ax.set_ylabel("truth")
    if title:
        ax.set_title(title)
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{fraction[i, j]:.2f}\n{counts[i, j]}", ha="center", va="center", fontsize=8,
                    color="white" if fraction[i, j] > 0.5 else "black")
    return save_png(fig, out_path)
