"""Clustering and panoptic metrics of particle / interaction instances, per event, without torch.

Inputs per event are numpy arrays with one value per point: the true and predicted instance id
(>= 0 for a thing instance, negative for stuff or unassigned points), the true and predicted class
(0..C-1, negative for unknown) and optionally the true and predicted momentum (N,) and vertex (N, 3),
constant within an instance (each instance takes the mean over its points). An instance's class is
the most common class among its points with a known class (ties: the smaller class), -1 if none.

Point-set metrics (ARI and AMI are those of `sklearn.metrics`, computed here from the contingency
table; a negative id, e.g. predicted stuff, is one cluster of its own, as sklearn would treat it):
- `ari_all_labelled`: adjusted Rand index on the points with a true instance (true instance >= 0).
- `ari_predicted_things`: adjusted Rand index on the points predicted as things (pred instance >= 0)
  whose truth is known (true class >= 0); true stuff points stay in as one true cluster. This is the
  published instance evaluator's convention (DeepLearnPhysics/pimm, pimm/engines/hooks/evaluator.py,
  `InstanceSegmentationEvaluator.eval`: ARI over pred instance != -1).
- `ami_all_labelled`: adjusted mutual information, arithmetic mean of the two entropies as the
  normaliser (sklearn's default), on the points of `ari_all_labelled`.

Instance metrics (sizes count every point of an instance in the event; overlaps count points in a
true and a predicted instance):
- `purity`: mean over predicted instances of (largest overlap with one true instance) / size.
- `efficiency`: mean over true instances of (largest overlap with one predicted instance) / size.
  Both are means over instances, so a clustering that splits off many small pieces (each pure) raises
  purity; `PanopticAccumulator.result` also gives them weighted by points, pooled over every instance
  of every event, as `purity_pooled` (sum of largest overlaps / sum of sizes, over predicted instances)
  and `efficiency_pooled` (the same over true instances), where a piece counts by its size.
- `dice`: symmetric best Dice, the mean of (mean over true instances of the best Dice 2|T∩P|/(|T|+|P|)
  against any predicted instance) and the same over predicted instances; 0 when one side is empty.
- `detection_precision`, `detection_recall`, `detection_f1`, `matched_iou`: instances matched one to
  one, class-agnostic, at IoU >= 0.5 (`iou_threshold`); above 0.5 a match is unique, pairs at exactly
  0.5 are taken greedily by IoU, then true id, then predicted id. precision = matches / predicted
  instances, recall = matches / true instances, F1 = 2 matches / (predicted + true), matched_iou =
  mean IoU of the matches. The published evaluator pools these counts over events instead (micro):
  `PanopticAccumulator.result` gives that too, as `detection_*_pooled` and `matched_iou_pooled`.
- `pq`, `sq`, `rq`: panoptic quality (Kirillov et al. 2019, "Panoptic Segmentation"): per class, a
  true and a predicted segment of that class match at IoU > 0.5 (unique), SQ_c = sum IoU / TP,
  RQ_c = TP / (TP + FP/2 + FN/2), PQ_c = SQ_c RQ_c (SQ_c = 0 without TP, as the paper's panopticapi
  does); the event's values are the means over the classes with TP + FP + FN > 0. Thing segments are
  instances whose class is a thing class; each class in `stuff_classes` is one segment per side made
  of the points of that class that are in no thing segment, as in the paper. Points of unknown true
  class (< 0, the paper's void) are removed first; the paper's rule of not counting a predicted
  segment that is mostly void as a false positive is not applied.

Every per-event value is NaN where it is undefined (no points in its set, no instance to average
over, no match for matched_iou, no segment for PQ); `PanopticAccumulator.result` averages each one
over the events where it is defined and reports that count as `<name>_events` and the standard error of that
mean as `<name>_sem` (the sample standard deviation over those events, n - 1, divided by sqrt(n); NaN under two
events): the spread a different set of events of the same kind would move the mean by. `paired_differences`
compares two accumulators that scored the same events (two methods): per metric the mean of the per-event
differences and its standard error, which is smaller than either mean's when the events that are hard for one
method are hard for the other (a difference of several standard errors is more than the events' spread). For
standalone calls,
`adjusted_rand_index` and `adjusted_mutual_information` follow sklearn on degenerate inputs: 1.0 for
no points, one point, or identical partitions (one cluster each, all singletons), 0.0 for AMI when
exactly one side is a single cluster.

Pooled over the events (one list of matched pairs, or summed counts):
- `pid_precision`, `pid_recall`, `pid_f1`: macro means, over the classes present in the confusion
  matrix (true class of the true instance vs predicted class of the predicted instance, on the
  detection matches with both classes known), of the per-class values; an undefined precision or
  recall of a present class counts 0 (sklearn's zero_division=0). `confusion_matrix()` returns it.
- `purity_pooled`, `efficiency_pooled`: purity and efficiency weighted by points (above).
- `pq_pooled`, `sq_pooled`, `rq_pooled` (and per class): the paper's dataset-level numbers, TP, FP, FN
  and IoU sums added over all events per class, then averaged over the classes with TP + FP + FN > 0.
- `momentum_bias_<class>`, `momentum_rms_<class>`: mean and root mean square of (pred - true) / true
  over matched pairs whose true instance is of that class (the published evaluator groups by the
  predicted class and reports absolute errors); true momentum 0 is left out. The resolution
  (standard deviation) is sqrt(rms^2 - bias^2). Without a class suffix: all classes together.
  <class> is the accumulator's class name, by default the class number.
- `vertex_residual_median`, `vertex_residual_q68`: median and 68% quantile of the 3D distance
  |pred vertex - true vertex| over matched pairs.

Events are counted once: `update` and `merge` skip an event id already seen, and `result` reduces
everything sorted by event id, so any split of the events over ranks merged back gives the same
floats as one accumulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pimm.names import PANOPTIC_EVENT_METRICS

EVENT_METRICS = PANOPTIC_EVENT_METRICS  # the per-event metrics, in their column order
STATE_KEYS = (
    "event_id",
    "event_values",
    "detection_counts",
    "cluster_points",
    "pq_counts",
    "pair_event_id",
    "pair_true_class",
    "pair_pred_class",
    "pair_momentum_residual",
    "pair_vertex_residual",
)
_NAN = float("nan")


# ---------------------------------------------------------------- point-set metrics (ARI, AMI)


def _unique(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True, return_counts=True) for integers: by counting when
    their range is within a few times their number (ids of one event are), else by sorting."""
    values = np.asarray(values).astype(np.int64, copy=False).ravel()
    if len(values) == 0:
        return values, np.zeros(0, np.int64), np.zeros(0, np.int64)
    low = int(values.min())
    if int(values.max()) - low > 4 * len(values) + 1024:
        ids, code, sizes = np.unique(values, return_inverse=True, return_counts=True)
        return ids, code.ravel(), sizes
    counts = np.bincount(values - low)
    present = counts > 0
    code_of_value = np.cumsum(present) - 1
    return np.flatnonzero(present) + low, code_of_value[values - low], counts[present]


def _contingency(labels_true: np.ndarray, labels_pred: np.ndarray) -> tuple[np.ndarray, ...]:
    """Nonzero cells of the contingency table (row, column, count) and both marginals; every
    distinct label is a cluster."""
    _, t_code, t_sizes = _unique(labels_true)
    _, p_code, p_sizes = _unique(labels_pred)
    width = max(len(p_sizes), 1)
    keys, _, cells = _unique(t_code * width + p_code)
    return keys // width, keys % width, cells, t_sizes, p_sizes


def _pairs(counts: np.ndarray) -> int:
    """Number of unordered point pairs inside the groups of the given sizes, exactly."""
    c = counts.astype(np.int64)
    return int((c * (c - 1) // 2).sum())


def adjusted_rand_index(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Adjusted Rand index of two labellings of the same points (sklearn's adjusted_rand_score):
    1.0 for identical partitions, also for 0 or 1 point; pair counts in exact integers."""
    labels_true, labels_pred = np.asarray(labels_true), np.asarray(labels_pred)
    _, _, cells, t_sizes, p_sizes = _contingency(labels_true, labels_pred)
    both, same_true, same_pred = _pairs(cells), _pairs(t_sizes), _pairs(p_sizes)
    if both == same_true == same_pred:  # every pair treated alike by both: identical partitions
        return 1.0
    total = len(labels_true) * (len(labels_true) - 1) // 2
    # ARI = (both - E) / ((same_true + same_pred) / 2 - E), E = same_true same_pred / total; times 2 total: integers
    numerator = 2 * (both * total - same_true * same_pred)
    denominator = (same_true + same_pred) * total - 2 * same_true * same_pred
    return numerator / denominator


def _entropy(sizes: np.ndarray, n: int) -> float:
    p = sizes / n
    return float(-(p * np.log(p)).sum())


def _expected_mutual_information(t_sizes: np.ndarray, p_sizes: np.ndarray, n: int) -> float:
    """E[MI] of two random labellings with these cluster sizes (hypergeometric model, Vinh et al.
    2010); clusters of equal size contribute alike, so it runs over distinct sizes only. Overlaps
    further than 5 sqrt(min(a, b)) from their mean a b / n are left out: by Hoeffding's bound their
    probability is below 2 exp(-50) = 4e-22, far below float64 resolution of the sum."""
    # deferred: scipy.special costs every rank ~0.4 s to import; only this metric of `pimm test` needs it
    from scipy.special import gammaln

    a_values, a_mult = np.unique(t_sizes, return_counts=True)
    b_values, b_mult = np.unique(p_sizes, return_counts=True)
    b_values = b_values.astype(np.int64)
    emi = 0.0
    for a, a_count in zip(a_values.astype(np.int64), a_mult):
        mean, reach = a * b_values / n, 5 * np.sqrt(np.minimum(a, b_values))
        low = np.maximum(np.maximum(1, a + b_values - n), np.floor(mean - reach).astype(np.int64))
        high = np.minimum(np.minimum(a, b_values), np.ceil(mean + reach).astype(np.int64))
        lengths = np.maximum(high - low + 1, 0)
        which = np.repeat(np.arange(len(b_values)), lengths)  # one row per (b, n_ij) term
        starts = np.cumsum(lengths) - lengths
        nij = (low[which] + np.arange(len(which)) - starts[which]).astype(np.float64)
        b = b_values[which].astype(np.float64)
        log_p = (gammaln(a + 1) + gammaln(b + 1) + gammaln(n - a + 1) + gammaln(n - b + 1) - gammaln(n + 1)
                 - gammaln(nij + 1) - gammaln(a - nij + 1) - gammaln(b - nij + 1) - gammaln(n - a - b + nij + 1))
        terms = nij / n * (np.log(n * nij) - np.log(a * b)) * np.exp(log_p)
        emi += a_count * float((b_mult[which] * terms).sum())
    return emi


def adjusted_mutual_information(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Adjusted mutual information with the arithmetic-mean normaliser (sklearn's
    adjusted_mutual_info_score): 1.0 for identical partitions and for no points, 0.0 when exactly
    one side is a single cluster."""
    labels_true, labels_pred = np.asarray(labels_true), np.asarray(labels_pred)
    n = len(labels_true)
    rows, columns, cells, t_sizes, p_sizes = _contingency(labels_true, labels_pred)
    if n == 0 or len(cells) == len(t_sizes) == len(p_sizes):  # each cluster is one cluster of the other side
        return 1.0
    if len(t_sizes) == 1 or len(p_sizes) == 1:
        return 0.0
    nij, a, b = cells.astype(np.float64), t_sizes[rows].astype(np.float64), p_sizes[columns].astype(np.float64)
    mi = float((nij / n * (np.log(n * nij) - np.log(a * b))).sum())
    emi = _expected_mutual_information(t_sizes, p_sizes, n)
    normaliser = (_entropy(t_sizes, n) + _entropy(p_sizes, n)) / 2
    eps = np.finfo(np.float64).eps
    # round-off can leave MI or the normaliser a hair below E[MI]: keep the sign, never divide by 0
    numerator, denominator = mi - emi, normaliser - emi
    numerator = min(numerator, -eps) if numerator < 0 else max(numerator, eps)
    denominator = min(denominator, -eps) if denominator < 0 else max(denominator, eps)
    return numerator / denominator


# ---------------------------------------------------------------- instances: overlaps and matching


@dataclass(frozen=True)
class InstanceOverlap:
    """The instances (ids >= 0) of one event and the nonzero overlaps between true and predicted ones.
    Cells are sorted by (true index, predicted index)."""

    true_ids: np.ndarray  # (T,) sorted
    true_sizes: np.ndarray  # (T,) points per true instance
    pred_ids: np.ndarray  # (P,) sorted
    pred_sizes: np.ndarray  # (P,)
    true_index: np.ndarray  # (K,) row in true_ids of each overlapping pair
    pred_index: np.ndarray  # (K,) row in pred_ids
    shared: np.ndarray  # (K,) points in both
    true_code: np.ndarray  # (N,) row in true_ids of each point, -1 outside every true instance
    pred_code: np.ndarray  # (N,)

    def iou(self) -> np.ndarray:
        union = self.true_sizes[self.true_index] + self.pred_sizes[self.pred_index] - self.shared
        return self.shared / union


def _instance_codes(instance: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted ids >= 0, their sizes, and each point's row among them (-1 for a negative id)."""
    ids, code, sizes = _unique(instance)
    negative = int(np.searchsorted(ids, 0))  # negative ids sort first
    return ids[negative:], sizes[negative:], code - negative


def instance_overlap(true_instance: np.ndarray, pred_instance: np.ndarray) -> InstanceOverlap:
    """Overlap table of the true and predicted instances of one event (per-point ids, negative = none)."""
    true_ids, true_sizes, true_code = _instance_codes(true_instance)
    pred_ids, pred_sizes, pred_code = _instance_codes(pred_instance)
    both = (true_code >= 0) & (pred_code >= 0)
    width = max(len(pred_ids), 1)
    keys, _, shared = _unique(true_code[both] * width + pred_code[both])
    return InstanceOverlap(true_ids, true_sizes, pred_ids, pred_sizes, keys // width, keys % width, shared,
                           np.where(true_code >= 0, true_code, -1), np.where(pred_code >= 0, pred_code, -1))


def match_instances(overlap: InstanceOverlap, iou_threshold: float = 0.5, strict: bool = False) -> np.ndarray:
    """One-to-one matches at IoU >= iou_threshold (> with strict): rows of overlap's cells, taken
    greedily by IoU, then true index, then predicted index; returned sorted by true index."""
    iou = overlap.iou()
    candidates = np.flatnonzero(iou > iou_threshold if strict else iou >= iou_threshold)
    if iou_threshold >= 0.5 and (strict or not np.any(iou[candidates] == 0.5)):
        return candidates  # above 0.5 no instance has two candidates (overlaps would exceed its size)
    order = candidates[np.lexsort((overlap.pred_index[candidates], overlap.true_index[candidates],
                                   -iou[candidates]))]
    used_true, used_pred, chosen = set(), set(), []
    for cell in order:
        t, p = int(overlap.true_index[cell]), int(overlap.pred_index[cell])
        if t not in used_true and p not in used_pred:
            used_true.add(t)
            used_pred.add(p)
            chosen.append(cell)
    return np.sort(np.asarray(chosen, dtype=np.int64))


def instance_classes(code: np.ndarray, count: int, point_class: np.ndarray, num_classes: int) -> np.ndarray:
    """Class of each of `count` instances (point rows `code`, -1 outside): the most common known
    class (0..num_classes-1) of its points, ties to the smaller class, -1 when none is known."""
    keep = (code >= 0) & (point_class >= 0)
    keys, _, votes = _unique(code[keep] * num_classes + point_class[keep])
    inst, cls = keys // num_classes, keys % num_classes
    order = np.lexsort((cls, -votes, inst))  # per instance: most votes first, then smallest class
    first = order[np.r_[True, inst[order][1:] != inst[order][:-1]]] if len(order) else order
    classes = np.full(count, -1, dtype=np.int64)
    classes[inst[first]] = cls[first]
    return classes


def _instance_means(code: np.ndarray, count: int, values: np.ndarray) -> np.ndarray:
    """Mean of per-point values (N,) or (N, D) over each instance's points."""
    keep = code >= 0
    sizes = np.bincount(code[keep], minlength=count).astype(np.float64)
    columns = values[keep] if values.ndim == 2 else values[keep][:, None]
    sums = np.stack([np.bincount(code[keep], weights=col, minlength=count) for col in columns.T], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / sizes[:, None]
    return means if values.ndim == 2 else means[:, 0]


def _mean_or_nan(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else _NAN


def _standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of `values`: the sample standard deviation (n - 1) over sqrt(n); NaN under two."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else _NAN


def _best_per(index: np.ndarray, score: np.ndarray, count: int) -> np.ndarray:
    best = np.zeros(count)
    np.maximum.at(best, index, score)
    return best


# ---------------------------------------------------------------- panoptic quality


def panoptic_counts(true_instance: np.ndarray, pred_instance: np.ndarray, true_class: np.ndarray,
                    pred_class: np.ndarray, num_classes: int, stuff_classes: Sequence[int] = ()) -> np.ndarray:
    """Per class (C, 4): TP, FP, FN and the IoU sum of the TPs, as in the module docstring."""
    known = true_class >= 0
    t_inst, p_inst, t_cls, p_cls = true_instance[known], pred_instance[known], true_class[known], pred_class[known]
    is_stuff = np.zeros(num_classes + 1, dtype=bool)  # the extra last entry answers class -1: not stuff
    is_stuff[list(stuff_classes)] = True

    def segments(instance: np.ndarray, point_class: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, _, code = _instance_codes(instance)
        classes = instance_classes(code, len(ids), point_class, num_classes)
        point_instance_class = np.append(classes, -1)[code]  # index -1: outside every instance
        thing = (point_instance_class >= 0) & ~is_stuff[point_instance_class]
        in_stuff = ~thing & is_stuff[point_class]
        # one id per segment: a thing instance keeps its row, stuff class s becomes len(ids) + s
        segment = np.where(thing, code, np.where(in_stuff, len(ids) + point_class, -1))
        segment_class = np.concatenate([classes, np.arange(num_classes)])
        return segment, segment_class, np.unique(segment[segment >= 0])

    t_seg, t_seg_class, t_present = segments(t_inst, t_cls)
    p_seg, p_seg_class, p_present = segments(p_inst, p_cls)
    overlap = instance_overlap(t_seg, p_seg)
    same_class = t_seg_class[overlap.true_ids[overlap.true_index]] == p_seg_class[overlap.pred_ids[overlap.pred_index]]
    iou = overlap.iou()
    tp_cells = np.flatnonzero(same_class & (iou > 0.5))
    tp_class = t_seg_class[overlap.true_ids[overlap.true_index[tp_cells]]]
    counts = np.zeros((num_classes, 4))
    counts[:, 0] = np.bincount(tp_class, minlength=num_classes)
    counts[:, 1] = np.bincount(p_seg_class[p_present], minlength=num_classes) - counts[:, 0]
    counts[:, 2] = np.bincount(t_seg_class[t_present], minlength=num_classes) - counts[:, 0]
    counts[:, 3] = np.bincount(tp_class, weights=iou[tp_cells], minlength=num_classes)
    return counts


def panoptic_quality(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PQ, SQ, RQ per class from (C, 4) counts, and the mask of classes with TP + FP + FN > 0."""
    tp, fp, fn, iou_sum = counts.T
    present = tp + fp + fn > 0
    rq_den = np.where(present, tp + fp / 2 + fn / 2, 1.0)
    sq = np.where(tp > 0, iou_sum / np.maximum(tp, 1), 0.0)
    rq = tp / rq_den
    return sq * rq, sq, rq, present


# ---------------------------------------------------------------- one event


@dataclass(frozen=True)
class EventRecord:
    """What one event adds to the accumulator: its metric values and its matched pairs."""

    values: np.ndarray  # (len(EVENT_METRICS),)
    detection_counts: np.ndarray  # (4,) true instances, predicted instances, matches, IoU sum of the matches
    # (4,) summed over predicted instances: largest overlap, size; over true instances: largest overlap, size
    cluster_points: np.ndarray
    pq_counts: np.ndarray  # (C, 4) TP, FP, FN, IoU sum
    pair_true_class: np.ndarray  # (M,) per detection match, by true instance
    pair_pred_class: np.ndarray  # (M,)
    pair_momentum_residual: np.ndarray  # (M,) (pred - true) / true, NaN when unknown
    pair_vertex_residual: np.ndarray  # (M,) |pred - true| in 3D, NaN when unknown

    def metrics(self) -> dict[str, float]:
        """The per-event values by name (NaN where undefined)."""
        return dict(zip(EVENT_METRICS, map(float, self.values)))


def _check_event(num_classes: int, arrays: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    n = len(arrays["true_instance"])
    out = {}
    for name, value in arrays.items():
        if value is None:
            out[name] = None
            continue
        value = np.asarray(value)
        want = (n, 3) if name.endswith("vertex") else (n,)
        if value.shape != want:
            raise ValueError(f"{name} has shape {value.shape}, expected {want} (one value per point of the event)")
        if name.endswith(("instance", "class")):
            if not np.issubdtype(value.dtype, np.integer):
                raise ValueError(f"{name} has dtype {value.dtype}; pass integer ids (negative for none)")
            value = value.astype(np.int64)
        if name.endswith("class"):
            if n and value.max() >= num_classes:
                raise ValueError(f"{name} holds class {int(value.max())}, outside 0..{num_classes - 1}; "
                                 f"set num_classes to the dataset's class count")
            value = np.maximum(value, -1)  # every negative class means unknown
        out[name] = value
    for side in ("momentum", "vertex"):
        if (out[f"true_{side}"] is None) != (out[f"pred_{side}"] is None):
            raise ValueError(f"give both true_{side} and pred_{side}, or neither")
    return out


def evaluate_event(true_instance: np.ndarray, pred_instance: np.ndarray, true_class: np.ndarray,
                   pred_class: np.ndarray, *, num_classes: int, stuff_classes: Sequence[int] = (),
                   iou_threshold: float = 0.5, true_momentum: np.ndarray | None = None,
                   pred_momentum: np.ndarray | None = None, true_vertex: np.ndarray | None = None,
                   pred_vertex: np.ndarray | None = None) -> EventRecord:
    """Every metric of one event (module docstring) from per-point arrays."""
    arrays = _check_event(num_classes, dict(true_instance=true_instance, pred_instance=pred_instance,
                                       true_class=true_class, pred_class=pred_class, true_momentum=true_momentum,
                                       pred_momentum=pred_momentum, true_vertex=true_vertex, pred_vertex=pred_vertex))
    t_inst, p_inst = arrays["true_instance"], arrays["pred_instance"]
    t_cls, p_cls = arrays["true_class"], arrays["pred_class"]
    values = dict.fromkeys(EVENT_METRICS, _NAN)

    labelled = t_inst >= 0
    if labelled.any():
        values["ari_all_labelled"] = adjusted_rand_index(t_inst[labelled], p_inst[labelled])
        values["ami_all_labelled"] = adjusted_mutual_information(t_inst[labelled], p_inst[labelled])
    things = (p_inst >= 0) & (t_cls >= 0)
    if things.any():
        values["ari_predicted_things"] = adjusted_rand_index(t_inst[things], p_inst[things])

    ov = instance_overlap(t_inst, p_inst)
    n_true, n_pred = len(ov.true_ids), len(ov.pred_ids)
    best_of_pred = _best_per(ov.pred_index, ov.shared, n_pred)
    best_of_true = _best_per(ov.true_index, ov.shared, n_true)
    values["purity"] = _mean_or_nan(best_of_pred / ov.pred_sizes)
    values["efficiency"] = _mean_or_nan(best_of_true / ov.true_sizes)
    dice = 2 * ov.shared / (ov.true_sizes[ov.true_index] + ov.pred_sizes[ov.pred_index])
    directions = [_mean_or_nan(_best_per(ov.true_index, dice, n_true)),
                  _mean_or_nan(_best_per(ov.pred_index, dice, n_pred))]
    defined = [d for d in directions if not np.isnan(d)]
    values["dice"] = sum(defined) / len(defined) if defined else _NAN

    matches = match_instances(ov, iou_threshold)
    matched, matched_iou = len(matches), ov.iou()[matches]
    values["detection_precision"] = matched / n_pred if n_pred else _NAN
    values["detection_recall"] = matched / n_true if n_true else _NAN
    values["detection_f1"] = 2 * matched / (n_pred + n_true) if n_pred + n_true else _NAN
    values["matched_iou"] = _mean_or_nan(matched_iou)

    pq_counts = panoptic_counts(t_inst, p_inst, t_cls, p_cls, num_classes, stuff_classes)
    pq, sq, rq, present = panoptic_quality(pq_counts)
    if present.any():
        values["pq"], values["sq"], values["rq"] = (float(x[present].mean()) for x in (pq, sq, rq))

    t_match, p_match = ov.true_index[matches], ov.pred_index[matches]
    residuals = {}
    if arrays["true_momentum"] is not None:
        true_p = _instance_means(ov.true_code, n_true, arrays["true_momentum"].astype(np.float64))[t_match]
        pred_p = _instance_means(ov.pred_code, n_pred, arrays["pred_momentum"].astype(np.float64))[p_match]
        with np.errstate(invalid="ignore", divide="ignore"):
            residuals["momentum"] = np.where(true_p != 0, (pred_p - true_p) / true_p, _NAN)
    if arrays["true_vertex"] is not None:
        true_v = _instance_means(ov.true_code, n_true, arrays["true_vertex"].astype(np.float64))[t_match]
        pred_v = _instance_means(ov.pred_code, n_pred, arrays["pred_vertex"].astype(np.float64))[p_match]
        residuals["vertex"] = np.linalg.norm(pred_v - true_v, axis=1)
    unknown = np.full(matched, _NAN)
    return EventRecord(
        values=np.array([values[k] for k in EVENT_METRICS], dtype=np.float64),
        detection_counts=np.array([n_true, n_pred, matched, matched_iou.sum()], dtype=np.float64),
        cluster_points=np.array([best_of_pred.sum(), ov.pred_sizes.sum(), best_of_true.sum(), ov.true_sizes.sum()],
                                dtype=np.float64),
        pq_counts=pq_counts,
        pair_true_class=instance_classes(ov.true_code, n_true, t_cls, num_classes)[t_match],
        pair_pred_class=instance_classes(ov.pred_code, n_pred, p_cls, num_classes)[p_match],
        pair_momentum_residual=residuals.get("momentum", unknown),
        pair_vertex_residual=residuals.get("vertex", unknown),
    )


# ---------------------------------------------------------------- over events and ranks


class PanopticAccumulator:
    """Per-event metrics of many events, each counted once by its event id; `state()` of every rank,
    merged with `merge`, gives the same `result()` as one accumulator that saw every event."""

    def __init__(self, num_classes: int, stuff_classes: Sequence[int] = (), iou_threshold: float = 0.5,
                 class_names: Sequence[str] | None = None) -> None:
        bad = [c for c in stuff_classes if not 0 <= c < num_classes]
        if bad:
            raise ValueError(f"stuff_classes {bad} are outside 0..{num_classes - 1}")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class_names for num_classes={num_classes}; give one name per class")
        self.num_classes = num_classes
        self.stuff_classes = tuple(stuff_classes)
        self.iou_threshold = iou_threshold
        self.class_names = tuple(class_names) if class_names is not None else tuple(map(str, range(num_classes)))
        self._events: dict[int, EventRecord] = {}

    def __len__(self) -> int:
        return len(self._events)

    def update(self, event_id: int, true_instance: np.ndarray, pred_instance: np.ndarray, true_class: np.ndarray,
               pred_class: np.ndarray, **extra: np.ndarray | None) -> bool:
        """Add one event (`evaluate_event`'s arrays; extra: true/pred momentum and vertex). Returns
        False, adding nothing, when this event id was already counted (a sampler's padding)."""
        event_id = int(event_id)
        if event_id in self._events:
            return False
        self._events[event_id] = evaluate_event(
            true_instance, pred_instance, true_class, pred_class, num_classes=self.num_classes,
            stuff_classes=self.stuff_classes, iou_threshold=self.iou_threshold, **extra)
        return True

    def state(self) -> dict[str, np.ndarray]:
        """Plain arrays (STATE_KEYS) holding every counted event, for an all-gather."""
        ids = sorted(self._events)
        records = [self._events[i] for i in ids]
        pairs = [len(r.pair_true_class) for r in records]

        def cat(field: str, dtype: type) -> np.ndarray:
            return np.concatenate([getattr(r, field) for r in records]).astype(dtype) if records else np.zeros(0, dtype)

        return {
            "event_id": np.asarray(ids, dtype=np.int64),
            "event_values": np.stack([r.values for r in records]) if records else np.zeros((0, len(EVENT_METRICS))),
            "detection_counts": np.stack([r.detection_counts for r in records]) if records else np.zeros((0, 4)),
            "cluster_points": np.stack([r.cluster_points for r in records]) if records else np.zeros((0, 4)),
            "pq_counts": (np.stack([r.pq_counts for r in records]) if records
                          else np.zeros((0, self.num_classes, 4))),
            "pair_event_id": np.repeat(np.asarray(ids, dtype=np.int64), pairs),
            "pair_true_class": cat("pair_true_class", np.int64),
            "pair_pred_class": cat("pair_pred_class", np.int64),
            "pair_momentum_residual": cat("pair_momentum_residual", np.float64),
            "pair_vertex_residual": cat("pair_vertex_residual", np.float64),
        }

    def merge(self, states: Sequence[dict[str, np.ndarray]]) -> None:
        """Add the events of other accumulators' states (this one's own included is harmless):
        an event id already counted is skipped."""
        for number, state in enumerate(states):
            missing = [k for k in STATE_KEYS if k not in state]
            if missing:
                raise ValueError(f"state {number} lacks {missing}; pass PanopticAccumulator.state() dicts")
            classes = np.asarray(state["pq_counts"]).shape[1]
            if classes != self.num_classes:
                raise ValueError(f"state {number} has {classes} classes, this accumulator {self.num_classes}; "
                                 f"every rank must use the same num_classes")
            pair_event = np.asarray(state["pair_event_id"])
            order = np.argsort(pair_event, kind="stable")  # keeps each event's pairs in their order
            starts = np.searchsorted(pair_event[order], state["event_id"], side="left")
            ends = np.searchsorted(pair_event[order], state["event_id"], side="right")
            for row, event_id in enumerate(np.asarray(state["event_id"]).tolist()):
                if event_id in self._events:
                    continue
                own = order[starts[row]:ends[row]]
                self._events[event_id] = EventRecord(
                    values=np.asarray(state["event_values"][row], dtype=np.float64),
                    detection_counts=np.asarray(state["detection_counts"][row], dtype=np.float64),
                    cluster_points=np.asarray(state["cluster_points"][row], dtype=np.float64),
                    pq_counts=np.asarray(state["pq_counts"][row], dtype=np.float64),
                    pair_true_class=np.asarray(state["pair_true_class"])[own],
                    pair_pred_class=np.asarray(state["pair_pred_class"])[own],
                    pair_momentum_residual=np.asarray(state["pair_momentum_residual"])[own],
                    pair_vertex_residual=np.asarray(state["pair_vertex_residual"])[own],
                )

    def per_event(self) -> dict[str, np.ndarray]:
        """event_id and every per-event metric, one row per event sorted by id (for a per-event table)."""
        state = self.state()
        return {"event_id": state["event_id"], **dict(zip(EVENT_METRICS, state["event_values"].T))}

    def confusion_matrix(self) -> np.ndarray:
        """(C, C) counts of detection matches: rows the true instance's class, columns the predicted's."""
        return self._confusion(self.state())

    def _confusion(self, state: dict[str, np.ndarray]) -> np.ndarray:
        t, p = state["pair_true_class"], state["pair_pred_class"]
        known = (t >= 0) & (p >= 0)
        c = self.num_classes
        return np.bincount(t[known] * c + p[known], minlength=c * c).reshape(c, c)

    def result(self) -> dict[str, float]:
        """Flat dict of floats: every per-event metric averaged over the events where it is defined
        (with `<name>_events`), then the pooled ones (module docstring); `events`, `pid_pairs`,
        `momentum_pairs[_<class>]` and `vertex_pairs` count what went into them."""
        state = self.state()  # sorted by event id: the same reduction order however events were split
        out: dict[str, float] = {"events": float(len(state["event_id"]))}
        for name, column in zip(EVENT_METRICS, state["event_values"].T):
            defined = column[~np.isnan(column)]
            out[name] = _mean_or_nan(defined)
            out[f"{name}_events"] = float(len(defined))
            out[f"{name}_sem"] = _standard_error(defined)

        n_true, n_pred, matched, iou_sum = map(float, state["detection_counts"].sum(axis=0))
        out["detection_precision_pooled"] = matched / n_pred if n_pred else _NAN
        out["detection_recall_pooled"] = matched / n_true if n_true else _NAN
        out["detection_f1_pooled"] = 2 * matched / (n_true + n_pred) if n_true + n_pred else _NAN
        out["matched_iou_pooled"] = iou_sum / matched if matched else _NAN
        pred_best, pred_points, true_best, true_points = map(float, state["cluster_points"].sum(axis=0))
        out["purity_pooled"] = pred_best / pred_points if pred_points else _NAN
        out["efficiency_pooled"] = true_best / true_points if true_points else _NAN

        confusion = self._confusion(state).astype(np.float64)
        tp, truth, predicted = np.diag(confusion), confusion.sum(1), confusion.sum(0)
        present = truth + predicted > 0
        precision = np.where(predicted > 0, tp / np.maximum(predicted, 1), 0.0)
        recall = np.where(truth > 0, tp / np.maximum(truth, 1), 0.0)
        f1 = 2 * tp / np.maximum(truth + predicted, 1)
        for name, per_class in (("pid_precision", precision), ("pid_recall", recall), ("pid_f1", f1)):
            out[name] = _mean_or_nan(per_class[present])
        out["pid_pairs"] = float(confusion.sum())

        pq, sq, rq, present = panoptic_quality(state["pq_counts"].sum(axis=0))
        for name, per_class in (("pq_pooled", pq), ("sq_pooled", sq), ("rq_pooled", rq)):
            out[name] = _mean_or_nan(per_class[present])
            for c, label in enumerate(self.class_names):
                out[f"{name}_{label}"] = float(per_class[c]) if present[c] else _NAN

        momentum, true_class = state["pair_momentum_residual"], state["pair_true_class"]
        known = ~np.isnan(momentum)
        groups = [("", known)] + [(f"_{label}", known & (true_class == c)) for c, label in enumerate(self.class_names)]
        for suffix, keep in groups:
            r = momentum[keep]
            out[f"momentum_bias{suffix}"] = _mean_or_nan(r)
            out[f"momentum_rms{suffix}"] = float(np.sqrt((r * r).mean())) if len(r) else _NAN
            out[f"momentum_pairs{suffix}"] = float(len(r))

        vertex = state["pair_vertex_residual"]
        vertex = vertex[~np.isnan(vertex)]
        out["vertex_residual_median"] = float(np.median(vertex)) if len(vertex) else _NAN
        out["vertex_residual_q68"] = float(np.quantile(vertex, 0.68)) if len(vertex) else _NAN
        out["vertex_pairs"] = float(len(vertex))
        return out


def paired_differences(first: PanopticAccumulator, second: PanopticAccumulator) -> dict[str, float]:
    """Every per-event metric of `first` minus the same event's of `second`, over the events both counted and
    both define it: `<name>` the mean difference, `<name>_sem` its standard error, `<name>_events` how many events
    (module docstring). ValueError when the two share no event."""
    a, b = first.state(), second.state()
    common, rows_a, rows_b = np.intersect1d(a["event_id"], b["event_id"], return_indices=True)
    if not len(common):
        raise ValueError(f"the two accumulators share no event ({len(a['event_id'])} and {len(b['event_id'])} "
                         "events): paired differences need the same events scored by both")
    difference = a["event_values"][rows_a] - b["event_values"][rows_b]
    out: dict[str, float] = {"events": float(len(common))}
    for name, column in zip(EVENT_METRICS, difference.T):
        defined = column[~np.isnan(column)]
        out[name] = _mean_or_nan(defined)
        out[f"{name}_events"] = float(len(defined))
        out[f"{name}_sem"] = _standard_error(defined)
    return out
