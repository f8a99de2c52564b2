"""The published momentum detector (detector-v1m2): its momentum and IoU losses on hand-made cases, the predicted
IoU in the post-processing score, the published MomentumTransform, and gradients reaching the new heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO

from pimm.config import load_config
from pimm.data.transforms import build_transforms
from pimm.errors import ConfigError
from pimm.models import build_model
from pimm.models.query_detector import (
    DecoderOutput,
    EventPrediction,
    LayerPrediction,
    QueryDetector,
    instances_from_queries,
)
from pimm.tasks.panoptic_loss import DetectorLossWeights, detector_event_losses, detector_loss, event_targets

NUM_CLASSES = 3


def momentum_transform(momentum: np.ndarray) -> np.ndarray:
    event = {"coord": np.zeros((len(momentum), 3), np.float32), "momentum": momentum}
    return build_transforms([dict(type="MomentumTransform", keys=["momentum"])])(event, 0, 0, 0, {})["momentum"]


def test_momentum_transform_is_log10_of_positive_values_only():
    out = momentum_transform(np.array([1000.0, 0.5, 0.0, -1.0], np.float32))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [3.0, np.log10(0.5), 0.0, -1.0], rtol=1e-6)
    with pytest.raises(ConfigError, match="MomentumTransform keys"):
        build_transforms([dict(type="MomentumTransform", keys="momentum")])


def hand_made_event(query2_points: list[int]) -> tuple[DecoderOutput, list]:
    """6 points: instance 0 = points 0-2 (class 2), instance 1 = points 3-4 (class 0), point 5 stuff. Query 0
    draws instance 1, query 2 the points `query2_points`, query 1 says no-object. Momentum 100, 100, 1000 MeV
    (instance 0) and 10, 10 MeV (instance 1), made log10 p by MomentumTransform."""
    instance = torch.tensor([0, 0, 0, 1, 1, -1])
    momentum = torch.from_numpy(momentum_transform(np.array([100, 100, 1000, 10, 10, 5], np.float32)))
    targets = event_targets(instance, torch.tensor([2, 2, 2, 0, 0, 1]), momentum)
    mask_logits = torch.full((3, 6), -12.0)
    mask_logits[0, 3:5] = 12.0
    mask_logits[2, query2_points] = 12.0
    class_logits = torch.full((3, NUM_CLASSES + 1), -12.0)
    class_logits[0, 0] = class_logits[1, NUM_CLASSES] = class_logits[2, 2] = 12.0
    layer = LayerPrediction(class_logits, mask_logits, momentum=torch.tensor([1.5, 0.0, 2.0]),
                            iou=torch.tensor([0.9, 0.1, 0.6]))
    return DecoderOutput.from_events([EventPrediction(final=layer, aux=[])]), [targets]


def test_momentum_loss_by_hand_in_log10_space():
    output, targets = hand_made_event([0, 1, 2])
    torch.testing.assert_close(targets[0].momentum, torch.tensor([7 / 3, 1.0]))  # means of log10 p per instance
    _, terms = detector_loss(output, targets)
    # smooth L1 (beta 1) of the matched pairs: query 2 (2.0) against 7/3, query 0 (1.5) against 1, mean per event
    expected = (0.5 * (2.0 - 7 / 3) ** 2 + 0.5 * (1.5 - 1.0) ** 2) / 2
    torch.testing.assert_close(terms["momentum"], torch.tensor(expected))


@pytest.mark.parametrize(("query2_points", "iou_of_query2"), [([0, 1, 2], 1.0), ([0, 1, 5], 2 / 3)])
def test_iou_loss_against_the_matched_mask_iou(query2_points, iou_of_query2):
    """Perfect masks: the IoU target is 1. Query 2 covering 2 of its instance's 3 points (point 5 is stuff,
    no instance's, and not counted): 2/3. MSE of the predicted IoU (0.9, 0.6) over the matched pairs."""
    output, targets = hand_made_event(query2_points)
    expected = ((0.9 - 1.0) ** 2 + (0.6 - iou_of_query2) ** 2) / 2
    without, terms = detector_event_losses(output, targets, DetectorLossWeights(iou=0.0))
    weighted, _ = detector_event_losses(output, targets, DetectorLossWeights(iou=2.0))
    torch.testing.assert_close(terms["iou"], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weighted - without, torch.tensor([2.0 * expected]), rtol=1e-5, atol=1e-6)


def test_predicted_iou_multiplies_the_post_processing_score():
    mask_logits = torch.full((2, 6), -12.0)
    mask_logits[0, :3] = 12.0
    class_logits = torch.full((2, NUM_CLASSES + 1), -12.0)
    class_logits[0, 1] = class_logits[1, NUM_CLASSES] = 12.0
    alone = instances_from_queries(class_logits, mask_logits)
    scaled = instances_from_queries(class_logits, mask_logits, predicted_iou=torch.tensor([0.7, 1.0]))
    assert alone.instance.tolist() == scaled.instance.tolist() == [0, 0, 0, -1, -1, -1]
    torch.testing.assert_close(scaled.instance_score, 0.7 * alone.instance_score)
    # below conf_threshold (0.5) once scaled: no instance (postprocess.py: the combined score is filtered)
    dropped = instances_from_queries(class_logits, mask_logits, predicted_iou=torch.tensor([0.3, 1.0]))
    assert dropped.instance.tolist() == [-1] * 6


def test_gradients_reach_the_momentum_regressor_and_the_iou_head():
    torch.manual_seed(0)
    model = QueryDetector(in_channels=5, num_classes=NUM_CLASSES, num_queries=6, hidden_channels=32, num_heads=4,
                          depth=2, momentum_regressor=True, predict_iou=True)
    g = torch.Generator().manual_seed(1)
    sizes = (7, 12)
    targets = [event_targets(torch.randint(-1, 3, (n,), generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g),
                             torch.rand(n, generator=g)) for n in sizes]
    feat, coord = torch.randn(sum(sizes), 5, generator=g), torch.randn(sum(sizes), 3, generator=g)
    loss, terms = detector_loss(model(feat, torch.tensor(sizes).cumsum(0), coord), targets,
                                DetectorLossWeights(iou=1.0))  # the published default, 0, would train no IoU head
    loss.backward()
    assert {"momentum", "iou", "aux0_momentum", "aux0_iou"} <= set(terms)
    for name, parameter in model.named_parameters():
        if name.startswith(("momentum_regressor.", "iou_pred.")):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="same head under two names"):
        QueryDetector(in_channels=5, num_classes=NUM_CLASSES, momentum_head=True, momentum_regressor=True)


def test_the_detector_scores_its_instances_with_the_iou_head():
    """detector-v1m2 with predict_iou: every layer predicts momentum and IoU; an IoU head that says 0 for every
    query leaves no instance in post-processing."""
    cfg = load_config(REPO / "configs/tests/tiny_published_detector.py")["model"]
    torch.manual_seed(0)
    model = build_model({**cfg, "type": "detector-v1m2", "predict_iou": True, "conf_threshold": 0.01,
                         "use_stuff_head": False}).eval()
    g = torch.Generator().manual_seed(0)
    coord = torch.stack([torch.randperm(768, generator=g)[:200] for _ in range(3)], 1).float()
    feat, offset = torch.randn(200, 4, generator=g), torch.tensor([120, 200])
    with torch.no_grad():
        output = model(coord, feat, offset)
        assert all(layer.iou.shape == layer.momentum.shape == (2, 8) for layer in output.decoder.layers)
        assert any((found.instance >= 0).any() for found in output.instances)
        model.decoder.iou_pred.mlp.fc2.bias.fill_(-100.0)
        silenced = model(coord, feat, offset)
    assert all((found.instance < 0).all() for found in silenced.instances)
