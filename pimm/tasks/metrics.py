"""Segmentation metrics: aggregated exactly across ranks through an all-reduced confusion matrix
during evaluation (`SegmentationMeter`), or recomputed from a prediction file afterwards
(`metrics_from_predictions`); both through `metrics_from_confusion`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pimm.data.predictions import IGNORE_LABEL, open_predictions
from pimm.distributed.env import all_reduce_sum
from pimm.errors import DataError


class SegmentationMeter:
    """Accumulates a confusion matrix and loss sums on one rank; `compute` sums them over ranks.
    Points labelled `ignore_index` are left out; `update` never syncs the device with the host."""

    def __init__(self, num_classes: int, device: torch.device, ignore_index: int = -1) -> None:
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        # flattened (target, prediction) counts plus one last slot that collects the ignored points
        self._counts = torch.zeros(num_classes**2 + 1, dtype=torch.int64, device=device)
        # float64 sums: exact enough that 1 rank and N ranks agree to the printed digits
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.events = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def confusion(self) -> torch.Tensor:
        """(C, C) counts of this rank: rows are targets, columns predictions."""
        return self._counts[:-1].view(self.num_classes, self.num_classes)

    def update(self, output, batch: dict) -> None:
        """Add one forward (a pimm.tasks TaskOutput with the logits as its prediction) of `batch`."""
        self.add(output.prediction, batch["segment"], output.event_losses)

    def add(self, logits: torch.Tensor, target: torch.Tensor, event_losses: torch.Tensor) -> None:
        pred = logits.argmax(dim=1)
        # a boolean-mask selection would sync (its size is data-dependent): route ignored points to the spare slot
        cell = torch.where(target == self.ignore_index, self.num_classes**2, target * self.num_classes + pred)
        self._counts.index_add_(0, cell, torch.ones_like(cell))
        self.loss_sum += event_losses.double().sum()
        self.events += event_losses.numel()

    def compute(self) -> dict:
        """All-reduce (a collective: every rank calls it) and return `metrics_from_confusion`'s metrics."""
        # counts reduced as int64 (exact at any size), the loss as a float64 sum
        counts = torch.cat([self.confusion.flatten(), self.events.view(1)])
        all_reduce_sum(counts)
        loss_sum = all_reduce_sum(self.loss_sum.clone())
        confusion = counts[:-1].view(self.num_classes, -1).cpu()
        return metrics_from_confusion(confusion, float(loss_sum), int(counts[-1]))


def metrics_from_confusion(confusion: torch.Tensor, loss_sum: float, events: int) -> dict:
    """Every segmentation metric from a (C, C) confusion matrix (rows truth, columns prediction).

    loss (mean over events), miou and iou (IoU_c = TP / (TP + FP + FN); classes absent from both
    truth and prediction are left out of mIoU), macc (mean per-class recall over the classes with
    truth points), accuracy and allacc (the same number: correct points / labelled points), per
    class recall (= class_accuracy), precision, f1 and class_points (truth points), the confusion
    as nested int lists, events and points. An undefined per-class value is NaN (null in JSON)."""
    counts = confusion.to(torch.float64)
    tp = counts.diag()
    truth, predicted = counts.sum(1), counts.sum(0)
    union = truth + predicted - tp
    nan = torch.full_like(tp, float("nan"))

    def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return torch.where(den > 0, num / den.clamp(min=1), nan)

    iou, recall, precision = ratio(tp, union), ratio(tp, truth), ratio(tp, predicted)
    # F1 = 2TP / (2TP + FP + FN): defined whenever the class has truth or predicted points
    f1 = ratio(2 * tp, truth + predicted)
    present, labelled = union > 0, truth > 0
    accuracy = float(tp.sum() / counts.sum().clamp(min=1))
    return {
        "loss": loss_sum / max(events, 1),
        "miou": float(iou[present].mean()) if present.any() else float("nan"),
        "macc": float(recall[labelled].mean()) if labelled.any() else float("nan"),
        "accuracy": accuracy,
        "allacc": accuracy,
        "iou": [float(v) for v in iou],
        "class_accuracy": [float(v) for v in recall],
        "precision": [float(v) for v in precision],
        "recall": [float(v) for v in recall],
        "f1": [float(v) for v in f1],
        "class_points": [int(v) for v in truth],
        "confusion": confusion.to(torch.int64).tolist(),
        "events": events,
        "points": int(counts.sum()),
    }


def metrics_from_predictions(path: str | Path, ignore_index: int = IGNORE_LABEL) -> dict[str, Any]:
    """Segmentation metrics recomputed from a labelled prediction file (`pimm.data.predictions`),
    reading it in chunks: `metrics_from_confusion`'s metrics without the loss (prediction files
    hold none), the confusion (C x C, rows truth, columns prediction) as nested lists. Points
    labelled `ignore_index` are left out; DataError for another truth label outside 0..C-1."""
    with open_predictions(path) as preds:
        c = preds.num_classes
        confusion = np.zeros(c * c, np.int64)
        for truth, pred in preds.labelled_points():
            keep = truth != ignore_index
            truth, pred = truth[keep], pred[keep]
            bad = (truth < 0) | (truth >= c)
            if bad.any():
                raise DataError(f"{preds.path}: truth label {int(truth[bad][0])} is outside 0..{c - 1} and is not "
                                f"ignore_index={ignore_index}")
            confusion += np.bincount(truth * c + pred, minlength=c * c)
        events = preds.num_events
    metrics = metrics_from_confusion(torch.from_numpy(confusion.reshape(c, c)).double(), 0.0, events)
    del metrics["loss"]
    return metrics
