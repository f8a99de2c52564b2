"""`pimm test`: the same metrics at 1 and 2 ranks (DDP and FSDP2), metrics that agree with the
confusion matrix by hand, predictions that match the metrics, and one-line refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import REPO, pimm_in_process, run_pimm

from pimm.tasks.metrics import metrics_from_confusion


@pytest.fixture
def trained(tested_run):
    """conftest's shared 4-step 1-rank run whose config has data.test (the tiny val file)."""
    return tested_run.run_dir


def pimm_test(run_dir, *args, overrides=()):
    return run_pimm(["test", "--run-dir", str(run_dir), *args, *(["--", *overrides] if overrides else [])], cwd=REPO)


def test_same_confusion_at_1_and_2_ranks_ddp_and_fsdp2(evaluations):
    """conftest.evaluations: pimm test of the shared run at 1 rank, 2 ranks (DDP) and 2 ranks (FSDP2)."""
    results = {}
    for name, nproc in (("one", 1), ("ddp", 2), ("fsdp2", 2)):
        res, out = evaluations[name]
        assert res.returncode == 0, res.stderr
        assert "mIoU" in res.stdout and str(out) in res.stdout
        results[name] = json.loads((out / "test_metrics.json").read_text())
        provenance = json.loads((out / "provenance.json").read_text())
        assert provenance["world_size"] == nproc and provenance["data"]["content_hash"]
        assert (out / "confusion.png").stat().st_size > 0
        confusion = json.loads((out / "confusion.json").read_text())
        assert confusion["counts"] == results[name]["confusion"]
        assert len((out / "test_metrics.csv").read_text().splitlines()) == 1 + 5 + 2
    assert provenance["strategy"] == "fsdp2"
    one = results["one"]
    assert one["events"] == 12 and one["checkpoint"] == "best" and one["step"] == 4
    for name in ("ddp", "fsdp2"):
        assert results[name]["confusion"] == one["confusion"]
        assert results[name]["miou"] == one["miou"] and results[name]["macc"] == one["macc"]
        assert results[name]["loss"] == pytest.approx(one["loss"], rel=1e-9)


def test_metrics_by_hand():
    confusion = torch.tensor([[5, 1, 0], [2, 3, 0], [0, 0, 0]])
    m = metrics_from_confusion(confusion, 3.0, 2)
    # class 0: TP 5, FN 1, FP 2; class 1: TP 3, FN 2, FP 1; class 2: no points at all
    assert m["recall"][:2] == [5 / 6, 3 / 5] and m["class_accuracy"][:2] == m["recall"][:2]
    assert m["precision"][:2] == [5 / 7, 3 / 4]
    assert m["f1"][0] == pytest.approx(2 * (5 / 7) * (5 / 6) / (5 / 7 + 5 / 6))
    assert m["macc"] == pytest.approx((5 / 6 + 3 / 5) / 2)
    assert m["allacc"] == m["accuracy"] == 8 / 11
    assert m["iou"][:2] == [5 / 8, 3 / 6] and m["miou"] == pytest.approx((5 / 8 + 3 / 6) / 2)
    assert all(math.isnan(m[k][2]) for k in ("iou", "recall", "precision", "f1"))
    assert m["class_points"] == [6, 5, 0] and m["points"] == 11 and m["loss"] == 1.5
    assert m["confusion"] == confusion.tolist()


def test_save_predictions_match_the_metrics(evaluations):
    from pimm.data.predictions import open_predictions
    from pimm.tasks.metrics import metrics_from_predictions

    res, out = evaluations["ddp"]  # 2 ranks, --save-predictions --save-scores
    assert res.returncode == 0, res.stderr
    metrics = json.loads((out / "test_metrics.json").read_text())
    with open_predictions(out / "predictions.h5") as preds:
        assert preds.event_ids.tolist() == list(range(12)) and preds.has_scores
    assert not list(out.glob("predictions.rank*"))
    again = metrics_from_predictions(out / "predictions.h5")
    assert again["confusion"] == metrics["confusion"] and again["miou"] == metrics["miou"]


@pytest.mark.parametrize("case", ["no_checkpoint", "no_test_data", "finished_out", "scores_alone"])
def test_bad_input_exits_2_with_one_line(trained, tmp_path, case):
    finished = tmp_path / "done"
    finished.mkdir()
    (finished / "test_metrics.json").write_text("{}")
    args, overrides = {
        "no_checkpoint": (["--checkpoint", "step_999"], ()),
        "no_test_data": ([], ("data.test=null",)),
        "finished_out": (["--out", str(finished)], ()),
        "scores_alone": (["--save-scores"], ()),
    }[case]
    res = pimm_in_process(["test", "--run-dir", str(trained), *args, *(["--", *overrides] if overrides else [])])
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pimm: error:"), res.stderr
    assert {"no_checkpoint": "step_999", "no_test_data": "data.test={type: LArTPCDataset",
            "finished_out": "--out", "scores_alone": "--save-predictions"}[case] in lines[0]


def test_a_finished_run_with_a_test_set_ends_with_its_test(tested_run, trained, lr0_launches, tiny_data):
    """test_after_training (the default): the launch that finished training ran `pimm test` of the
    best model into RUN/eval/test-best; with test_after_training=false it does not (conftest's shared
    lr=0 runs, at 1 and 2 ranks, have a data.test and test_after_training=false)."""
    assert "pimm test: mIoU" in tested_run.stdout
    metrics = json.loads((trained / "eval" / "test-best" / "test_metrics.json").read_text())
    assert metrics["events"] == 12 and metrics["checkpoint"] == "best"
    for res, run_dir in lr0_launches.values():
        test_set = f"data.test={{type: LArTPCDataset, path: {tiny_data['val']}}}"
        assert "test_after_training=false" in res.args and test_set in res.args
        assert res.returncode == 0, res.stderr
        assert "pimm test" not in res.stdout and not (run_dir / "eval").exists()
