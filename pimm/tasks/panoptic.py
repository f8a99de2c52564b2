"""Panoptic segmentation: particles or interactions as instances, found by a query detector ("detector-v1m1", or
"detector-v1m2" with the published momentum regressor and optional IoU head; names.DETECTORS).

`task = dict(type="Panoptic", label="particle" | "interaction", ...)` with PILArNetDataset(instances=True):
- label="particle": an instance is a particle (the `particle` target); its class is the points' semantic
  label (data.label: pid as published, or motif), data.num_classes classes; stuff_classes (default: the
  last class, PILArNet's "none" pid / "low_energy" motif) are no instance.
- label="interaction": an instance is an interaction (the `interaction` target); classes are
  ("stuff", "interaction") with stuff_classes [0], as the published vtx recipe's (num_classes=2).

The loss is the published InstanceSegmentationLoss (pimm.tasks.panoptic_loss, weights from task.loss or the
pasted model.criteria, checked by pimm.config.validate.panoptic_loss_weights) plus, with the model's stuff
head, a binary cross-entropy of each point's stuff logit (detector_v1m1.py:_compute_stuff_loss, weight 1).
Every term is per event and the batch's loss is the mean over its events, so the gradient is the same at any
world size and accumulation. Matching points (only drawn for events above match_points points) come from a
generator keyed by the event id. Validation and `pimm test` post-process each event (the model's thresholds)
and score it with pimm.panoptic_metrics; every event is counted once across ranks (the accumulators are
gathered). The momentum loss and metrics compare in the batch's `momentum` space: log10 p (MeV) where the
split's transforms have MomentumTransform (the detector-v1m2 recipes), else p.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pimm.config.validate import panoptic_loss_weights
from pimm.distributed.env import all_gather_objects, all_reduce_sum
from pimm.json_io import metric_text
from pimm.names import PANOPTIC_LABELS
from pimm.panoptic_metrics import EVENT_METRICS, PanopticAccumulator
from pimm.tasks.base import Meter, Task, TaskOutput
from pimm.tasks.panoptic_loss import DetectorLossWeights, detector_event_losses, event_targets

# every name a validation result gives that can pick model_best.pth -> higher is better
BEST_METRICS = {**{name: True for name in EVENT_METRICS}, "pq_pooled": True, "detection_f1_pooled": True,
                "loss": False}
SUMMARY_METRICS = ("ari_all_labelled", "pq", "purity", "efficiency", "detection_f1")


class Panoptic(Task):
    """Instances of particles or interactions (module docstring)."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None, label: str = "particle",
                 stuff_classes: list[int] | None = None, best_metric: str = "ari_all_labelled",
                 iou_threshold: float = 0.5, loss=None, stuff_loss_weight: float = 1.0) -> None:
        if label not in PANOPTIC_LABELS:
            raise ValueError(f"task.label={label!r} is not allowed: use one of {', '.join(PANOPTIC_LABELS)}")
        if best_metric not in BEST_METRICS:
            raise ValueError(f"task.best_metric={best_metric!r} is not allowed: use one of {', '.join(BEST_METRICS)}")
        self.label = label
        self.num_classes = int(num_classes)  # pimm.config.validate.model_classes: 2 for interactions
        self.class_names = list(class_names) if class_names else [str(i) for i in range(self.num_classes)]
        default_stuff = [0] if label == "interaction" else [self.num_classes - 1]
        self.stuff_classes = tuple(int(c) for c in (default_stuff if stuff_classes is None else stuff_classes))
        bad = [c for c in self.stuff_classes if not 0 <= c < self.num_classes]
        if bad:
            raise ValueError(f"task.stuff_classes {bad} are outside 0..{self.num_classes - 1}")
        self.weights = DetectorLossWeights(**panoptic_loss_weights(loss))
        self.stuff_loss_weight = float(stuff_loss_weight)
        self.iou_threshold = float(iou_threshold)
        self.best_metric = best_metric
        self.higher_is_better = BEST_METRICS[best_metric]

    def truth(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(class per point, instance per point: dense per event, -1 for stuff) of a collated batch."""
        if self.label not in batch:
            raise KeyError(f"the batch has no '{self.label}' target: the Panoptic task reads PILArNetDataset("
                           "instances=True) (set data.<split>.instances=True)")
        instance = batch[self.label]
        point_class = (instance >= 0).long() if self.label == "interaction" else batch["segment"]
        if self.stuff_classes:
            stuff = torch.isin(point_class, torch.tensor(self.stuff_classes, device=point_class.device))
            instance = torch.where(stuff, torch.full_like(instance, -1), instance)
        return point_class, instance

    def forward_loss(self, module: nn.Module, batch: dict) -> TaskOutput:
        point_class, instance = self.truth(batch)
        output = module(batch["coord"], batch["feat"], batch["offset"], event_id=batch.get("event_id"),
                        segment=point_class)
        ends = batch["offset"].tolist()
        targets = []
        for lo, hi in zip([0, *ends[:-1]], ends):
            momentum = batch["momentum"][lo:hi] if "momentum" in batch else None
            vertex = batch["vertex"][lo:hi] if "vertex" in batch else None
            targets.append(event_targets(instance[lo:hi], point_class[lo:hi], momentum, vertex))
        event_ids = batch["event_id"].tolist() if "event_id" in batch else range(len(ends))
        generators = [torch.Generator().manual_seed(int(e)) for e in event_ids]
        event_losses, _ = detector_event_losses(output.decoder, targets, self.weights, generators)
        if output.stuff_logits is not None:
            stuff_target = torch.isin(point_class, torch.tensor(self.stuff_classes, device=point_class.device))
            per_point = F.binary_cross_entropy_with_logits(output.stuff_logits.float(), stuff_target.float(),
                                                           reduction="none")
            stuff = torch.stack([per_point[lo:hi].mean() for lo, hi in zip([0, *ends[:-1]], ends)])
            event_losses = event_losses + self.stuff_loss_weight * stuff
        return TaskOutput(event_losses.mean(), event_losses, output)

    def make_meter(self, device: torch.device) -> Meter:
        return PanopticMeter(self, device)

    def must_be_finite(self, result: dict) -> dict:
        """Only the loss and best_metric: a metric of no instance (purity with nothing predicted) is NaN by
        definition, recorded as null."""
        return {k: result[k] for k in ("loss", self.best_metric) if k in result}

    def summary(self, result: dict) -> str:
        # a metric undefined over these events (purity with no predicted instance) is NaN: printed as pimm test does;
        # each mean over events with its standard error where there is one (two events or more)
        values = " ".join(f"{name} {metric_text(result.get(name), result.get(f'{name}_sem'))}"
                          for name in SUMMARY_METRICS)
        return f"loss {result['loss']:.4f} {values} ({int(result['events'])} events)"


def event_arrays(task: Panoptic, batch: dict, output) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Per event of a batch evaluated in eval mode: (event id, the arrays of panoptic_metrics.evaluate_event)."""
    point_class, instance = task.truth(batch)
    ends = batch["offset"].tolist()
    out = []
    for b, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends)):
        found = output.instances[b]
        arrays = {"true_instance": instance[lo:hi].cpu().numpy(), "pred_instance": found.instance.cpu().numpy(),
                  "true_class": point_class[lo:hi].cpu().numpy(), "pred_class": found.point_class.cpu().numpy()}
        final = output.events[b].final
        for side, width in (("momentum", 1), ("vertex", 3)):
            predicted = getattr(final, side)
            if side in batch and predicted is not None:
                per_query = predicted.float().reshape(len(predicted), width)
                per_point = torch.zeros(hi - lo, width, device=per_query.device)
                assigned = found.instance >= 0
                per_point[assigned] = per_query[found.query[found.instance[assigned]]]
                arrays[f"true_{side}"] = batch[side][lo:hi].float().reshape(hi - lo, width).squeeze(1).cpu().numpy()
                arrays[f"pred_{side}"] = per_point.squeeze(1).cpu().numpy()
        out.append((int(batch["event_id"][b]), arrays))
    return out


class PanopticMeter(Meter):
    """Per-event panoptic metrics of this rank's events; `compute` gathers every rank's events (each
    counted once by its id) and reduces the loss sum."""

    def __init__(self, task: Panoptic, device: torch.device) -> None:
        self.task = task
        self.accumulator = PanopticAccumulator(task.num_classes, task.stuff_classes, task.iou_threshold,
                                               task.class_names)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.events = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, output: TaskOutput, batch: dict) -> None:
        for event_id, arrays in event_arrays(self.task, batch, output.prediction):
            self.accumulator.update(event_id, **arrays)
        self.loss_sum += output.event_losses.detach().double().sum()
        self.events += output.event_losses.numel()

    def compute(self) -> dict:
        """Gather (a collective: every rank calls it); afterwards every rank's accumulator holds all events."""
        self.accumulator.merge(all_gather_objects(self.accumulator.state()))
        counts = torch.stack([self.loss_sum, self.events.double()])
        all_reduce_sum(counts)
        result = self.accumulator.result()
        result["loss"] = float(counts[0]) / max(int(counts[1]), 1)
        result["confusion"] = self.accumulator.confusion_matrix().tolist()
        return result

    def per_event(self) -> dict[str, np.ndarray]:
        """event_id and every per-event metric of the events gathered by `compute`, one row per event."""
        return self.accumulator.per_event()
