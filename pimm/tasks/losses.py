"""Point-classification losses, each computed per event: one value per event, then a mean over events.

A loss term maps (logits (N, C), target (N,), event_index (N,), num_events) to `event_losses`
(num_events,). The task (pimm.tasks.segmentation) adds the terms of `task.loss` as
sum_k weight_k * event_losses_k and takes the mean over events, so every event counts the same
whatever its size, and no event's loss depends on which other events share its rank or
micro-batch: the gradient is the same at any world size and grad_accum_steps. Every term leaves
points labelled `ignore_index` out; how each uses `class_weights` is in its docstring. Option
names and types are checked before any process starts (pimm.config.validate.LOSS_OPTIONS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pimm.registry import Registry


def point_weights(target: torch.Tensor, class_weights: torch.Tensor | None, ignore_index: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Each point's loss weight (N,): class_weights[target] (1 without weights), 0 for ignored points."""
    valid = target != ignore_index
    if class_weights is None:
        return valid.to(dtype)
    # ignored targets may lie outside 0..C-1: index with a clamped copy, then zero them
    return class_weights.to(target.device)[target.clamp(0, len(class_weights) - 1)] * valid


def event_weighted_mean(point_loss: torch.Tensor, weight: torch.Tensor, event_index: torch.Tensor,
                        num_events: int) -> torch.Tensor:
    """sum_i w_i l_i / sum_i w_i over each event's points (num_events,); 0 for an event with no weight."""
    event_weight = point_loss.new_zeros(num_events).index_add_(0, event_index, weight)
    event_sum = point_loss.new_zeros(num_events).index_add_(0, event_index, point_loss * weight)
    return torch.where(event_weight > 0, event_sum / event_weight.clamp(min=1e-12), 0.0)


class CrossEntropy:
    """Weighted mean point cross-entropy per event. class_weights: each point's weight is its class's
    (0 leaves the class out); ignore_index: weight 0."""

    def __init__(self, class_weights: torch.Tensor | None = None, ignore_index: int = -1) -> None:
        self.class_weights, self.ignore_index = class_weights, ignore_index

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, event_index: torch.Tensor,
                 num_events: int) -> torch.Tensor:
        point_loss = F.cross_entropy(logits.float(), target, reduction="none", ignore_index=self.ignore_index)
        weight = point_weights(target, self.class_weights, self.ignore_index, point_loss.dtype)
        return event_weighted_mean(point_loss, weight, event_index, num_events)


class Focal:
    """Focal loss (Lin et al. 2017), (1 - p_t)^gamma * CE, as a weighted mean per event. class_weights
    are the alpha of the paper: each point's weight is its class's, normalised like CrossEntropy, so
    gamma=0 is CrossEntropy exactly; ignore_index: weight 0."""

    def __init__(self, gamma: float = 2.0, class_weights: torch.Tensor | None = None, ignore_index: int = -1) -> None:
        if not gamma >= 0:
            raise ValueError(f"gamma={gamma!r} must be >= 0")
        self.gamma, self.class_weights, self.ignore_index = float(gamma), class_weights, ignore_index

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, event_index: torch.Tensor,
                 num_events: int) -> torch.Tensor:
        ce = F.cross_entropy(logits.float(), target, reduction="none", ignore_index=self.ignore_index)
        point_loss = (1 - torch.exp(-ce)).pow(self.gamma) * ce  # exp(-ce) = p_t; pow(., 0) = 1 exactly
        weight = point_weights(target, self.class_weights, self.ignore_index, point_loss.dtype)
        return event_weighted_mean(point_loss, weight, event_index, num_events)


class Lovasz:
    """Lovász-softmax (Berman et al. 2018): per event, the mean over the classes present in its
    labelled points of the Lovász extension of that class's Jaccard loss on softmax probabilities.
    ignore_index: the point is left out; class_weights: the mean over present classes is weighted by
    them (a class of weight 0 is left out); an event with no labelled point of a weighted class: 0.

    Per event, not per batch: the Jaccard loss of a set of points is not a sum over points, so a
    Lovász loss over a whole batch would change with which events share a rank or micro-batch, and
    1 rank and 2 ranks (or accumulation) would follow different gradients."""

    def __init__(self, class_weights: torch.Tensor | None = None, ignore_index: int = -1) -> None:
        self.class_weights, self.ignore_index = class_weights, ignore_index

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, event_index: torch.Tensor,
                 num_events: int) -> torch.Tensor:
        num_classes = logits.shape[1]
        valid = target != self.ignore_index
        prob = torch.softmax(logits.float(), dim=1)[valid]  # (M, C)
        target, event_index = target[valid], event_index[valid]
        foreground = F.one_hot(target, num_classes)  # (M, C) int64
        # one group per (event, class); sort the errors descending within each group with two stable sorts
        # (by error, then by group), all groups at once
        group = (event_index[:, None] * num_classes + torch.arange(num_classes, device=target.device)).reshape(-1)
        errors = (foreground.to(prob.dtype) - prob).abs().reshape(-1)
        order = torch.sort(errors, descending=True, stable=True).indices
        order = order[torch.sort(group[order], stable=True).indices]
        errors, group, fg = errors[order], group[order], foreground.reshape(-1)[order]
        num_groups = num_events * num_classes
        size = torch.bincount(group, minlength=num_groups)
        fg_total = torch.bincount(group[fg > 0], minlength=num_groups)
        # integer running counts within each group: exact whatever the number of points
        position = torch.arange(len(group), device=group.device) - (torch.cumsum(size, 0) - size)[group]
        fg_seen = torch.cumsum(fg, 0) - (torch.cumsum(fg_total, 0) - fg_total)[group]
        gts = fg_total[group]
        jaccard = 1 - (gts - fg_seen).double() / (gts + position + 1 - fg_seen).double()
        previous = torch.where(position > 0, torch.roll(jaccard, 1), 0.0)
        grad = (jaccard - previous).to(errors.dtype)  # the Lovász gradient of Berman's lovasz_grad
        class_loss = errors.new_zeros(num_groups).index_add_(0, group, errors * grad).view(num_events, num_classes)
        present = (fg_total > 0).view(num_events, num_classes).to(class_loss.dtype)
        weight = present if self.class_weights is None else present * self.class_weights.to(present.device)
        total = weight.sum(1)
        return torch.where(total > 0, (class_loss * weight).sum(1) / total.clamp(min=1e-12), 0.0)


LOSSES = Registry("loss")
for _loss in (CrossEntropy, Lovasz, Focal):
    LOSSES.register(_loss)
