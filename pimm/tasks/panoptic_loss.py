"""What the query detector learns from: Hungarian matching of queries to true instances, then mask, class
and optional momentum / vertex losses on the matched pairs, at the last decoder layer and every earlier one.

Published: DeepLearnPhysics/pimm pimm/models/panda_detector/matcher.py (costs) and
pimm/models/losses/instance.py (losses); the weights are configs/panda/panseg/
detector-v1m1-pt-v3m2-ft-pid-dec.py:89-104. Every loss is computed per event, then averaged over the
events where it is defined, so no event's loss depends on which events share its batch. All events of a
batch are computed at once (padded to one length): the matching costs of every (query, instance) pair without
gradients, then the loss terms of the matched pairs only; only the assignment itself (scipy's
linear_sum_assignment) runs per event.
What pimm does differently: an instance's class is its points' most common class (published: its first
point's, the same for pure instances); an event without instances still teaches its queries
no-object (published skips it); the vertex loss is pimm's. The IoU term (detector-v1m2 with predict_iou,
instance.py:377-419) is, as published, the mean squared error of each matched query's predicted IoU against the IoU
of its mask (sigmoid > 0.5) with its instance's labelled points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pimm.models.query_detector import PADDING_BIAS, BatchLayerPrediction, DecoderOutput


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
    iou: float = 0.0  # instance.py:48 iou_loss_weight (detector-v1m2-pt-v3m2-ft-pid-dec.py:100 sets 1.0)
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


@torch.no_grad()
def _focal_parts(logits: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per logit x with p = sigmoid(x): (p, -log p, (1 - p)^gamma * -log p, p^gamma * -log(1 - p)), the last two the
    sigmoid focal loss against target 1 and against target 0 without alpha; -log(1 - p) = -log p + x.

    -log p is softplus(-x) = max(-x, 0) - log max(p, 1 - p), computed so: the log of a number in [0.5, 1] is about
    half the time of torch's softplus on CPU, and nothing underflows at the padding logits (exp is slow there).
    """
    prob = logits.sigmoid()
    complement = 1 - prob
    neg_log_prob = logits.clamp(max=0).neg_().sub_(torch.maximum(prob, complement).log_())
    positive = complement.pow_(gamma).mul_(neg_log_prob)
    negative = prob.pow(gamma).mul_(neg_log_prob + logits)
    return prob, neg_log_prob, positive, negative


class MatchedMaskLosses(torch.autograd.Function):
    """Each matched pair's mask terms over its kept points, with their gradient written out: (logits (M, P),
    truth (M, P) 0/1 and 0 where not kept, keep (M, P) 0/1, alpha, gamma) -> (mean sigmoid focal loss (M,),
    dice loss (M,)). The same formulas through autograd keep about a dozen (M, P) tensors and take twice the
    passes over them (tests/test_query_detector.py checks the gradient against autograd's)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, truth: torch.Tensor, keep: torch.Tensor, alpha: float,
                gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
        prob, neg_log_prob, positive, negative = _focal_parts(logits, gamma)
        count = keep.sum(1).clamp(min=1)
        positive, negative = positive.mul_(truth).sum(1), negative.mul_(keep - truth).sum(1)
        overlap = 2 * (prob * truth).sum(1) + 1
        total = (prob * keep).sum(1) + truth.sum(1) + 1
        ctx.save_for_backward(logits, prob, neg_log_prob, truth, keep, count, overlap, total)
        ctx.alpha, ctx.gamma = alpha, gamma
        return (alpha * positive + (1 - alpha) * negative) / count, 1 - overlap / total

    @staticmethod
    def backward(ctx, grad_focal: torch.Tensor, grad_dice: torch.Tensor):
        logits, prob, neg_log_prob, truth, keep, count, overlap, total = ctx.saved_tensors
        alpha, gamma = ctx.alpha, ctx.gamma
        complement = 1 - prob
        # d/dx of (1 - p)^g * -log p and of p^g * -log(1 - p), with dp/dx = p (1 - p)
        d_positive = (prob * neg_log_prob).mul_(gamma).add_(complement).mul_(complement.pow(gamma)).neg_()
        d_negative = (complement * (neg_log_prob + logits)).mul_(gamma).add_(prob).mul_(prob.pow(gamma))
        grad = (alpha * truth).mul_(d_positive).add_(((1 - alpha) * (keep - truth)).mul_(d_negative))
        grad.mul_((grad_focal / count).unsqueeze(1))
        # dice = 1 - overlap / total: d/dp_n = (overlap * keep_n / total - 2 truth_n) / total
        d_dice = (keep * (overlap / total).unsqueeze(1)).sub_(2 * truth).mul_((grad_dice / total).unsqueeze(1))
        grad.add_(d_dice.mul_(prob).mul_(complement))
        return grad, None, None, None, None


def assign_queries(cost: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hungarian assignment (scipy's linear_sum_assignment) of a (Q, T) cost -> (query indices, target
    indices), min(Q, T) pairs, target indices ascending."""
    # deferred: scipy.optimize costs every rank of every task ~0.5 s to import; only the detector's loss needs it
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost)
    order = cols.argsort()
    return torch.as_tensor(rows[order], dtype=torch.long), torch.as_tensor(cols[order], dtype=torch.long)


@torch.no_grad()
def hungarian_match(class_logits: torch.Tensor, mask_logits: torch.Tensor, target_classes: torch.Tensor,
                    target_masks: torch.Tensor, weights: DetectorLossWeights = DetectorLossWeights(),
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """class_logits (Q, K+1), mask_logits (Q, N), target_classes (T,), target_masks (T, N) bool over the
    points to match on -> (query indices, target indices), min(Q, T) pairs, target indices ascending.

    The cost is `matching_cost`'s, on match_points points drawn with replacement (matcher.py:174-175) from
    `generator` (a CPU torch.Generator) when N is larger.
    """
    num_points = mask_logits.shape[1]
    if len(target_classes) == 0 or num_points == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    if weights.match_points and num_points > weights.match_points:
        sample = torch.randint(num_points, (weights.match_points,), generator=generator).to(mask_logits.device)
        mask_logits, target_masks = mask_logits[:, sample], target_masks[:, sample]
    cost = matching_cost(mask_logits.float()[None], class_logits.float()[None], target_masks.float()[None],
                         target_classes[None], torch.ones_like(mask_logits[:1], dtype=torch.float), weights)
    return assign_queries(cost[0].cpu().numpy())


@dataclass
class BatchTargets:
    """A batch's truth padded like the decoder's points (column n of event b is its point n)."""

    instance: torch.Tensor  # (B, P) long, 0..T_b-1, -1 for no instance and past the event's points
    masks: torch.Tensor  # (B, T, P) float, 1 where the point is in the instance; rows past T_b are 0
    instance_class: torch.Tensor  # (B, T) long, 0 past T_b
    count: list[int]  # T_b, the instances of each event
    momentum: torch.Tensor | None  # (B, T)
    vertex: torch.Tensor | None  # (B, T, 3)


def batch_targets(targets: list[EventTargets], width: int) -> BatchTargets:
    """Per-event targets -> one padded batch of `width` point columns."""
    device = targets[0].instance.device
    count = [len(target.instance_class) for target in targets]
    most = max(count)
    instance = torch.full((len(targets), width), -1, dtype=torch.long, device=device)
    instance_class = torch.zeros(len(targets), most, dtype=torch.long, device=device)
    for b, target in enumerate(targets):
        instance[b, :len(target.instance)] = target.instance
        instance_class[b, :count[b]] = target.instance_class
    one_hot = torch.zeros(len(targets), most + 1, width, device=device)
    one_hot.scatter_(1, torch.where(instance >= 0, instance, most).unsqueeze(1), 1.0)

    def padded(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        if any(getattr(target, name) is None for target in targets):
            return None
        out = torch.zeros(len(targets), most, *shape, device=device)
        for b, target in enumerate(targets):
            out[b, :count[b]] = getattr(target, name).float()
        return out

    return BatchTargets(instance, one_hot[:, :most], instance_class, count, padded("momentum", ()),
                        padded("vertex", (3,)))


# one term of every event: its value and whether the event defines it (False: no matched pair, ...)
EventTerm = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def matching_cost(logits: torch.Tensor, class_logits: torch.Tensor, masks: torch.Tensor, instance_class: torch.Tensor,
                  keep: torch.Tensor, weights: DetectorLossWeights) -> torch.Tensor:
    """(B, Q, T) Hungarian cost of every (query, instance) pair of every event over the points `keep` (B, P),
    from mask logits (B, Q, P), class logits (B, Q, K+1), instance masks (B, T, P) and classes (B, T):
    cost_class * -log p(instance class) (softmax without no-object, as matcher.py:223-224) + cost_mask * mean
    sigmoid focal loss + cost_dice * dice loss."""
    alpha = weights.focal_alpha
    keep = keep.float()
    # the kept points of each instance, and all kept points as one more row: each per-point part is summed over both
    # in one batched product, (B, T + 1, P) @ (B, P, Q) (on CPU faster than (B, Q, P) @ (B, P, T + 1))
    rows = torch.cat([masks * keep.unsqueeze(1), keep.unsqueeze(1)], 1)
    prob, _, positive, negative = _focal_parts(logits, weights.focal_gamma)
    prob, positive, negative = ((rows @ part.transpose(1, 2)).transpose(1, 2) for part in (prob, positive, negative))
    points = keep.sum(1).clamp(min=1)[:, None, None]
    instance_points = rows[:, :-1].sum(-1).unsqueeze(1)  # (B, 1, T)
    # mean over the kept points of the focal loss against 1 where the instance is, against 0 elsewhere
    focal = (alpha * positive[..., :-1] + (1 - alpha) * (negative[..., -1:] - negative[..., :-1])) / points
    dice = 1 - (2 * prob[..., :-1] + 1) / (prob[..., -1:] + instance_points + 1)
    class_prob = class_logits[..., :-1].softmax(-1)
    target_class = instance_class.unsqueeze(1).expand(-1, logits.shape[1], -1)
    cost_class = -torch.log(class_prob.gather(2, target_class) + 1e-8)
    return weights.cost_mask * focal + weights.cost_dice * dice + weights.cost_class * cost_class


def _layer_terms(layer: BatchLayerPrediction, truth: BatchTargets, weights: DetectorLossWeights,
                 generators: list[torch.Generator | None]) -> tuple[torch.Tensor, dict[str, EventTerm]]:
    """One layer's loss of every event (B,) and its unweighted terms, all events at once: the matching cost of
    every pair without gradients, then the loss terms of the matched pairs only.

    Mask terms count the points of a true instance that the decoder read: a point the stuff head left out has
    the padding logit (published: it enters the mask terms anyway, a constant of ~2,500 per point in the focal
    loss that moves no gradient but buries the loss curve).
    """
    logits = layer.mask_logits.float()
    batch, num_queries, _ = logits.shape
    keep = (truth.instance >= 0) & (logits[:, 0] > PADDING_BIAS / 2)  # (B, P)
    class_logits = layer.class_logits.float()
    cost = matching_cost(logits, class_logits, truth.masks, truth.instance_class, keep, weights)
    pairs = _match(layer, truth, keep, cost, weights, generators)
    pair_event, pair_query, pair_target = (torch.cat(side).to(logits.device) for side in zip(*pairs))
    num_pairs = torch.bincount(pair_event, minlength=batch)
    matched = num_pairs > 0

    def event_mean(per_pair: torch.Tensor) -> torch.Tensor:
        return per_pair.new_zeros(batch).index_add(0, pair_event, per_pair) / num_pairs.clamp(min=1)

    # the matched pairs' rows: mask logits, truth and kept points, (M, P)
    pair_logits = logits[pair_event, pair_query]
    pair_keep = keep[pair_event].float()
    pair_truth = truth.masks[pair_event, pair_target] * pair_keep
    focal, dice = MatchedMaskLosses.apply(pair_logits, pair_truth, pair_keep, weights.focal_alpha, weights.focal_gamma)
    terms = {"focal": (event_mean(focal), matched), "dice": (event_mean(dice), matched)}
    query_class = torch.full((batch, num_queries), class_logits.shape[-1] - 1, device=logits.device)
    query_class[pair_event, pair_query] = truth.instance_class[pair_event, pair_target]
    is_matched = torch.zeros(batch, num_queries, dtype=torch.bool, device=logits.device)
    is_matched[pair_event, pair_query] = True
    cross_entropy = F.cross_entropy(class_logits.flatten(0, 1), query_class.flatten(), reduction="none")
    cross_entropy = cross_entropy.reshape(batch, num_queries)
    no_object = ~is_matched
    terms["class_matched"] = ((cross_entropy * is_matched).sum(1) / num_pairs.clamp(min=1), matched)
    terms["class_no_object"] = ((cross_entropy * no_object).sum(1) / no_object.sum(1).clamp(min=1),
                                no_object.any(1))
    # instance.py:288-304, 543: the weighted matched and no-object terms are averaged
    class_sum = (weights.class_matched * terms["class_matched"][0] * matched
                 + weights.class_no_object * terms["class_no_object"][0] * no_object.any(1))
    terms["class"] = (class_sum / (matched.float() + no_object.any(1).float()), torch.ones_like(matched))
    if layer.momentum is not None and truth.momentum is not None:
        error = F.smooth_l1_loss(layer.momentum[pair_event, pair_query].float(),
                                 truth.momentum[pair_event, pair_target], reduction="none")
        terms["momentum"] = (event_mean(error), matched)
    if layer.vertex is not None and truth.vertex is not None:
        error = F.smooth_l1_loss(layer.vertex[pair_event, pair_query].float(),
                                 truth.vertex[pair_event, pair_target], reduction="none")
        terms["vertex"] = (event_mean(error.mean(1)), matched)
    if layer.iou is not None:
        # instance.py:384-396: the matched mask (sigmoid > 0.5) over the labelled points against the instance's
        # points, every labelled one (the stuff head's left-out points too: the instance misses them)
        predicted = (logits[pair_event, pair_query] > 0) & (truth.instance[pair_event] >= 0)
        instance = truth.masks[pair_event, pair_target]
        overlap = (predicted * instance).sum(1)
        iou = overlap / (predicted.sum(1) + instance.sum(1) - overlap + 1e-6)
        terms["iou"] = (event_mean((layer.iou[pair_event, pair_query].float() - iou) ** 2), matched)
    loss = terms["class"][0]
    for name in ("focal", "dice", "momentum", "vertex", "iou"):
        if name in terms:
            value, defined = terms[name]
            loss = loss + getattr(weights, name) * torch.where(defined, value, 0.0)
    return loss, terms


def _match(layer: BatchLayerPrediction, truth: BatchTargets, keep: torch.Tensor, cost: torch.Tensor,
           weights: DetectorLossWeights, generators: list[torch.Generator | None]
           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each event's matched (event, query, target) index triples: the Hungarian assignment of `cost`, or, for
    an event with more than match_points points, hungarian_match on points drawn from its generator."""
    points = keep.sum(1).tolist()
    cost = cost.cpu().numpy()
    pairs = [(torch.zeros(0, dtype=torch.long),) * 3]
    for b, count in enumerate(truth.count):
        if count == 0 or points[b] == 0:
            continue
        if weights.match_points and points[b] > weights.match_points:
            rows = keep[b].nonzero().squeeze(1)
            query, target = hungarian_match(layer.class_logits[b], layer.mask_logits[b][:, rows],
                                            truth.instance_class[b, :count], truth.masks[b, :count][:, rows] > 0,
                                            weights, generators[b])
        else:
            query, target = assign_queries(cost[b, :, :count])
        pairs.append((torch.full_like(query, b), query, target))
    return pairs


def detector_event_losses(output: DecoderOutput, targets: list[EventTargets],
                          weights: DetectorLossWeights = DetectorLossWeights(),
                          generators: list[torch.Generator | None] | None = None
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each event's detector loss -> (event_losses (B,), named terms averaged over the events defining them).

    An event's loss is loss(last layer) + weights.aux * sum of loss(layer l) over earlier layers, each layer
    matched on its own (instance.py:88-110). Terms: the last layer's by name ("focal", "dice", "class",
    "class_matched", "class_no_object", and "momentum", "vertex", "iou" where predicted and known), "aux{l}_{name}"
    for layer l. `generators[b]` draws event b's matching points (only when it has more than match_points).
    """
    if len(output.counts) != len(targets) or not targets:
        raise ValueError(f"detector_loss got {len(output.counts)} predicted and {len(targets)} target events; "
                         "pass one EventTargets per event of the batch")
    for b, (count, target) in enumerate(zip(output.counts, targets)):
        if count != len(target.instance):
            raise ValueError(f"event {b}: {count} predicted points but {len(target.instance)} target points; "
                             "targets must follow the model's points")
    generators = generators or [None] * len(targets)
    truth = batch_targets(targets, output.final.mask_logits.shape[-1])
    # the last layer first, then the earlier ones: each event's generator draws in that order
    event_losses, terms = _layer_terms(output.final, truth, weights, generators)
    named = dict(terms)
    for index, layer in enumerate(output.layers[:-1]):
        loss, aux = _layer_terms(layer, truth, weights, generators)
        event_losses = event_losses + weights.aux * loss
        named.update({f"aux{index}_{name}": value for name, value in aux.items()})
    means = {name: value.detach()[defined].mean() for name, (value, defined) in named.items() if defined.any()}
    return event_losses, means


def detector_loss(output: DecoderOutput, targets: list[EventTargets],
                  weights: DetectorLossWeights = DetectorLossWeights(),
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One batch's detector loss, the mean of `detector_event_losses` over its events -> (total, named terms)."""
    event_losses, terms = detector_event_losses(output, targets, weights, [generator] * len(targets))
    return event_losses.mean(), terms
