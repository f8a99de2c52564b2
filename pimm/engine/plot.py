"""A PNG of training loss and validation mIoU, drawn from metrics.jsonl at the end of a run."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(metrics_path: Path, out_path: Path) -> Path | None:
    """Draw loss vs step and validation mIoU vs step; returns the PNG path (None without data)."""
    if not metrics_path.exists():
        return None
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_miou) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss (mean over events)")
    ax_loss.legend()
    ax_miou.plot([r["step"] for r in val], [r["miou"] for r in val], "o-")
    ax_miou.set_xlabel("optimizer step")
    ax_miou.set_ylabel("validation mIoU")
    ax_miou.set_ylim(0, 1)
    return save_png(fig, out_path)


def save_png(fig, out_path: Path) -> Path:
    """Write a matplotlib figure as a PNG in one rename (never half-written) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = out_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_path)
    return out_path
