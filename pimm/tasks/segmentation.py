"""Semantic segmentation: one class per point (PILArNet motif or pid labels, pimm's own files).

The loss of a batch is the mean over events of each event's weighted mean point loss, so every
event counts the same whatever its size and the gradient is the same at any world size and
accumulation (pimm.engine.trainer). Points labelled `ignore_index` (PILArNet's -1: no label)
count in neither the loss nor the metrics; `class_weights` weight each point's loss by its class
(0 leaves a class out of the loss, not out of the metrics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.config.validate import SEGMENTATION_METRICS, check_segmentation_options
from pimm.data.collate import offset_to_batch_index
from pimm.engine.metrics import SegmentationMeter
from pimm.tasks.base import Meter, Task, TaskOutput


def event_mean_loss(logits: torch.Tensor, target: torch.Tensor, offset: torch.Tensor,
                    class_weights: torch.Tensor | None = None, ignore_index: int = -1):
    """Per-event weighted mean cross-entropy and its mean over events -> (loss, event_losses).

    An event's loss is sum_i w_i ce_i / sum_i w_i over its points, w_i = class_weights[target_i]
    (1 without weights) and 0 for ignored points; an event with no weighted point contributes 0."""
    point_loss = F.cross_entropy(logits.float(), target, reduction="none", ignore_index=ignore_index)
    valid = target != ignore_index
    if class_weights is None:
        weight = valid.to(point_loss.dtype)
    else:  # ignored targets may lie outside 0..C-1: index with a clamped copy, then zero them
        weight = class_weights.to(point_loss.device)[target.clamp(0, len(class_weights) - 1)] * valid
    event_index = offset_to_batch_index(offset, len(point_loss))
    event_weight = point_loss.new_zeros(len(offset)).index_add_(0, event_index, weight)
    event_sum = point_loss.new_zeros(len(offset)).index_add_(0, event_index, point_loss * weight)
    event_losses = torch.where(event_weight > 0, event_sum / event_weight.clamp(min=1e-12), 0.0)
    return event_losses.mean(), event_losses


class SemanticSegmentation(Task):
    """Per-point classification of `num_classes` classes from the model's logits (N, C)."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None, class_weights=None,
                 ignore_index: int = -1, best_metric: str = "miou") -> None:
        check_segmentation_options(num_classes, class_weights, ignore_index, best_metric)
        self.num_classes = int(num_classes)
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        self.class_weights = None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32)
        self.ignore_index = int(ignore_index)
        self.best_metric = best_metric
        self.higher_is_better = SEGMENTATION_METRICS[best_metric]

    def forward_loss(self, module: nn.Module, batch: dict) -> TaskOutput:
        logits = module(batch["coord"], batch["feat"], batch["offset"], event_id=batch.get("event_id"))
        loss, event_losses = event_mean_loss(logits, batch["segment"], batch["offset"],
                                             self.class_weights, self.ignore_index)
        return TaskOutput(loss, event_losses, logits)

    def make_meter(self, device: torch.device) -> Meter:
        return SegmentationMeter(self.num_classes, device, self.ignore_index)

