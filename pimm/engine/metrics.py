"""Segmentation metrics aggregated exactly across ranks through an all-reduced confusion matrix."""

from __future__ import annotations

import torch

from pimm.distributed.env import all_reduce_sum


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
        """All-reduce and return loss (mean over events), per-class IoU, mIoU, accuracy."""
        packed = torch.cat([self.confusion.flatten().double(), self.loss_sum.view(1), self.events.double().view(1)])
        all_reduce_sum(packed)
        confusion = packed[: self.num_classes**2].view(self.num_classes, -1)
        return metrics_from_confusion(confusion, float(packed[-2]), int(packed[-1]))


def metrics_from_confusion(confusion: torch.Tensor, loss_sum: float, events: int) -> dict:
    """IoU_c = TP / (TP + FP + FN); classes absent from both target and prediction are left out of mIoU."""
    tp = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - tp
    present = union > 0
    iou = torch.where(present, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))
    return {
        "loss": loss_sum / max(events, 1),
        "miou": float(iou[present].mean()) if present.any() else float("nan"),
        "iou": [float(v) for v in iou],
        "accuracy": float(tp.sum() / confusion.sum().clamp(min=1)),
        "events": events,
        "points": int(confusion.sum()),
    }
