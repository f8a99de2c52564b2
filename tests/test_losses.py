"""task.loss: CrossEntropy, Lovasz and Focal terms, each per event; the default is the previous loss bit for
bit, Lovász matches a plain per-event per-class reference, the 1- and 2-rank runs take the same losses,
and bad loss configs are refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import LR0_OVERRIDES, TINY, losses, pimm_in_process

from pimm import names
from pimm.config.validate import LOSS_OPTIONS
from pimm.data.collate import offset_to_batch_index
from pimm.tasks import LOSSES, SemanticSegmentation
from pimm.tasks.losses import CrossEntropy, Focal, Lovasz


def _batch(seed: int, sizes=(7, 1, 12, 30), num_classes: int = 4, ignore_index: int = -1):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    logits = torch.randn(n, num_classes, generator=g) * 2
    target = torch.randint(0, num_classes, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.2] = ignore_index
    target[7] = ignore_index  # the 1-point event has no label
    offset = torch.tensor(sizes).cumsum(0)
    return logits, target, offset


def _previous_event_mean_loss(logits, target, offset, class_weights=None, ignore_index=-1):
    """The loss before task.loss existed (pimm.tasks.segmentation.event_mean_loss), copied verbatim."""
    point_loss = F.cross_entropy(logits.float(), target, reduction="none", ignore_index=ignore_index)
    valid = target != ignore_index
    if class_weights is None:
        weight = valid.to(point_loss.dtype)
    else:
        weight = class_weights.to(point_loss.device)[target.clamp(0, len(class_weights) - 1)] * valid
    event_index = offset_to_batch_index(offset, len(point_loss))
    event_weight = point_loss.new_zeros(len(offset)).index_add_(0, event_index, weight)
    event_sum = point_loss.new_zeros(len(offset)).index_add_(0, event_index, point_loss * weight)
    event_losses = torch.where(event_weight > 0, event_sum / event_weight.clamp(min=1e-12), 0.0)
    return event_losses.mean(), event_losses


def _lovasz_reference(logits, target, offset, class_weights=None, ignore_index=-1):
    """Berman et al.'s lovasz_softmax (classes='present'), one event at a time, one class at a time."""
    prob = torch.softmax(logits.float(), 1)
    out, start = [], 0
    for end in offset.tolist():
        p, t = prob[start:end], target[start:end]
        start = end
        p, t = p[t != ignore_index], t[t != ignore_index]
        terms, weights = [], []
        for c in range(logits.shape[1]):
            fg = (t == c).float()
            if fg.sum() == 0 or (class_weights is not None and class_weights[c] == 0):
                continue
            errors = (fg - p[:, c]).abs()
            errors_sorted, perm = torch.sort(errors, descending=True)
            fg_sorted = fg[perm]
            gts = fg_sorted.sum()
            intersection = gts - fg_sorted.cumsum(0)
            union = gts + (1 - fg_sorted).cumsum(0)
            jaccard = 1 - intersection / union
            jaccard[1:] = jaccard[1:] - jaccard[:-1].clone()
            terms.append(torch.dot(errors_sorted, jaccard))
            weights.append(1.0 if class_weights is None else float(class_weights[c]))
        w = torch.tensor(weights)
        out.append((torch.stack(terms) * w).sum() / w.sum() if terms else torch.zeros(()))
    return torch.stack(out)


def _task(num_classes=4, **options):
    return SemanticSegmentation(num_classes, **options)


def _forward(task, logits, target, offset):
    batch = {"coord": None, "feat": None, "offset": offset, "segment": target}
    return task.forward_loss(lambda c, f, o, event_id=None: logits, batch)


@pytest.mark.parametrize("class_weights", [None, [0.5, 2.0, 0.0, 1.0]])
def test_default_loss_is_the_previous_event_mean_cross_entropy_bit_for_bit(class_weights) -> None:
    logits, target, offset = _batch(0)
    weights = None if class_weights is None else torch.tensor(class_weights)
    expected, expected_events = _previous_event_mean_loss(logits, target, offset, weights)
    out = _forward(_task(class_weights=class_weights), logits, target, offset)
    assert torch.equal(out.loss, expected) and torch.equal(out.event_losses, expected_events)


@pytest.mark.parametrize("class_weights", [None, [0.5, 2.0, 0.0, 1.0]])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lovasz_matches_a_per_event_per_class_reference(seed: int, class_weights) -> None:
    ignore_index = 255 if seed == 3 else -1  # an ignore label above the classes too
    logits, target, offset = _batch(seed, ignore_index=ignore_index)
    logits[:5] = logits[0]  # ties among errors
    weights = None if class_weights is None else torch.tensor(class_weights)
    event_index = offset_to_batch_index(offset, len(target))
    got = Lovasz(weights, ignore_index)(logits, target, event_index, len(offset))
    expected = _lovasz_reference(logits, target, offset, weights, ignore_index)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
    assert got[1] == 0  # no labelled point


def test_focal_with_gamma_0_is_cross_entropy_and_gamma_lowers_easy_points() -> None:
    logits, target, offset = _batch(4)
    weights = torch.tensor([0.5, 2.0, 0.0, 1.0])
    event_index = offset_to_batch_index(offset, len(target))
    ce = CrossEntropy(weights)(logits, target, event_index, len(offset))
    assert torch.equal(Focal(0.0, weights)(logits, target, event_index, len(offset)), ce)
    focal = Focal(2.0, weights)(logits, target, event_index, len(offset))
    assert (focal <= ce).all() and (focal[ce > 0] < ce[ce > 0]).all()


def test_weighted_sum_of_terms_per_event_and_finite_gradients() -> None:
    logits, target, offset = _batch(5)
    logits.requires_grad_(True)
    loss = [{"type": "CrossEntropy", "weight": 1.0}, {"type": "Lovasz", "weight": 0.5},
            {"type": "Focal", "weight": 0.25, "gamma": 1.5}, {"type": "Lovasz", "weight": 0.0}]
    out = _forward(_task(loss=loss), logits, target, offset)
    event_index = offset_to_batch_index(offset, len(target))
    terms = [CrossEntropy()(logits, target, event_index, 4), Lovasz()(logits, target, event_index, 4),
             Focal(1.5)(logits, target, event_index, 4)]
    assert torch.allclose(out.event_losses, terms[0] + 0.5 * terms[1] + 0.25 * terms[2])
    assert torch.allclose(out.loss, out.event_losses.mean())
    out.loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    assert (logits.grad[target == -1] == 0).all()  # ignored points take no gradient from any term


def test_loss_names_and_options_match_the_registry() -> None:
    assert set(LOSSES.names()) == set(names.LOSSES) == set(LOSS_OPTIONS)


def test_lovasz_and_cross_entropy_take_the_same_losses_at_1_and_2_ranks(lr0_runs) -> None:
    """lr=0: every step sees the initial weights, so the step losses must agree to rounding. (conftest's
    shared pair of runs with task.loss = CrossEntropy + 0.5 Lovasz, which also has point transforms on.)"""
    assert "{type: Lovasz, weight: 0.5}" in " ".join(LR0_OVERRIDES)
    runs = {nproc: losses(run_dir) for nproc, run_dir in lr0_runs.items()}
    assert list(runs[1]) == [1, 2, 3]
    for step, a in runs[1].items():
        assert runs[2][step] == pytest.approx(a, rel=1e-6), step


@pytest.mark.parametrize(("override", "message"), [
    ("task.loss=[{type: Lovaz}]", "task.loss[0].type='Lovaz' is not a loss type; did you mean 'Lovasz'?"),
    ("task.loss=[{type: Lovasz, gamma: 2}]", "task.loss[0].gamma is not an option of loss Lovasz"),
    ("task.loss=[{type: CrossEntropy, weight: -1}]", "task.loss[0].weight=-1 is not allowed: it must be a finite"),
    ("task.loss=[{type: CrossEntropy, weight: .nan}]", "task.loss[0].weight=nan is not allowed"),
    ("task.loss=[{type: CrossEntropy, weight: 0}, {type: Lovasz, weight: 0}]", "task.loss has every weight 0"),
    ("task.loss=[{type: Focal, gamma: -1}]", "task.loss[0].gamma=-1 is not allowed: it must be a finite number >= 0"),
    ("task.loss=[]", "task.loss=[] is not allowed: give a non-empty list"),
])
def test_bad_loss_configs_exit_2_before_any_process(tmp_path: Path, tiny_data, override: str, message: str) -> None:
    res = pimm_in_process(["launch", "--train.config", TINY, "--paths.exp-root", str(tmp_path), "--dry-run", "--",
                           f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", override])
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not any(tmp_path.iterdir())
