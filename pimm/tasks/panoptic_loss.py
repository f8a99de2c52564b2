"""What the query detector learns from: Hungarian matching of queries to true instances, then mask, class
and optional momentum / vertex losses on the matched pairs, at the last decoder layer and every earlier one.

Published: DeepLearnPhysics/pimm pimm/models/panda_detector/matcher.py (costs) and
pimm/models/losses/instance.py (losses); the weights are configs/panda/panseg/
detector-v1m1-pt-v3m2-ft-pid-dec.py:89-104. Every loss is computed per event, then averaged over the
events where it is defined, so no event's loss depends on which events share its batch.
What pimm does differently: an instance's class is its points' most common class (published: its first
point's, the same for pure instances); an event without instances still teaches its queries
no-object (published skips it); the vertex loss is pimm's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from pimm.models.query_detector import PADDING_BIAS, EventPrediction, LayerPrediction


@dataclass(frozen=True)
class DetectorLossWeights:
    """Matching costs and loss weights; defaults are the published particle (pid) recipe's."""

    cost_class: float = 1.0  # pid-dec.py:93
    cost_mask: float = 1.0  # pid-dec.py:91, the focal cost
    cost_dice: float = 1.0  # pid-dec.py:92
    match_points: int = 100_000  # pid-dec.py:102 num_points: matching sees at most this many points
    focal: float = 2.0  # pid-dec.py:94 loss_weight_focal
    dice: float = 5.0  # pid-dec.py:95 loss_weight_dice
    class_matched: float = 2.0  # pid-dec.py:96 cls_weight_matched
    class_no_object: float = 0.5  # pid-dec.py:97 cls_weight_noobj, the no-object (eos) weight
    momentum: float = 1.0  # pid-dec.py:98 momentum_loss_weight
    vertex: float = 1.0  # pimm's: nothing published
    focal_alpha: float = 0.25  # pid-dec.py:99
    focal_gamma: float = 2.0  # pid-dec.py:100
    aux: float = 1.0  # pid-dec.py:101 aux_loss_weight, for every layer before the last


@dataclass
class EventTargets:
    """One event's truth: instance per point, and per instance its class (and momentum, vertex if known)."""

    instance: torch.Tensor  # (N,) long, 0..T-1, -1 for stuff / no instance
    instance_class: torch.Tensor  # (T,) long
    momentum: torch.Tensor | None = None  # (T,)
    vertex: torch.Tensor | None = None  # (T, 3)

    @property
    def masks(self) -> torch.Tensor:
        """(T, N) bool, one row per instance."""
        return self.instance.unsqueeze(0) == torch.arange(len(self.instance_class),
                                                          device=self.instance.device).unsqueeze(1)


def event_targets(instance: torch.Tensor, point_class: torch.Tensor, momentum: torch.Tensor | None = None,
                  vertex: torch.Tensor | None = None) -> EventTargets:
    """Per-point instance ids (any ints, negative = none), classes (N,), and optionally momentum (N,) and
    vertex (N, 3) -> EventTargets with dense ids in id order, each instance's most common class and its
    points' mean momentum and vertex."""
    labelled = instance >= 0
    ids, dense = torch.unique(instance[labelled], return_inverse=True)
    num_instances = len(ids)
    dense_instance = torch.full_like(instance, -1)
    dense_instance[labelled] = dense
    classes = point_class[labelled].long()
    num_classes = int(classes.max()) + 1 if len(classes) else 1
    votes = torch.bincount(dense * num_classes + classes.clamp(min=0), weights=(classes >= 0).float(),
                           minlength=num_instances * num_classes)
    instance_class = votes.reshape(num_instances, num_classes).argmax(1)
    points_per_instance = torch.bincount(dense, minlength=num_instances).unsqueeze(1)

    def instance_mean(values: torch.Tensor, width: int) -> torch.Tensor:
        values = values.reshape(len(instance), width)[labelled].float()
        return values.new_zeros(num_instances, width).index_add_(0, dense, values) / points_per_instance

    return EventTargets(dense_instance, instance_class,
                        instance_mean(momentum, 1).squeeze(1) if momentum is not None else None,
                        instance_mean(vertex, 3) if vertex is not None else None)


def _focal_terms(logits: torch.Tensor, alpha: float, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid focal loss of every logit against target 1 and against target 0."""
    prob = logits.sigmoid()
    positive = alpha * (1 - prob) ** gamma * F.binary_cross_entropy_with_logits(
        logits, torch.ones_like(logits), reduction="none")
    negative = (1 - alpha) * prob**gamma * F.binary_cross_entropy_with_logits(
        logits, torch.zeros_like(logits), reduction="none")
    return positive, negative


@torch.no_grad()
def hungarian_match(class_logits: torch.Tensor, mask_logits: torch.Tensor, target_classes: torch.Tensor,
                    target_masks: torch.Tensor, weights: DetectorLossWeights = DetectorLossWeights(),
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """class_logits (Q, K+1), mask_logits (Q, N), target_classes (T,), target_masks (T, N) bool over the
    points to match on -> (query indices, target indices), min(Q, T) pairs, target indices ascending.

    Cost = cost_class * -log p(target class) (softmax without no-object, as matcher.py:223-224)
    + cost_mask * mean sigmoid focal loss + cost_dice * dice loss, on match_points points drawn with
    replacement (matcher.py:174-175) from `generator` (a CPU torch.Generator) when N is larger.
    """
    num_points = mask_logits.shape[1]
    if len(target_classes) == 0 or num_points == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    if weights.match_points and num_points > weights.match_points:
        sample = torch.randint(num_points, (weights.match_points,), generator=generator).to(mask_logits.device)
        mask_logits, target_masks = mask_logits[:, sample], target_masks[:, sample]
    logits = mask_logits.float()
    target = target_masks.float()
    positive, negative = _focal_terms(logits, weights.focal_alpha, weights.focal_gamma)
    cost_focal = (positive @ target.T + negative @ (1 - target).T) / logits.shape[1]
    prob = logits.sigmoid()
    cost_dice = 1 - (2 * prob @ target.T + 1) / (prob.sum(1, keepdim=True) + target.sum(1) + 1)
    class_prob = class_logits[:, :-1].float().softmax(-1)
    cost_class = -torch.log(class_prob[:, target_classes] + 1e-8)
    cost = weights.cost_mask * cost_focal + weights.cost_dice * cost_dice + weights.cost_class * cost_class
    rows, cols = linear_sum_assignment(cost.cpu().numpy())
    order = cols.argsort()
    return torch.as_tensor(rows[order], dtype=torch.long), torch.as_tensor(cols[order], dtype=torch.long)


def _layer_terms(layer: LayerPrediction, target: EventTargets, weights: DetectorLossWeights,
                 generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """One layer's unweighted loss terms for one event; a term without pairs (or targets) is left out."""
    # points of a true instance that the decoder read: a point the stuff head left out has the padding logit
    # (published: it enters the mask terms anyway, a constant of ~2,500 per point in the focal loss that moves
    # no gradient but buries the loss curve)
    labelled = (target.instance >= 0) & (layer.mask_logits[0] > PADDING_BIAS / 2)
    masks = target.masks[:, labelled]
    mask_logits = layer.mask_logits[:, labelled]
    query, matched = hungarian_match(layer.class_logits, mask_logits, target.instance_class, masks, weights,
                                     generator)
    query, matched = query.to(mask_logits.device), matched.to(mask_logits.device)
    terms = {}
    no_object = torch.ones(len(layer.class_logits), dtype=torch.bool, device=query.device)
    no_object[query] = False
    class_terms = []
    if len(query):
        logits = mask_logits[query].float()
        truth = masks[matched].float()
        positive, negative = _focal_terms(logits, weights.focal_alpha, weights.focal_gamma)
        terms["focal"] = (truth * positive + (1 - truth) * negative).mean(1).mean()
        prob = logits.sigmoid()
        terms["dice"] = (1 - (2 * (prob * truth).sum(1) + 1) / (prob.sum(1) + truth.sum(1) + 1)).mean()
        terms["class_matched"] = F.cross_entropy(layer.class_logits[query].float(), target.instance_class[matched])
        class_terms.append(weights.class_matched * terms["class_matched"])
        if layer.momentum is not None and target.momentum is not None:
            terms["momentum"] = F.smooth_l1_loss(layer.momentum[query].float(), target.momentum[matched].float())
        if layer.vertex is not None and target.vertex is not None:
            terms["vertex"] = F.smooth_l1_loss(layer.vertex[query].float(), target.vertex[matched].float())
    if no_object.any():
        empty = torch.full((int(no_object.sum()),), layer.class_logits.shape[1] - 1, device=query.device)
        terms["class_no_object"] = F.cross_entropy(layer.class_logits[no_object].float(), empty)
        class_terms.append(weights.class_no_object * terms["class_no_object"])
    # instance.py:288-304, 543: the weighted matched and no-object terms are averaged
    terms["class"] = torch.stack(class_terms).mean()
    return terms


def _weighted(terms: dict[str, torch.Tensor], weights: DetectorLossWeights) -> torch.Tensor:
    """One layer's loss of one event: focal * focal + dice * dice + class + momentum * momentum + vertex * vertex,
    a term the event does not define counting 0."""
    total = terms["class"]
    for name in ("focal", "dice", "momentum", "vertex"):
        if name in terms:
            total = total + getattr(weights, name) * terms[name]
    return total


def detector_event_losses(outputs: list[EventPrediction], targets: list[EventTargets],
                          weights: DetectorLossWeights = DetectorLossWeights(),
                          generators: list[torch.Generator | None] | None = None
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each event's detector loss -> (event_losses (B,), named terms averaged over the events defining them).

    An event's loss is loss(last layer) + weights.aux * sum of loss(layer l) over earlier layers, each layer
    matched on its own (instance.py:88-110). Terms: the last layer's by name ("focal", "dice", "class",
    "class_matched", "class_no_object", and "momentum", "vertex" where predicted and known), "aux{l}_{name}"
    for layer l. `generators[b]` draws event b's matching points (only when it has more than match_points).
    """
    if len(outputs) != len(targets) or not outputs:
        raise ValueError(f"detector_loss got {len(outputs)} predicted and {len(targets)} target events; "
                         "pass one EventTargets per event of the batch")
    generators = generators or [None] * len(outputs)
    event_losses, per_event = [], []
    for b, (prediction, target) in enumerate(zip(outputs, targets)):
        if prediction.final.mask_logits.shape[1] != len(target.instance):
            raise ValueError(f"event {b}: {prediction.final.mask_logits.shape[1]} predicted points but "
                             f"{len(target.instance)} target points; targets must follow the model's points")
        final = _layer_terms(prediction.final, target, weights, generators[b])
        loss, terms = _weighted(final, weights), dict(final)
        for layer_index, layer in enumerate(prediction.aux):
            aux = _layer_terms(layer, target, weights, generators[b])
            loss = loss + weights.aux * _weighted(aux, weights)
            terms.update({f"aux{layer_index}_{name}": value for name, value in aux.items()})
        event_losses.append(loss)
        per_event.append(terms)
    names = dict.fromkeys(name for terms in per_event for name in terms)
    means = {name: torch.stack([t[name].detach() for t in per_event if name in t]).mean() for name in names}
    return torch.stack(event_losses), means


def detector_loss(outputs: list[EventPrediction], targets: list[EventTargets],
                  weights: DetectorLossWeights = DetectorLossWeights(),
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One batch's detector loss, the mean of `detector_event_losses` over its events -> (total, named terms)."""
    event_losses, terms = detector_event_losses(outputs, targets, weights, [generator] * len(outputs))
    return event_losses.mean(), terms
