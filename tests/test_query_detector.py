"""The query detector, its Hungarian matching and losses, and its post-processing, on small CPU cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pimm.errors import ConfigError
from pimm.models import query_detector
from pimm.models.query_detector import (
    ANCHOR_SCALE_START,
    DecoderOutput,
    EventPrediction,
    LayerPrediction,
    QueryDetector,
    connected_pieces,
    farthest_points,
    instances_from_queries,
    join_collinear,
)
from pimm.tasks.panoptic_loss import (
    DetectorLossWeights,
    MatchedMaskLosses,
    detector_event_losses,
    detector_loss,
    event_targets,
    hungarian_match,
    matching_cost,
)

NUM_CLASSES = 3
EVENT_SIZES = (7, 12, 9)


def small_detector(**options) -> QueryDetector:
    torch.manual_seed(0)
    return QueryDetector(in_channels=5, num_classes=NUM_CLASSES, num_queries=6, hidden_channels=32, num_heads=4,
                         depth=3, **options)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Features, coordinates, offset and per-event targets (instances, -1 stuff, momentum, vertex)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(EVENT_SIZES)
    feat, coord = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    offset = torch.tensor(EVENT_SIZES).cumsum(0)
    targets = []
    for size in EVENT_SIZES:
        instance = torch.randint(-1, 3, (size,), generator=g)
        point_class = torch.randint(0, NUM_CLASSES, (size,), generator=g)
        targets.append(event_targets(instance, point_class, torch.rand(size, generator=g),
                                     torch.rand(size, 3, generator=g)))
    return feat, coord, offset, targets


@pytest.mark.parametrize("query_type", ["learned", "anchored"])
def test_events_never_mix(query_type):
    model = small_detector(momentum_head=True, query_type=query_type).eval()
    feat, coord, offset, _ = batch()
    together = model(feat, offset, coord)
    start = 0
    for b, size in enumerate(EVENT_SIZES):
        alone = model(feat[start:start + size], torch.tensor([size]), coord[start:start + size]).event(0)
        for layer_alone, layer_together in zip(alone.layers, together.event(b).layers):
            assert layer_together.mask_logits.shape == (6, size)
            torch.testing.assert_close(layer_alone.mask_logits, layer_together.mask_logits)
            torch.testing.assert_close(layer_alone.class_logits, layer_together.class_logits)
            torch.testing.assert_close(layer_alone.momentum, layer_together.momentum)
        start += size


@pytest.mark.parametrize("query_type", ["learned", "anchored"])
def test_reading_some_rows_equals_decoding_those_rows_alone(query_type):
    model = small_detector(query_type=query_type).eval()
    feat, coord, offset, _ = batch()
    event = torch.repeat_interleave(torch.arange(len(EVENT_SIZES)), torch.tensor(EVENT_SIZES))
    rows = torch.tensor([n for n in range(len(feat)) if n % 3 != 1])
    read_offset = torch.bincount(event[rows], minlength=len(EVENT_SIZES)).cumsum(0)
    picked = model(feat, read_offset, coord, rows=rows)
    alone = model(feat[rows], read_offset, coord[rows])
    for layer_picked, layer_alone in zip(picked.layers, alone.layers):
        torch.testing.assert_close(layer_picked.mask_logits, layer_alone.mask_logits)
        torch.testing.assert_close(layer_picked.class_logits, layer_alone.class_logits)


def test_permuted_queries_give_the_same_loss():
    model = small_detector(momentum_head=True, vertex_head=True)
    feat, coord, offset, targets = batch()
    loss, _ = detector_loss(model(feat, offset, coord), targets, generator=torch.Generator().manual_seed(3))
    permutation = torch.tensor([4, 2, 0, 5, 1, 3])
    with torch.no_grad():
        model.query_feat.weight.copy_(model.query_feat.weight[permutation])
        model.query_embed.weight.copy_(model.query_embed.weight[permutation])
    permuted = model(feat, offset, coord)
    permuted_loss, _ = detector_loss(permuted, targets, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(permuted_loss, loss)


def test_batched_loss_equals_each_event_alone():
    """The loss pads a batch's events to one length; each event's loss is the one it has alone, also where
    its matching draws match_points of its points."""
    model = small_detector(momentum_head=True, vertex_head=True)
    feat, coord, offset, targets = batch()
    weights = DetectorLossWeights(match_points=5)
    assert sum(int((t.instance >= 0).sum()) > 5 for t in targets) >= 2  # the drawn path is taken
    together, _ = detector_event_losses(model(feat, offset, coord), targets, weights,
                                        [torch.Generator().manual_seed(b) for b in range(len(targets))])
    start = 0
    for b, size in enumerate(EVENT_SIZES):
        alone = model(feat[start:start + size], torch.tensor([size]), coord[start:start + size])
        loss, _ = detector_event_losses(alone, [targets[b]], weights, [torch.Generator().manual_seed(b)])
        torch.testing.assert_close(loss[0], together[b])
        start += size


def test_obvious_matching_and_near_zero_mask_loss():
    instance = torch.tensor([0, 0, 0, 1, 1, -1])
    targets = event_targets(instance, torch.tensor([2, 2, 2, 0, 0, 1]))
    assert targets.instance_class.tolist() == [2, 0]
    # query 0 draws target 1's mask, query 2 target 0's; query 1 says no-object
    mask_logits = torch.full((3, 6), -12.0)
    mask_logits[0, 3:5] = 12.0
    mask_logits[2, :3] = 12.0
    class_logits = torch.full((3, NUM_CLASSES + 1), -12.0)
    class_logits[0, 0] = class_logits[1, NUM_CLASSES] = class_logits[2, 2] = 12.0
    labelled = instance >= 0
    query, target = hungarian_match(class_logits, mask_logits[:, labelled], targets.instance_class,
                                    targets.masks[:, labelled])
    assert (query.tolist(), target.tolist()) == ([2, 0], [0, 1])

    prediction = EventPrediction(final=LayerPrediction(class_logits, mask_logits), aux=[])
    _, terms = detector_loss(DecoderOutput.from_events([prediction]), [targets])
    assert terms["focal"] < 1e-6 and terms["dice"] < 1e-4 and terms["class"] < 1e-4


def test_matching_cost_is_the_published_cost_of_each_pair_over_the_kept_points():
    """Every (query, instance) cost against the matcher's formula written out for one pair at a time: the mean over
    the kept points of the sigmoid focal loss, the dice loss, and -log of the class probability without no-object;
    padding logits (-1e4) outside the kept points change nothing."""
    g = torch.Generator().manual_seed(5)
    num_events, num_queries, num_instances, num_points = 2, 5, 3, 40
    weights = DetectorLossWeights(cost_class=0.7, cost_mask=1.3, cost_dice=0.9, focal_alpha=0.3, focal_gamma=2.0)
    logits = 3 * torch.randn(num_events, num_queries, num_points, generator=g)
    logits[1, :, 30:] = -1e4  # the second event has 30 points
    keep = torch.rand(num_events, num_points, generator=g) < 0.8
    keep[1, 30:] = False
    instance = torch.randint(-1, num_instances, (num_events, num_points), generator=g)
    keep &= instance >= 0
    masks = (instance.unsqueeze(1) == torch.arange(num_instances).view(1, -1, 1)).float()
    class_logits = torch.randn(num_events, num_queries, NUM_CLASSES + 1, generator=g)
    instance_class = torch.randint(0, NUM_CLASSES, (num_events, num_instances), generator=g)
    cost = matching_cost(logits, class_logits, masks, instance_class, keep, weights)
    for b in range(num_events):
        for q in range(num_queries):
            x = logits[b, q, keep[b]].double()
            p = x.sigmoid()
            for t in range(num_instances):
                y = masks[b, t, keep[b]].double()
                p_true = p * y + (1 - p) * (1 - y)
                alpha = weights.focal_alpha * y + (1 - weights.focal_alpha) * (1 - y)
                focal = (alpha * (1 - p_true) ** 2 * -p_true.log()).mean()
                dice = 1 - (2 * (p * y).sum() + 1) / (p.sum() + y.sum() + 1)
                class_prob = class_logits[b, q, :NUM_CLASSES].double().softmax(0)[instance_class[b, t]]
                expected = weights.cost_mask * focal + weights.cost_dice * dice - weights.cost_class * class_prob.log()
                assert cost[b, q, t].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("gamma", [2.0, 1.5])
def test_matched_mask_losses_and_their_gradient_are_autograd_s_of_the_formulas(gamma):
    g = torch.Generator().manual_seed(9)
    logits = (4 * torch.randn(6, 50, generator=g, dtype=torch.float64)).requires_grad_()
    keep = (torch.rand(6, 50, generator=g) < 0.8).double()
    keep[2, 35:] = 0
    truth = (torch.rand(6, 50, generator=g) < 0.4).double() * keep
    padded = logits.detach().clone()
    padded[2, 35:] = -1e4  # points the decoder did not read: the padding logit, not kept
    padded.requires_grad_()
    alpha = 0.3
    focal, dice = MatchedMaskLosses.apply(padded, truth, keep, alpha, gamma)
    # the formulas through autograd, over the kept points only
    p = logits.sigmoid()
    p_true = p * truth + (1 - p) * (1 - truth)
    weight = alpha * truth + (1 - alpha) * (1 - truth)
    expected_focal = (weight * (1 - p_true) ** gamma * -p_true.log() * keep).sum(1) / keep.sum(1)
    expected_dice = 1 - (2 * (p * truth).sum(1) + 1) / ((p * keep).sum(1) + truth.sum(1) + 1)
    torch.testing.assert_close(focal, expected_focal)
    torch.testing.assert_close(dice, expected_dice)
    upstream = torch.randn(2, 6, generator=g, dtype=torch.float64)
    (upstream[0] * focal + upstream[1] * dice).sum().backward()
    (upstream[0] * expected_focal + upstream[1] * expected_dice).sum().backward()
    assert padded.grad[2, 35:].abs().max() == 0
    torch.testing.assert_close(padded.grad[keep > 0], logits.grad[keep > 0])
    assert logits.grad[keep == 0].abs().max() == 0


def test_matching_subsample_is_deterministic_given_the_generator():
    g = torch.Generator().manual_seed(0)
    mask_logits, class_logits = torch.randn(8, 50, generator=g), torch.randn(8, NUM_CLASSES + 1, generator=g)
    masks = torch.randint(0, 4, (50,), generator=g).unsqueeze(0) == torch.arange(4).unsqueeze(1)
    weights = DetectorLossWeights(match_points=10)
    runs = [hungarian_match(class_logits, mask_logits, torch.tensor([0, 1, 2, 0]), masks, weights,
                            torch.Generator().manual_seed(7)) for _ in range(2)]
    assert [t.tolist() for t in runs[0]] == [t.tolist() for t in runs[1]]
    assert len(runs[0][0]) == 4


@pytest.mark.parametrize("query_type", ["learned", "anchored"])
def test_gradients_reach_every_parameter(query_type):
    model = small_detector(momentum_head=True, vertex_head=True, query_type=query_type)
    feat, coord, offset, targets = batch()
    loss, terms = detector_loss(model(feat, offset, coord), targets)
    loss.backward()
    assert {"momentum", "vertex", "aux0_dice", "aux1_focal"} <= set(terms)
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_farthest_points_picks_the_first_point_then_the_farthest_never_padding():
    line = torch.zeros(2, 10, 3)
    line[0, :, 0] = torch.arange(10.0)  # event 0: ten points on a line
    line[1, :3, 1] = torch.tensor([0.0, 5.0, 1.0])  # event 1: three points, then padding (far away)
    line[1, 3:] = 100.0
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[1, 3:] = True
    picked = farthest_points(line, padding, 5)
    # event 0: 0, the far end 9, then 4 (4 from 0; 5 is as far, from 9: the first of a tie), 2 (2 from 0 and 4),
    # and 6 (2 from 4; 7 is as far, from 9)
    assert picked[0].tolist() == [0, 9, 4, 2, 6]
    # event 1: 0, 5.0 (row 1), 1.0 (row 2); then every point is picked: anchors repeat, padding never
    assert picked[1, :3].tolist() == [0, 1, 2] and set(picked[1].tolist()) <= {0, 1, 2}
    # under autocast (bfloat16 products would lose 1/256 of |x|^2) the picks are the same
    points = torch.rand(1, 500, 3, generator=torch.Generator().manual_seed(0)) * 2 - 1
    alone = farthest_points(points, torch.zeros(1, 500, dtype=torch.bool), 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert farthest_points(points, torch.zeros(1, 500, dtype=torch.bool), 32).tolist() == alone.tolist()


def test_anchored_masks_start_lowered_with_the_squared_distance_to_the_anchor():
    model = small_detector(query_type="anchored").eval()
    feat, coord, offset, _ = batch()
    anchored = model(feat, offset, coord)
    for block in model.blocks:
        torch.nn.init.constant_(block.anchor_scale.bias, -100.0)  # softplus(-100) ~ 0: no spatial term
    unanchored = model(feat, offset, coord)
    start = 0
    for b, size in enumerate(EVENT_SIZES):
        points = coord[start:start + size]
        anchor = points[farthest_points(points[None], torch.zeros(1, size, dtype=torch.bool), 6)[0]]
        expected = ANCHOR_SCALE_START * torch.cdist(anchor, points).square() / model.anchor_length ** 2
        # the first layer's masks come from the queries as they start: the term is all that differs
        first = unanchored.event(b).layers[0].mask_logits - anchored.event(b).layers[0].mask_logits
        torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)
        start += size
    assert {f"blocks.{i}.anchor_scale.weight" for i in range(3)} <= set(model.state_dict())
    assert not any("anchor" in name for name in small_detector().state_dict())  # learned: the published names


def test_event_targets_dense_ids_majority_class_and_means():
    targets = event_targets(torch.tensor([7, 7, 7, -1, 3, 3]), torch.tensor([1, 2, 1, 0, 0, 0]),
                            momentum=torch.tensor([1.0, 2.0, 3.0, 9.0, 5.0, 7.0]))
    assert targets.instance.tolist() == [1, 1, 1, -1, 0, 0]
    assert targets.instance_class.tolist() == [0, 1]
    assert targets.momentum.tolist() == [6.0, 2.0]


def test_post_processing_hand_made_event():
    big = 12.0
    mask_logits = torch.full((4, 8), -big)
    mask_logits[0, 0:4] = big  # class 0, the best score
    mask_logits[1, 3:6] = big  # class 1, overlaps query 0 at point 3: keeps points 4, 5
    mask_logits[1, 3] = 1.0  # and is less sure of point 3, so it scores lower than query 0
    mask_logits[3, [0, 1, 2, 3, 6, 7]] = big  # class 0 again, IoU 2/3 with query 0: matrix NMS drops it,
    class_logits = torch.full((4, NUM_CLASSES + 1), -big)  # else it would take points 6 and 7
    class_logits[0, 0] = class_logits[1, 1] = big
    class_logits[3, 0] = 0.0  # less sure than query 0
    class_logits[2, NUM_CLASSES] = big  # no-object
    result = instances_from_queries(class_logits, mask_logits)
    assert result.instance.tolist() == [0, 0, 0, 0, 1, 1, -1, -1]
    assert result.point_class.tolist() == [0, 0, 0, 0, 1, 1, -1, -1]
    assert result.query.tolist() == [0, 1] and result.instance_class.tolist() == [0, 1]
    assert result.score[0] > result.score[4] > 0.5 and result.score[6] == 0
    without_nms = instances_from_queries(class_logits, mask_logits, nms_sigma=0.0)
    assert without_nms.instance.tolist() == [0, 0, 0, 0, 2, 2, 1, 1]
    # published fill_uncovered: query 3, dropped by NMS, still makes an instance of the points nobody took
    filled = instances_from_queries(class_logits, mask_logits, fill_uncovered=True)
    assert filled.instance.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert filled.query.tolist() == [0, 1, 3] and len(filled.instance_score) == 3
    # points the stuff head calls stuff are in no mask: query 1 keeps 1 point, fewer than min_points
    thing = torch.tensor([True, True, True, True, False, False, True, True])
    limited = instances_from_queries(class_logits, mask_logits, thing=thing)
    assert limited.instance.tolist() == [0, 0, 0, 0, -1, -1, -1, -1] and limited.query.tolist() == [0]


def test_connected_pieces_cut_instances_where_their_points_are_apart_and_keep_thing_points_nobody_took(
        monkeypatch):
    """Points on a line, connected within 1.5: query 0's mask has a 4-point piece, a 3-point piece 17 away (an
    instance of its own at min_points 3) and a lone point (it stays); the free thing points 80-82 become an instance
    of query 2 (no candidate: no-object is its most probable class), class 0 (class 2 is stuff), its score that
    class's probability times its mean mask probability (0.5); the free points 4 (beside query 0's piece, not of it)
    and 100 (alone) and the stuff point 120 stay in no instance. Numbered again by decreasing score. A radius that
    would list more pairs than MAX_CONNECT_PAIRS is refused."""
    big = 12.0
    x = [0, 1, 2, 3, 4, 20, 21, 22, 40, 60, 61, 80, 81, 82, 100, 120]
    coord = torch.tensor([[v, 0.0, 0.0] for v in x])
    rows = {v: i for i, v in enumerate(x)}
    mask_logits = torch.full((4, len(x)), -big)
    mask_logits[0, [rows[v] for v in (0, 1, 2, 3, 20, 21, 22, 40)]] = big
    mask_logits[1, [rows[60], rows[61]]] = 2.0  # mean mask probability 0.88: scored below query 0
    mask_logits[2, [rows[80], rows[81], rows[82]]] = 0.0  # probability 0.5: in no mask (> 0.5 is)
    mask_logits[3, [rows[80], rows[81], rows[82]]] = -2.0
    class_logits = torch.full((4, NUM_CLASSES + 1), -big)
    class_logits[0, 0] = class_logits[1, 1] = big
    class_logits[2] = torch.tensor([3.0, -big, 4.0, 5.0])  # no-object, then stuff class 2, then class 0
    class_logits[3, NUM_CLASSES] = big
    thing = torch.ones(len(x), dtype=torch.bool)
    thing[rows[120]] = False
    published = instances_from_queries(class_logits, mask_logits, thing=thing)
    assert published.query.tolist() == [0, 1]
    found = connected_pieces(published, coord, class_logits, mask_logits, radius=1.5, min_points=3,
                             stuff_classes=(2,), thing=thing)
    by_x = dict(zip(x, found.instance.tolist()))
    assert [by_x[v] for v in x] == [0, 0, 0, 0, -1, 1, 1, 1, 0, 2, 2, 3, 3, 3, -1, -1]
    assert found.query.tolist() == [0, 0, 1, 2] and found.instance_class.tolist() == [0, 0, 1, 0]
    fill_score = float(class_logits[2].softmax(0)[0]) * 0.5
    assert found.instance_score[3] == pytest.approx(fill_score)
    assert found.instance_score[1] == published.instance_score[0] > found.instance_score[2] > fill_score
    assert found.point_class.tolist() == [found.instance_class[i] if i >= 0 else -1 for i in found.instance.tolist()]
    assert found.score[rows[81]] == pytest.approx(fill_score) and found.score[rows[4]] == 0
    # at min_points 4 the 3-point pieces stay where they are: the published instances, nothing filled
    kept = connected_pieces(published, coord, class_logits, mask_logits, radius=1.5, min_points=4,
                            stuff_classes=(2,), thing=thing)
    assert kept.instance.tolist() == published.instance.tolist() and kept.query.tolist() == [0, 1]
    # a radius that joins every instance's points into one piece; the free points 80-100 fill, 4 (76 from 80) not
    joined = connected_pieces(published, coord, class_logits, mask_logits, radius=30.0, min_points=3,
                              stuff_classes=(2,), thing=thing)
    assert joined.query.tolist() == [0, 1, 2]
    assert [joined.instance[rows[v]].item() for v in (4, 80, 100, 120)] == [-1, 2, 2, -1]
    # a radius that would list more pairs than memory allows is refused, counted before any is listed
    monkeypatch.setattr(query_detector, "MAX_CONNECT_PAIRS", 100)
    with pytest.raises(ConfigError, match=r"model.connect_radius=1e\+06 puts 120 pairs of points within reach in an "
                                          r"event of 16 points, more than 100 \(memory\): lower connect_radius"):
        connected_pieces(published, coord, class_logits, mask_logits, radius=1e6, min_points=3, thing=thing)


def test_join_collinear_joins_touching_instances_of_one_class_on_one_line_and_nothing_else():
    """Segments of unit-spaced points, touching where within 1.5: 4 (x -10..-1), 0 (x 0..9) and 1 (x 10..19) lie on
    the x axis, one class, and chain into one instance under 4, the best score; 2 (x = 20, y 1..10) touches 1 at a
    right angle; 3 (x 30..39) and 5 (x 40..49) touch on one line but differ in class; 6 (2 points, x 50..51) has no
    axis to compare."""
    segments = {4: ([(x, 0) for x in range(-10, 0)], 0, 0.95), 0: ([(x, 0) for x in range(10)], 0, 0.9),
                1: ([(x, 0) for x in range(10, 20)], 0, 0.8), 2: ([(20, y) for y in range(1, 11)], 0, 0.7),
                3: ([(x, 0) for x in range(30, 40)], 0, 0.6), 5: ([(x, 0) for x in range(40, 50)], 1, 0.5),
                6: ([(50, 0), (51, 0)], 1, 0.4)}
    position = np.array([[x, y, 0.0] for k in sorted(segments) for x, y in segments[k][0]])
    instance = np.concatenate([np.full(len(segments[k][0]), k) for k in sorted(segments)])
    instance = np.append(instance, -1)  # a point in no instance, beside instance 0
    position = np.vstack([position, [[5.0, 1.0, 0.0]]])
    instance_class = np.array([segments[k][1] for k in range(7)])
    score = np.array([segments[k][2] for k in range(7)])
    near = cKDTree(position).query_pairs(1.5, output_type="ndarray")
    joined = join_collinear(instance, near, position, instance_class, score, 0.9)
    assert dict(zip(instance.tolist(), joined.tolist())) == {4: 4, 0: 4, 1: 4, 2: 2, 3: 3, 5: 5, 6: 6, -1: -1}
    # a bent line: 1 turned 45 degrees away from 0 is not joined at 0.9 (cos 45 = 0.71), and is at 0.5
    bent = position.copy()
    bent[instance == 1] = [[9 + t, t, 0.0] for t in range(1, 11)]
    near = cKDTree(bent).query_pairs(1.5, output_type="ndarray")
    assert (join_collinear(instance, near, bent, instance_class, score, 0.9)[instance == 1] == 1).all()
    assert (join_collinear(instance, near, bent, instance_class, score, 0.5)[instance == 1] == 4).all()


def test_connected_pieces_with_collinear_joins_a_line_split_between_queries():
    """Query 0 takes x 0..5 and query 1 x 6..11 of one line, query 2 a branch at right angles from x = 11: with
    collinear 0.9 the line is one instance of query 0 (the better score; its points take that score) and the branch
    another, numbered 0 and 1; without, three instances."""
    big = 12.0
    points = [(x, 0) for x in range(12)] + [(11, y) for y in range(1, 6)]
    coord = torch.tensor([[x, y, 0.0] for x, y in points])
    mask_logits = torch.full((3, len(points)), -big)
    mask_logits[0, :6] = big
    mask_logits[1, 6:12] = 2.0
    mask_logits[2, 12:] = 1.0
    class_logits = torch.full((3, NUM_CLASSES + 1), -big)
    class_logits[:, 0] = big
    published = instances_from_queries(class_logits, mask_logits)
    assert published.query.tolist() == [0, 1, 2]
    apart = connected_pieces(published, coord, class_logits, mask_logits, radius=1.5, min_points=3)
    assert apart.instance.tolist() == published.instance.tolist()
    found = connected_pieces(published, coord, class_logits, mask_logits, radius=1.5, min_points=3, collinear=0.9)
    assert found.instance.tolist() == [0] * 12 + [1] * 5
    assert found.query.tolist() == [0, 2] and found.instance_class.tolist() == [0, 0]
    assert found.instance_score.tolist() == [published.instance_score[0], published.instance_score[2]]
    assert (found.score[:12] == published.instance_score[0]).all()


def test_wrong_inputs_say_what_to_do():
    model = small_detector()
    feat, coord, offset, targets = batch()
    with pytest.raises(ValueError, match="need coord"):
        model(feat, offset)
    with pytest.raises(ValueError, match="query_type='superpoint' is not allowed"):
        small_detector(query_type="superpoint")
    with pytest.raises(ValueError, match="anchor_length=0 must be > 0"):
        small_detector(query_type="anchored", anchor_length=0)
    with pytest.raises(ValueError, match="cumulative point count"):
        model(feat, torch.tensor([3, 100]), coord)
    with pytest.raises(ValueError, match="one EventTargets per event"):
        detector_loss(model(feat, offset, coord), targets[:2])
