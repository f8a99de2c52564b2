"""Semantic segmentation: one class per point (PILArNet motif or pid labels, pimm's own files).

The loss is `task.loss`, a list of terms dict(type=..., weight=..., options) from pimm.tasks.losses
(CrossEntropy, Lovasz, Focal; default: CrossEntropy alone). Each term gives one loss per event; an
event's loss is sum_k weight_k * term_k, and the loss of a batch is the mean over its events, so
every event counts the same whatever its size and the gradient is the same at any world size and
accumulation (pimm.engine.trainer). Points labelled `ignore_index` (PILArNet's -1: no label)
count in neither the loss nor the metrics; `class_weights` weight each point's loss by its class
(0 leaves a class out of the loss, not out of the metrics).
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.config.validate import DEFAULT_LOSS, SEGMENTATION_METRICS, check_segmentation_options
from pimm.data.collate import offset_to_batch_index
from pimm.tasks.base import Meter, Task, TaskOutput
from pimm.tasks.losses import LOSSES, CrossEntropy
from pimm.tasks.metrics import SegmentationMeter


def event_mean_loss(logits: torch.Tensor, target: torch.Tensor, offset: torch.Tensor,
                    class_weights: torch.Tensor | None = None, ignore_index: int = -1):
    """Per-event weighted mean cross-entropy and its mean over events -> (loss, event_losses).

    An event's loss is sum_i w_i ce_i / sum_i w_i over its points, w_i = class_weights[target_i]
    (1 without weights) and 0 for ignored points; an event with no weighted point contributes 0."""
    event_losses = CrossEntropy(class_weights, ignore_index)(
        logits, target, offset_to_batch_index(offset, len(target)), len(offset))
    return event_losses.mean(), event_losses


class SemanticSegmentation(Task):
    """Per-point classification of `num_classes` classes from the model's logits (N, C)."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None, class_weights=None,
                 ignore_index: int = -1, best_metric: str = "miou", loss: list[dict] | None = None) -> None:
        loss = DEFAULT_LOSS if loss is None else loss
        check_segmentation_options(num_classes, class_weights, ignore_index, best_metric, loss)
        self.num_classes = int(num_classes)
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        self.class_weights = None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32)
        self.ignore_index = int(ignore_index)
        # (weight, term) for every term of weight > 0
        self.loss_terms = [
            (float(term.get("weight", 1.0)),
             LOSSES.build({k: v for k, v in term.items() if k != "weight"},
                          class_weights=self.class_weights, ignore_index=self.ignore_index))
            for term in loss if term.get("weight", 1.0) > 0
        ]
        self.best_metric = best_metric
        self.higher_is_better = SEGMENTATION_METRICS[best_metric]

    def forward_loss(self, module: nn.Module, batch: dict) -> TaskOutput:
        logits = module(batch["coord"], batch["feat"], batch["offset"], event_id=batch.get("event_id"))
        target, offset = batch["segment"], batch["offset"]
        event_index = offset_to_batch_index(offset, len(target))
        event_losses = sum(weight * term(logits, target, event_index, len(offset)) for weight, term in self.loss_terms)
        return TaskOutput(event_losses.mean(), event_losses, logits)

    def make_meter(self, device: torch.device) -> Meter:
        return SegmentationMeter(self.num_classes, device, self.ignore_index)

    def summary(self, result: dict) -> str:
        per_class = " ".join(f"{n}={v:.3f}" for n, v in zip(self.class_names, result["iou"]))
        return (f"loss {result['loss']:.4f} mIoU {result['miou']:.4f} acc {result['accuracy']:.4f} "
                f"({result['events']} events) | {per_class}")

