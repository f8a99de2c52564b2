"""Segmentation metrics aggregated exactly across ranks through an all-reduced confusion matrix."""

from __future__ import annotations

import torch

from pimm.distributed.env import all_reduce_sum


class SegmentationMeter:
    """Accumulates a confusion matrix and loss sums on one rank; `compute` sums them over ranks."""

    def __init__(self, num_classes: int, device: torch.device) -> None:
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        # float64 sums: exact enough that 1 rank and N ranks agree to the printed digits
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.events = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, logits: torch.Tensor, target: torch.Tensor, event_losses: torch.Tensor) -> None:
        pred = logits.argmax(dim=1)
        valid = target >= 0  # -1 (PILArNet's "ignore") is left out of the confusion matrix
        flat = target[valid] * self.num_classes + pred[valid]
        self.confusion += torch.bincount(flat, minlength=self.num_classes**2).view(self.num_classes, -1)
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
