"""Panoptic / clustering metrics: ARI and AMI against scikit-learn, the instance metrics on
hand-worked events, and exact aggregation however the events are split over accumulators."""

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score, precision_recall_fscore_support

from pimm import panoptic_metrics
from pimm.panoptic_metrics import (
    EVENT_METRICS,
    PanopticAccumulator,
    adjusted_mutual_information,
    adjusted_rand_index,
    evaluate_event,
    instance_overlap,
    match_instances,
    paired_differences,
)

# The hand-worked event (11 points). True instances T0 = points 0-3 (class 0), T1 = 4-5 and T2 = 6
# (class 1); points 7-10 are true stuff (class 2). Predicted P5 = points 0,1,2,7 and P7 = 3,4,5, both
# class 0; points 6, 8, 9, 10 predicted stuff (class 2). Overlaps: T0∩P5 = 3, T0∩P7 = 1, T1∩P7 = 2.
TRUE_INSTANCE = np.array([0, 0, 0, 0, 1, 1, 2, -1, -1, -1, -1])
PRED_INSTANCE = np.array([5, 5, 5, 7, 7, 7, -1, 5, -1, -1, -1])
TRUE_CLASS = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
PRED_CLASS = np.array([0, 0, 0, 0, 0, 0, 2, 0, 2, 2, 2])
# momentum: T0 100, T1 200; P5 110, P7 150. vertex: T0 at 0, T1 at (1, 1, 1); P5 at (3, 4, 0), P7 at (1, 1, 1)
TRUE_MOMENTUM = np.array([100, 100, 100, 100, 200, 200, 50, 0, 0, 0, 0], dtype=float)
PRED_MOMENTUM = np.array([110, 110, 110, 150, 150, 150, 0, 110, 0, 0, 0], dtype=float)
TRUE_VERTEX = np.array([[0, 0, 0]] * 4 + [[1, 1, 1]] * 3 + [[0, 0, 0]] * 4, dtype=float)
PRED_VERTEX = np.array([[3, 4, 0]] * 3 + [[1, 1, 1]] * 3 + [[0, 0, 0]] + [[3, 4, 0]] + [[0, 0, 0]] * 3, dtype=float)


def hand_event(**extra):
    return evaluate_event(TRUE_INSTANCE, PRED_INSTANCE, TRUE_CLASS, PRED_CLASS, num_classes=3, stuff_classes=(2,),
                          **extra)


def random_event(rng, n=None, with_extras=True):
    """An event of a few true instances, predictions that mostly follow them, stuff and classes."""
    n = int(rng.integers(0, 400)) if n is None else n
    true_instance = rng.integers(-1, int(rng.integers(1, 9)), n)
    noise = rng.random(n) < rng.uniform(0, 0.5)
    pred_instance = np.where(noise, rng.integers(-1, 10, n), true_instance + int(rng.integers(0, 3)))
    pred_instance[true_instance < 0] = np.where(rng.random(int((true_instance < 0).sum())) < 0.7, -1, 3)
    true_class = np.where(true_instance < 0, 4, (true_instance * 7) % 4)
    true_class[rng.random(n) < 0.05] = -1  # a few unknown points
    pred_class = np.where(rng.random(n) < 0.8, np.maximum(true_class, 0), rng.integers(0, 5, n))
    extra = {}
    if with_extras:
        extra = dict(true_momentum=np.abs(true_instance) * 10.0 + 5, pred_momentum=np.abs(pred_instance) * 10.0 + 7,
                     true_vertex=np.outer(true_instance, [1.0, 2.0, 0.5]),
                     pred_vertex=np.outer(pred_instance, [1.0, 2.1, 0.5]))
    return (true_instance, pred_instance, true_class, pred_class), extra


def same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


# ---------------------------------------------------------------- ARI / AMI against scikit-learn


def test_ari_and_ami_match_sklearn_on_random_labellings():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(2, 500))
        labels_true = rng.integers(0, int(rng.integers(1, 15)), n)
        labels_pred = rng.integers(-1, int(rng.integers(1, 15)), n) * 1000  # sparse, negative ids: relabelled
        assert adjusted_rand_index(labels_true, labels_pred) == pytest.approx(
            adjusted_rand_score(labels_true, labels_pred), abs=1e-12)
        assert adjusted_mutual_information(labels_true, labels_pred) == pytest.approx(
            adjusted_mutual_info_score(labels_true, labels_pred), abs=1e-10)


def test_ari_and_ami_match_sklearn_on_large_close_labellings():
    # the expected-MI sum left out terms past 5 sqrt(min size) of their mean: still sklearn's value
    rng = np.random.default_rng(1)
    labels_true = rng.integers(0, 30, 20000)
    labels_pred = np.where(rng.random(20000) < 0.85, labels_true, rng.integers(0, 35, 20000))
    assert adjusted_rand_index(labels_true, labels_pred) == pytest.approx(
        adjusted_rand_score(labels_true, labels_pred), abs=1e-12)
    assert adjusted_mutual_information(labels_true, labels_pred) == pytest.approx(
        adjusted_mutual_info_score(labels_true, labels_pred), abs=1e-10)


@pytest.mark.parametrize(("labels_true", "labels_pred", "ari", "ami"), [
    ([], [], 1.0, 1.0),  # no points: sklearn's 1.0
    ([3], [8], 1.0, 1.0),  # one point
    ([0, 0, 0, 0], [1, 1, 1, 1], 1.0, 1.0),  # one cluster each
    ([0, 1, 2, 3], [9, 8, 7, 6], 1.0, 1.0),  # all singletons each
    ([0, 0, 0, 0], [0, 1, 2, 3], 0.0, 0.0),  # one cluster against singletons
    ([0, 1, 2, 3], [0, 0, 0, 0], 0.0, 0.0),
    ([0, 0, 1, 1], [1, 1, 0, 0], 1.0, 1.0),  # the same partition under other names
])
def test_degenerate_labellings_match_sklearn(labels_true, labels_pred, ari, ami):
    assert adjusted_rand_index(np.array(labels_true, int), np.array(labels_pred, int)) == ari
    assert adjusted_mutual_information(np.array(labels_true, int), np.array(labels_pred, int)) == ami
    assert adjusted_rand_score(labels_true, labels_pred) == ari
    assert adjusted_mutual_info_score(labels_true, labels_pred) == pytest.approx(ami)


def test_event_ari_conventions_pick_their_points():
    m = hand_event().metrics()
    # all labelled: points 0-6 (true instance >= 0); predicted stuff (-1) at point 6 is one cluster
    assert m["ari_all_labelled"] == pytest.approx(adjusted_rand_score(TRUE_INSTANCE[:7], PRED_INSTANCE[:7]))
    assert m["ami_all_labelled"] == pytest.approx(adjusted_mutual_info_score(TRUE_INSTANCE[:7], PRED_INSTANCE[:7]))
    # predicted things: points 0-5 and 7 (pred instance >= 0); true stuff point 7 stays in as true cluster -1
    things = [0, 1, 2, 3, 4, 5, 7]
    assert m["ari_predicted_things"] == pytest.approx(adjusted_rand_score(TRUE_INSTANCE[things], PRED_INSTANCE[things]))
    assert m["ari_predicted_things"] != m["ari_all_labelled"]


# ---------------------------------------------------------------- hand-worked instance metrics


def test_purity_efficiency_dice_detection_by_hand():
    m = hand_event().metrics()
    # purity: P5 3/4 (3 of its 4 points in T0), P7 2/3 (2 of 3 in T1) -> (3/4 + 2/3) / 2 = 17/24
    assert m["purity"] == pytest.approx(17 / 24)
    # efficiency: T0 3/4, T1 2/2, T2 0/1 (only predicted stuff) -> (3/4 + 1 + 0) / 3 = 7/12
    assert m["efficiency"] == pytest.approx(7 / 12)
    # Dice 2|T∩P|/(|T|+|P|): T0-P5 6/8, T0-P7 2/7, T1-P7 4/5. best per true: 3/4, 4/5, 0 -> 31/60;
    # best per predicted: 3/4, 4/5 -> 31/40; symmetric (31/60 + 31/40) / 2 = 31/48
    assert m["dice"] == pytest.approx(31 / 48)
    # IoU: T0-P5 3/5, T1-P7 2/3 match (T0-P7 1/6 does not): 2 matches, 2 predicted, 3 true
    assert m["detection_precision"] == 1.0
    assert m["detection_recall"] == pytest.approx(2 / 3)
    assert m["detection_f1"] == pytest.approx(2 * 2 / (2 + 3))  # 4/5
    assert m["matched_iou"] == pytest.approx((3 / 5 + 2 / 3) / 2)  # 19/30


def test_point_weighted_purity_and_efficiency_pool_every_instance():
    acc = PanopticAccumulator(3, stuff_classes=(2,))
    acc.update(0, TRUE_INSTANCE, PRED_INSTANCE, TRUE_CLASS, PRED_CLASS)
    # purity: (3 + 2) of (4 + 3) predicted points; efficiency: (3 + 2 + 0) of (4 + 2 + 1) true points
    r = acc.result()
    assert r["purity_pooled"] == pytest.approx(5 / 7) and r["efficiency_pooled"] == pytest.approx(5 / 7)
    # a second event of one true instance split into pieces of 5, 2, 1, 1 and 1 points: the mean over
    # instances counts the pieces as pure instances, the pooled value by their points
    true, pred = np.zeros(10, int), np.array([0] * 5 + [1] * 2 + [2, 3, 4])
    acc.update(1, true, pred, np.zeros(10, int), np.zeros(10, int))
    assert acc.per_event()["purity"][1] == 1.0 and acc.per_event()["efficiency"][1] == pytest.approx(0.5)
    r = acc.result()
    assert r["purity_pooled"] == pytest.approx((5 + 10) / (7 + 10))
    assert r["efficiency_pooled"] == pytest.approx((5 + 5) / (7 + 10))
    # an event without predicted instances adds true points only
    acc.update(2, true, np.full(10, -1), np.zeros(10, int), np.full(10, 2))
    assert acc.result()["purity_pooled"] == r["purity_pooled"]
    assert acc.result()["efficiency_pooled"] == pytest.approx((5 + 5) / (7 + 10 + 10))
    assert math.isnan(PanopticAccumulator(3).result()["purity_pooled"])


def test_panoptic_quality_by_hand():
    m = hand_event().metrics()
    # class 0: T0 vs P5 (IoU 3/5) TP, P7 FP -> PQ 0.6 / (1 + 1/2) = 0.4, SQ 0.6, RQ 2/3
    # class 1: T1, T2 unmatched (the predictions are class 0) -> FN 2: PQ = SQ = RQ = 0
    # class 2 (stuff): true {7,8,9,10} vs predicted {6,8,9,10}, IoU 3/5 -> TP: PQ 0.6, SQ 0.6, RQ 1
    assert m["pq"] == pytest.approx((0.4 + 0 + 0.6) / 3)
    assert m["sq"] == pytest.approx((0.6 + 0 + 0.6) / 3)
    assert m["rq"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    acc = PanopticAccumulator(3, stuff_classes=(2,), class_names=("track", "shower", "led"))
    acc.update(0, TRUE_INSTANCE, PRED_INSTANCE, TRUE_CLASS, PRED_CLASS)
    r = acc.result()
    assert r["pq_pooled_track"] == pytest.approx(0.4) and r["rq_pooled_track"] == pytest.approx(2 / 3)
    assert r["pq_pooled_shower"] == 0.0 and r["pq_pooled_led"] == pytest.approx(0.6)
    assert r["pq_pooled"] == pytest.approx(1 / 3)


def test_panoptic_match_needs_iou_above_half_and_drops_void_points():
    # stuff class 1: true {0,1,2}, predicted {1,2,3}: IoU 2/4 = 0.5 is not a match (Kirillov: > 0.5)
    true_class, pred_class = np.array([1, 1, 1, 0]), np.array([0, 1, 1, 1])
    none = np.full(4, -1)
    m = evaluate_event(none, none, true_class, pred_class, num_classes=2, stuff_classes=(1,)).metrics()
    assert m["pq"] == 0.0 and m["rq"] == 0.0
    # point 3 unknown (void) is removed: predicted {1,2} against true {0,1,2}, IoU 2/3 -> TP
    true_class[3] = -1
    m = evaluate_event(none, none, true_class, pred_class, num_classes=2, stuff_classes=(1,)).metrics()
    assert m["pq"] == pytest.approx(2 / 3) and m["rq"] == 1.0


def test_matching_at_exactly_half_is_one_to_one():
    # P0 = {0, 1} against T0 = {0} and T1 = {1}: both IoU 1/2; one match, the smaller true id
    overlap = instance_overlap(np.array([0, 1]), np.array([0, 0]))
    chosen = match_instances(overlap, 0.5)
    assert overlap.true_index[chosen].tolist() == [0] and overlap.pred_index[chosen].tolist() == [0]
    assert len(match_instances(overlap, 0.5, strict=True)) == 0


def test_pid_confusion_momentum_vertex_by_hand():
    acc = PanopticAccumulator(3, stuff_classes=(2,))
    acc.update(7, TRUE_INSTANCE, PRED_INSTANCE, TRUE_CLASS, PRED_CLASS, true_momentum=TRUE_MOMENTUM,
               pred_momentum=PRED_MOMENTUM, true_vertex=TRUE_VERTEX, pred_vertex=PRED_VERTEX)
    # matches: T0 (class 0) - P5 (class 0), T1 (class 1) - P7 (class 0)
    assert acc.confusion_matrix().tolist() == [[1, 0, 0], [1, 0, 0], [0, 0, 0]]
    r = acc.result()
    # class 0: precision 1/2, recall 1/1, F1 2/3; class 1: precision 0 (none predicted), recall 0, F1 0
    assert r["pid_precision"] == pytest.approx(1 / 4)
    assert r["pid_recall"] == pytest.approx(1 / 2)
    assert r["pid_f1"] == pytest.approx(1 / 3)
    sk = precision_recall_fscore_support([0, 1], [0, 0], average="macro", zero_division=0)
    assert (r["pid_precision"], r["pid_recall"], r["pid_f1"]) == pytest.approx(sk[:3])
    # momentum (pred - true) / true: T0 (110 - 100) / 100 = 0.1, T1 (150 - 200) / 200 = -0.25
    assert r["momentum_bias_0"] == pytest.approx(0.1) and r["momentum_rms_0"] == pytest.approx(0.1)
    assert r["momentum_bias_1"] == pytest.approx(-0.25) and r["momentum_rms_1"] == pytest.approx(0.25)
    assert r["momentum_bias"] == pytest.approx(-0.075)
    assert r["momentum_rms"] == pytest.approx(math.sqrt((0.1**2 + 0.25**2) / 2))
    assert r["momentum_pairs_2"] == 0.0 and math.isnan(r["momentum_bias_2"])
    # vertex: |(3,4,0) - 0| = 5 and 0 -> median 2.5, 68% quantile 0 + 0.68 * 5 = 3.4
    assert r["vertex_residual_median"] == pytest.approx(2.5)
    assert r["vertex_residual_q68"] == pytest.approx(3.4)


def test_undefined_values_are_nan_and_left_out_of_means():
    acc = PanopticAccumulator(3, stuff_classes=(2,))
    acc.update(0, TRUE_INSTANCE, PRED_INSTANCE, TRUE_CLASS, PRED_CLASS)
    # nothing predicted as a thing: no predicted-things ARI, precision or purity for this event
    acc.update(1, TRUE_INSTANCE, np.full(11, -1), TRUE_CLASS, np.full(11, 2))
    acc.update(2, np.zeros(0, int), np.zeros(0, int), np.zeros(0, int), np.zeros(0, int))  # an empty event
    nothing = acc.per_event()
    assert math.isnan(nothing["ari_predicted_things"][1]) and nothing["detection_recall"][1] == 0.0
    assert all(math.isnan(nothing[name][2]) for name in EVENT_METRICS)
    r = acc.result()
    assert r["events"] == 3.0 and r["ari_predicted_things_events"] == 1.0 and r["detection_recall_events"] == 2.0
    assert r["detection_recall"] == pytest.approx((2 / 3 + 0) / 2)
    assert r["purity"] == pytest.approx(17 / 24) and math.isnan(r["vertex_residual_median"])
    # pooled over events (the published evaluator's way): 3 + 3 true, 2 + 0 predicted, 2 matches
    assert r["detection_precision_pooled"] == 1.0 and r["detection_recall_pooled"] == pytest.approx(2 / 6)
    assert r["detection_f1_pooled"] == pytest.approx(2 * 2 / (6 + 2))
    assert r["matched_iou_pooled"] == pytest.approx((3 / 5 + 2 / 3) / 2)


def test_each_mean_over_events_has_its_standard_error_and_two_methods_compare_event_by_event():
    """The standard error of an ARI mean over 4 events, worked from scikit-learn's per-event ARIs; two methods on
    the same events: the mean per-event difference, its standard error (smaller than either mean's when the events
    move both alike), only over the events both scored; none in common is refused."""
    rng = np.random.default_rng(11)
    first, second = PanopticAccumulator(5, stuff_classes=(4,)), PanopticAccumulator(5, stuff_classes=(4,))
    ari_first, ari_second = [], []
    for event_id in range(5):
        (true_instance, pred_instance, true_class, pred_class), _ = random_event(rng, n=200, with_extras=False)
        worse = np.where(rng.random(200) < 0.2, 7, pred_instance)  # the second method: 20 % of points to one instance
        labelled = true_instance >= 0
        if event_id < 4:  # event 4 only the second method scores
            first.update(event_id, true_instance, pred_instance, true_class, pred_class)
            ari_first.append(adjusted_rand_score(true_instance[labelled], pred_instance[labelled]))
        second.update(event_id, true_instance, worse, true_class, pred_class)
        ari_second.append(adjusted_rand_score(true_instance[labelled], worse[labelled]))
    ari_first, ari_second = np.array(ari_first), np.array(ari_second)
    r = first.result()
    assert r["ari_all_labelled"] == pytest.approx(ari_first.mean())
    assert r["ari_all_labelled_sem"] == pytest.approx(ari_first.std(ddof=1) / 2)  # sqrt(4 events)
    difference = ari_first - ari_second[:4]
    d = paired_differences(first, second)
    assert d["events"] == 4.0 and d["ari_all_labelled_events"] == 4.0
    assert d["ari_all_labelled"] == pytest.approx(difference.mean())
    assert d["ari_all_labelled_sem"] == pytest.approx(difference.std(ddof=1) / 2)
    assert d["ari_all_labelled_sem"] < r["ari_all_labelled_sem"]  # the events' spread cancels in the difference
    assert paired_differences(second, first)["ari_all_labelled"] == pytest.approx(-difference.mean())
    one = PanopticAccumulator(5, stuff_classes=(4,))
    one.update(0, *random_event(rng, n=50, with_extras=False)[0])
    assert math.isnan(one.result()["ari_all_labelled_sem"])  # one event: no spread to estimate
    other = PanopticAccumulator(5, stuff_classes=(4,))
    other.update(9, *random_event(rng, n=50, with_extras=False)[0])
    with pytest.raises(ValueError, match="share no event"):
        paired_differences(one, other)


# ---------------------------------------------------------------- aggregation over ranks


def test_any_split_over_accumulators_gives_identical_results():
    rng = np.random.default_rng(3)
    events = [random_event(rng) for _ in range(14)]
    whole = PanopticAccumulator(5, stuff_classes=(4,))
    for event_id, (arrays, extra) in enumerate(events):
        whole.update(event_id, *arrays, **extra)
    expected = whole.result()
    assert expected["events"] == 14 and expected["vertex_pairs"] > 0 and expected["momentum_pairs"] > 0
    for split in range(4):
        ranks = [PanopticAccumulator(5, stuff_classes=(4,)) for _ in range(2)]
        order = rng.permutation(14)
        for position, event_id in enumerate(order):
            arrays, extra = events[event_id]
            ranks[int(rng.integers(0, 2)) if split else position % 2].update(event_id, *arrays, **extra)
        padded = order[: int(rng.integers(1, 4))]  # a sampler's padding: events seen by both ranks
        for event_id in padded:
            for rank in ranks:
                rank.update(event_id, *events[event_id][0], **events[event_id][1])
        merged = PanopticAccumulator(5, stuff_classes=(4,))
        merged.merge([rank.state() for rank in ranks[::-1]])
        result = merged.result()
        assert result.keys() == expected.keys()
        assert all(same(result[k], expected[k]) for k in expected), split
        assert (merged.confusion_matrix() == whole.confusion_matrix()).all()


def test_update_and_merge_count_an_event_once():
    acc = PanopticAccumulator(3, stuff_classes=(2,))
    assert acc.update(4, TRUE_INSTANCE, PRED_INSTANCE, TRUE_CLASS, PRED_CLASS)
    assert not acc.update(4, TRUE_INSTANCE, np.full(11, -1), TRUE_CLASS, PRED_CLASS)
    acc.merge([acc.state(), acc.state()])
    assert len(acc) == 1 and acc.result()["detection_precision"] == 1.0
    with pytest.raises(ValueError, match="4 classes"):
        acc.merge([PanopticAccumulator(4).state()])
    with pytest.raises(ValueError, match="lacks"):
        acc.merge([{"event_id": np.zeros(1, int)}])


def test_bad_inputs_say_what_was_wrong():
    with pytest.raises(ValueError, match=r"pred_instance has shape \(3,\)"):
        evaluate_event(np.zeros(4, int), np.zeros(3, int), np.zeros(4, int), np.zeros(4, int), num_classes=2)
    with pytest.raises(ValueError, match="class 5, outside 0..2"):
        evaluate_event(np.zeros(2, int), np.zeros(2, int), np.array([0, 5]), np.zeros(2, int), num_classes=3)
    with pytest.raises(ValueError, match="integer ids"):
        evaluate_event(np.zeros(2), np.zeros(2, int), np.zeros(2, int), np.zeros(2, int), num_classes=3)
    with pytest.raises(ValueError, match="both true_momentum and pred_momentum"):
        evaluate_event(*(np.zeros(2, int),) * 4, num_classes=3, true_momentum=np.ones(2))
    with pytest.raises(ValueError, match="outside 0..2"):
        PanopticAccumulator(3, stuff_classes=(3,))


def test_an_event_of_100k_points_takes_well_under_a_second():
    rng = np.random.default_rng(5)
    n = 100_000
    true_instance = rng.integers(-1, 40, n)
    pred_instance = np.where(rng.random(n) < 0.9, true_instance, rng.integers(-1, 45, n))
    arrays = (true_instance, pred_instance, rng.integers(-1, 6, n), rng.integers(0, 6, n))
    extra = dict(true_momentum=rng.random(n), pred_momentum=rng.random(n), true_vertex=rng.random((n, 3)),
                 pred_vertex=rng.random((n, 3)))
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        evaluate_event(*arrays, num_classes=6, stuff_classes=(5,), **extra)
        best = min(best, time.perf_counter() - start)
    assert best < 1.0, f"{best:.2f} s for one event of 100k points"


def test_module_imports_without_torch():
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, str(Path(panoptic_metrics.__file__))], check=True)
