"""The task interface: class weights and ignore index in loss and metrics, the best-metric choice,
and every bad task option refused before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, launch, launch_args, pimm_in_process

from pimm.data.synth import write_pilarnet
from pimm.tasks import SemanticSegmentation, TaskOutput, build_task, event_mean_loss


def test_class_weighted_event_loss_matches_torch_per_event() -> None:
    """An event's loss is torch's weighted mean cross-entropy over its points; events count equally."""
    torch.manual_seed(0)
    logits = torch.randn(9, 3)
    target = torch.tensor([0, 1, 2, 2, -1, 1, 0, 0, 2])
    offset = torch.tensor([4, 9])
    weights = torch.tensor([0.5, 2.0, 1.0])
    loss, per_event = event_mean_loss(logits, target, offset, weights, ignore_index=-1)
    expected = [F.cross_entropy(logits[a:b], target[a:b], weight=weights, ignore_index=-1) for a, b in ((0, 4), (4, 9))]
    assert torch.allclose(per_event, torch.stack(expected), atol=1e-6)
    assert torch.allclose(loss, per_event.mean())


def test_ignore_index_outside_the_classes_and_all_ignored_event() -> None:
    logits = torch.randn(5, 3)
    target = torch.tensor([255, 255, 1, 255, 0])
    loss, per_event = event_mean_loss(logits, target, torch.tensor([2, 5]), ignore_index=255)
    assert per_event[0] == 0  # nothing labelled: contributes 0, not NaN
    assert torch.allclose(per_event[1], F.cross_entropy(logits[[2, 4]], target[[2, 4]]))
    assert torch.isfinite(loss)


def test_zero_class_weight_leaves_the_class_out_of_the_loss_not_the_metrics() -> None:
    task = SemanticSegmentation(3, class_weights=[1.0, 0.0, 1.0])
    coord, feat = torch.zeros(4, 3), torch.zeros(4, 4)
    batch = {"coord": coord, "feat": feat, "offset": torch.tensor([4]), "segment": torch.tensor([1, 1, 0, -1])}
    logits = torch.tensor([[0.0, 3.0, 0.0], [3.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 3.0]])

    out = task.forward_loss(lambda c, f, o, event_id=None: logits, batch)
    assert torch.allclose(out.loss, F.cross_entropy(logits[2:3], torch.tensor([0])))
    meter = task.make_meter(torch.device("cpu"))
    meter.update(out, batch)
    # class 1's two points are counted (one right, one wrong); the -1 point is not
    assert meter.confusion.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0]]


def test_meter_counts_only_labelled_points() -> None:
    task = build_task({"task": {"type": "SemanticSegmentation", "ignore_index": -1},
                       "data": {"num_classes": 4, "names": None}})
    meter = task.make_meter(torch.device("cpu"))
    target = torch.tensor([0, -1, 3, -1, 2])
    logits = F.one_hot(torch.tensor([0, 1, 2, 3, 2]), 4).float()
    meter.update(TaskOutput(torch.zeros(()), torch.ones(2), logits), {"segment": target})
    result = meter.compute()  # not distributed: compute is the local reduction
    assert result["points"] == 3 and result["events"] == 2
    assert result["iou"][0] == 1.0 and result["iou"][2] == 0.5 and result["iou"][3] == 0.0


@pytest.mark.parametrize(("override", "message"), [
    ("task.class_weights=[1,2]", "give one finite weight >= 0 per class (5 for data.num_classes=5)"),
    ("task.class_weights=[0,0,0,0,0]", "not all 0"),
    ("task.class_weights=[1,1,1,-1,1]", "task.class_weights=[1, 1, 1, -1, 1] is not allowed"),
    ("task.ignore_index=2", "must be an integer label outside the classes 0..4"),
    ("task.best_metric=f1", "must be one of miou, accuracy, loss"),
    ("task.weights=[1,1,1,1,1]", "unknown config key 'task.weights'; did you mean 'task.class_weights'?"),
    ("task.type=Detection", "task.type='Detection' is not allowed"),
])
def test_bad_task_options_exit_2_before_any_process(tmp_path: Path, tiny_data, override: str, message: str) -> None:
    res = pimm_in_process(["launch", "--train.config", TINY, "--paths.exp-root", str(tmp_path), "--dry-run", "--",
                           f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", override])
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not any(tmp_path.iterdir())


def test_pilarnet_unlabelled_points_need_ignore_index_minus_1(tmp_path: Path) -> None:
    shard = write_pilarnet(tmp_path / "pid.h5", 8, seed=3)[0]
    data = [f"data.{s}={{type: PILArNetDataset, path: {shard}, label: pid, pid_unlabelled_as_none: false}}"
            for s in ("train", "val")]
    args = ["launch", "--train.config", TINY, "--paths.exp-root", str(tmp_path / "exp"), "--dry-run", "--",
            *data, "data.num_classes=6", "model.num_classes=6", "data.names=None"]
    assert pimm_in_process([*args, "batch_size=2"]).returncode == 0
    # by default pid -1 is class "none", not unlabelled: any ignore_index outside the classes will do
    as_none = [arg.replace(", pid_unlabelled_as_none: false", "") for arg in args]
    assert pimm_in_process([*as_none, "batch_size=2", "task.ignore_index=-100"]).returncode == 0
    res = pimm_in_process([*args, "batch_size=2", "task.ignore_index=-100"])
    assert res.returncode == 2
    assert "pid label -1 (no label), which task.ignore_index=-100 does not ignore" in res.stderr
    assert "set task.ignore_index=-1" in res.stderr


def _losses(run_dir: Path) -> list[float]:
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"]


def test_class_weights_and_best_metric_reach_training(tmp_path: Path, tiny_data, reference_1rank) -> None:
    """Equal weights reproduce the unweighted losses (the first steps of conftest's uninterrupted 1-rank
    run: constant learning rate); unequal ones change them; best_metric=loss picks model_best by the
    lowest validation loss and records it."""
    common = ("max_steps=3", "epochs=1")
    plain = _losses(reference_1rank)[:3]
    equal, equal_dir = launch(tmp_path, tiny_data, 1, *common, "task.class_weights=[2,2,2,2,2]", name="equal")
    skewed, skewed_dir = launch(tmp_path, tiny_data, 1, *common, "task.class_weights=[1,5,1,1,0.2]",
                                "task.best_metric=loss", name="skewed")
    for res in (equal, skewed):
        assert res.returncode == 0, res.stderr
    assert _losses(equal_dir) == pytest.approx(plain, rel=1e-6)
    assert _losses(skewed_dir)[0] != pytest.approx(plain[0], rel=1e-3)
    best = json.loads((skewed_dir / "model" / "model_best.json").read_text())
    val = [json.loads(ln) for ln in (skewed_dir / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["loss"] for r in val if r["kind"] == "val"]
    assert (best["step"], best["metric"], best["value"]) == (3, "loss", pytest.approx(min(val_loss)))
    summary = json.loads((skewed_dir / "summary.json").read_text())
    assert summary["best_metric"] == "loss" and summary["best_value"] == pytest.approx(min(val_loss))

    # refused before any process starts
    again = pimm_in_process(launch_args(tmp_path, tiny_data, 1, *common, "task.class_weights=[1,5,1,1,0.2]",
                                        "task.best_metric=miou", name="skewed", resume=True))
    assert again.returncode == 2
    assert "task.best_metric: 'loss' in the run, 'miou' now" in again.stderr
