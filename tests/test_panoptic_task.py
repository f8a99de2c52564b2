"""The Panoptic task on the published detector (detector-v1m1): config checks, per-event losses, a 2-rank
run with loader workers that resumes exactly, `pimm test` identical at 1 and 2 ranks, `pimm predict`."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_bitwise_equal, losses, pimm_in_process, run_pimm, weights

from pimm import names
from pimm.config import apply_overrides, load_config, parse_overrides
from pimm.config.validate import check_config
from pimm.data.collate import collate_events
from pimm.data.dataset import build_dataset
from pimm.data.synth import write_pilarnet
from pimm.errors import ConfigError
from pimm.models import build_model
from pimm.tasks import build_task
from pimm.tasks.panoptic import Panoptic
from pimm.tasks.panoptic_loss import DetectorLossWeights

CONFIG = "tests/tiny_panoptic"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("panoptic") / "pilarnet"
    write_pilarnet(root, 16, seed=1, split="train", revision="v2")
    write_pilarnet(root, 12, seed=2, split="val", revision="v2")
    return root


def tiny_config(shards: Path, *overrides: str) -> dict:
    cfg = load_config(REPO / "configs" / f"{CONFIG}.py")
    return apply_overrides(cfg, parse_overrides([f"data.train.path={shards}", f"data.val.path={shards}",
                                                 *overrides]))


def test_the_loss_weights_a_config_may_set_are_the_loss_fields():
    assert tuple(f.name for f in dataclasses.fields(DetectorLossWeights)) == names.PANOPTIC_LOSS_WEIGHTS
    assert set(names.PUBLISHED_INSTANCE_LOSS.values()) <= set(names.PANOPTIC_LOSS_WEIGHTS)


@pytest.mark.parametrize("overrides, message", [
    (["data.val.instances=false"], "data.val.instances=True"),
    (["task.label=vertex"], "task.label='vertex' is not allowed"),
    (["task.label=interaction"], "model.num_classes=6 and model.stuff_classes=[5], but task.label='interaction' "
                                 "has 2 classes (stuff, interaction), as the published vtx recipes: set "
                                 "model.num_classes=2 and model.stuff_classes=[0]"),
    (["task.label=interaction", "model.num_classes=2"], "model.num_classes=2 and model.stuff_classes=[5], but"),
    (["task.label=interaction", "model.num_classes=2", "model.stuff_classes=[1]"],
     "model.num_classes=2 and model.stuff_classes=[1], but"),
    (["task.stuff_classes=[6]"], "task.stuff_classes=[6] is not allowed: class 6 is outside 0..5"),
    (["model.full_in_channels=32"], "model.full_in_channels=32 but the backbone gives 48 channels"),
    (['task.loss={focl: 2.0}'], "task.loss.focl is not a Panoptic loss weight: did you mean 'focal'?"),
    (["task.loss={dice: -1}"], "task.loss.dice=-1 is not allowed"),
    (["model.connect_radius=0"], "model.connect_radius=0 is not allowed"),
    (["model.connect_min_points=0"], "model.connect_min_points=0 is not allowed"),
    (["model.connect_radius=3", "model.connect_collinear=0"], "model.connect_collinear=0 is not allowed"),
    (["model.connect_radius=3", "model.connect_collinear=1"], "model.connect_collinear=1 is not allowed"),
    (["model.connect_collinear=0.9"], "model.connect_collinear=0.9 joins the instances that connect_radius connects, "
                                      "but model.connect_radius is None (off): set model.connect_radius"),
])
def test_a_panoptic_config_the_run_cannot_train_is_refused_with_what_to_do(shards, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(tiny_config(shards, *overrides))


def test_the_task_options_of_semantic_segmentation_and_the_detector_do_not_mix(shards):
    cfg = tiny_config(shards)
    cfg["task"] = {"type": "Panoptic", "label": "particle", "class_weights": None}
    with pytest.raises(ConfigError, match="task.class_weights is an option of SemanticSegmentation.*_delete_=True"):
        check_config(cfg)
    cfg["task"] = {"type": "SemanticSegmentation"}
    with pytest.raises(ConfigError, match="trained by the Panoptic task"):
        check_config(cfg)
    cfg = tiny_config(shards)
    cfg["model"]["attn_mask_anneal"] = True
    with pytest.raises(ConfigError, match="model.attn_mask_anneal=True is not allowed: .*not implemented"):
        check_config(cfg)


def test_a_refused_launch_starts_no_process(shards, tmp_path):
    res = pimm_in_process(["launch", "--train.config", CONFIG, "--paths.exp-root", str(tmp_path / "exp"), "--",
                           f"data.train.path={shards}", f"data.val.path={shards}", "task.label=interaction"])
    assert res.returncode == 2 and "has 2 classes (stuff, interaction)" in res.stderr, res.stderr
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("query_type", ["learned", "anchored"])
def test_an_events_loss_does_not_depend_on_the_events_beside_it(shards, query_type):
    """Each event's loss (matching, mask, class and stuff terms) is the same alone as in a batch; the
    batch's loss is their mean, so micro-batches and ranks add up to the same gradient. Anchored queries: each
    event's anchors are its own."""
    cfg = tiny_config(shards, f"model.query_type={query_type}")
    dataset = build_dataset({**cfg["data"]["train"]}, seed=0)
    torch.manual_seed(0)
    model = build_model(cfg["model"]).train()
    model.backbone.begin_optimizer_step(1)  # as the trainer announces it: the step's keyed draws
    task = build_task(cfg)
    events = [dataset[i] for i in range(3)]
    together = task.forward_loss(model, collate_events(events))
    alone = torch.cat([task.forward_loss(model, collate_events([e])).event_losses for e in events])
    torch.testing.assert_close(together.event_losses, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.loss, alone.mean(), rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(alone).all()) and float(alone.detach().min()) > 0
    # points the stuff head leaves out of the decoder count in no mask term (they would add ~2,500 each)
    assert float(alone.detach().max()) < 100


def test_the_stuff_heads_term_is_each_events_mean_cross_entropy_times_its_weight(shards):
    """task.stuff_loss_weight scales one term: each event's mean binary cross-entropy of its points' stuff logits
    against the points of a stuff class (the benchmark's detector sets 20, published 1)."""
    cfg = tiny_config(shards)
    torch.manual_seed(0)
    model = build_model(cfg["model"]).train()
    batch = collate_events([build_dataset({**cfg["data"]["train"]}, seed=0)[i] for i in range(3)])

    def event_losses(weight: float) -> tuple[torch.Tensor, torch.Tensor]:
        weighted_cfg = tiny_config(shards, f"task.stuff_loss_weight={weight}")
        check_config(weighted_cfg)
        model.backbone.begin_optimizer_step(1)  # the same keyed draws for both forwards
        output = build_task(weighted_cfg).forward_loss(model, batch)
        return output.event_losses.detach(), output.prediction.stuff_logits.detach()

    published, stuff_logits = event_losses(1.0)
    weighted, same_logits = event_losses(20.0)
    assert torch.equal(stuff_logits, same_logits)
    point_class = build_task(cfg).truth(batch)[0]
    ends = batch["offset"].tolist()
    by_hand = torch.stack([torch.nn.functional.binary_cross_entropy_with_logits(
        stuff_logits[lo:hi].float(), (point_class[lo:hi] == 5).float()) for lo, hi in zip([0, *ends[:-1]], ends)])
    assert bool((point_class == 5).any()) and float(by_hand.min()) > 0
    torch.testing.assert_close(weighted - published, 19.0 * by_hand, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match=re.escape("task.stuff_loss_weight=-1 is not allowed")):
        check_config(tiny_config(shards, "task.stuff_loss_weight=-1"))


def test_interactions_as_instances_train_on_two_classes(shards):
    cfg = tiny_config(shards, "task.label=interaction", "model.num_classes=2", "model.stuff_classes=[0]")
    check_config(cfg)
    dataset = build_dataset({**cfg["data"]["train"]}, seed=0)
    torch.manual_seed(0)
    model = build_model(cfg["model"]).train()
    task = build_task(cfg)
    assert task.class_names == ["stuff", "interaction"] and task.stuff_classes == (0,)
    batch = collate_events([dataset[i] for i in range(2)])
    point_class, instance = task.truth(batch)
    assert set(point_class.unique().tolist()) <= {0, 1} and bool((instance[point_class == 0] == -1).all())
    output = task.forward_loss(model, batch)
    output.loss.backward()
    assert 0 < float(output.loss.detach()) < 100
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("decoder.blocks."))


@pytest.fixture(scope="module")
def detector_runs(shards, tmp_path_factory) -> dict[str, Path]:
    """A 2-rank run (4 steps) with a loader worker per rank, uninterrupted; the same interrupted after step 2
    and resumed. A small learning rate and every candidate query kept (conf_threshold 0): a detector that has
    not learned no-object yet predicts instances of every kind, for `pimm test` and `pimm predict`. Queries
    anchored (pimm's query_type, the benchmark's): the anchors of an event must not depend on the rank that
    reads it. Their length unit at 128 voxels: at the default 8 a 4-step detector's masks still keep to a few
    voxels around each anchor, and `pimm predict` needs instances to write. pimm's connected pieces on (its
    post-processing after the published one) with collinear ones joined: made the same at any rank count."""
    exp = tmp_path_factory.mktemp("detector_runs")
    common = ["--resources.nproc-per-node", "2", "--run.no-timestamp", "--paths.exp-root", str(exp)]
    data = [f"data.train.path={shards}", f"data.val.path={shards}", "num_worker=2", "log_event_ids=true", "epochs=1",
            "optimizer.lr=0.00002", "model.conf_threshold=0.0", "model.query_type=anchored",
            "model.anchor_length=1.0", "model.connect_radius=3.0", "model.connect_min_points=5",
            "model.connect_collinear=0.9"]
    runs = {}
    for name, extra in (("full", []), ("cut", ["debug.interrupt_at_step=2"])):
        res = run_pimm(["launch", "--train.config", CONFIG, "--run.name", name, *common, "--", *data, *extra],
                       cwd=REPO, timeout=300)
        assert res.returncode == (0 if name == "full" else 75), res.stdout + res.stderr
        runs[name] = exp / "tests" / name
    res = run_pimm(["launch", "--train.resume", str(runs["cut"]), "--resources.nproc-per-node", "2"], cwd=REPO,
                   timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return runs


def test_a_two_rank_detector_run_resumes_exactly(detector_runs):
    full, cut = detector_runs["full"], detector_runs["cut"]
    assert losses(full) == losses(cut)
    assert_bitwise_equal(weights(full), weights(cut))
    summary = json.loads((full / "summary.json").read_text())
    assert summary["best_metric"] == "ari_all_labelled"
    record = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["kind"] == "val" and record["events"] == 12 and "pq" in record and "confusion" in record


def test_pimm_test_gives_the_same_metrics_at_one_and_two_ranks(detector_runs, tmp_path):
    """Every event counted once whatever the ranks (the young detector of detector_runs predicts instances)."""
    results = {}
    for n in (1, 2):
        out = tmp_path / f"t{n}"
        res = run_pimm(["test", "--run-dir", str(detector_runs["full"]), "--split", "val", "--out", str(out),
                        "--resources.nproc-per-node", str(n)], cwd=REPO, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        results[n] = json.loads((out / "test_metrics.json").read_text())
        ari, sem = results[n]["ari_all_labelled"], results[n]["ari_all_labelled_sem"]
        assert f"pimm test: ARI {ari:.4f} ± {sem:.4f} PQ " in res.stdout  # each mean with its standard error
        assert (out / "confusion.png").stat().st_size > 0
        rows = list(csv.DictReader((out / "test_metrics_per_event.csv").open()))
        assert sorted(int(r["event_id"]) for r in rows) == list(range(12))
    one, two = results[1], results[2]
    assert one["events"] == 12 and one["detection_precision_events"] > 0  # instances were predicted
    assert one.keys() == two.keys()
    for key in one:
        if key == "loss":  # a float64 sum in another order
            assert one[key] == pytest.approx(two[key], rel=1e-9)
        else:
            assert one[key] == two[key], key


def test_pimm_predict_writes_instances_of_an_unlabelled_file_and_pimm_show_draws_them(detector_runs, shards,
                                                                                        tmp_path):
    """The detector on a pimm event file without labels (the val events' points, no segment): per point
    instance, class, score; a per-instance table beside it that a CSV reader takes as it is; then the
    event drawn by instance; --save-scores (per-class scores of a semantic model) refused in one line."""
    import h5py
    import numpy as np

    from pimm.data.dataset import PILArNetDataset
    from pimm.data.event_format import write_event_file
    from pimm.data.predictions import open_predictions

    cfg = tiny_config(shards)
    val = PILArNetDataset(str(shards), split="val", revision="v2", min_points=10)
    events = [val.read_raw(i) for i in range(4)]
    unlabelled = tmp_path / "nolabels.h5"
    write_event_file(unlabelled, [{"coord": e["coord"], "energy": e["energy"], "segment": e["segment"]}
                                  for e in events])
    with h5py.File(unlabelled, "a") as f:
        del f["segment"]
    out = tmp_path / "pred.h5"
    res = run_pimm(["predict", "--weights", str(detector_runs["full"]), "--data", str(unlabelled), "--out", str(out),
                    "--resources.nproc-per-node", "2"], cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    table = out.with_suffix(".instances.csv")
    assert f"per-instance table {table}" in res.stdout
    rows = list(csv.DictReader(table.open()))
    with open_predictions(out) as preds:
        assert preds.has_instances and not preds.has_labels and preds.num_events == 4
        for event_id in preds.event_ids:
            event = preds.read_event(int(event_id))
            sizes = np.bincount(event["instance"][event["instance"] >= 0])
            listed = [r for r in rows if int(r["event_id"]) == int(event_id)]
            assert [int(r["size"]) for r in listed] == sizes.tolist()
            assert all(r["class_name"] in cfg["data"]["names"] for r in listed)
    assert rows, "the young detector predicts instances"
    res = run_pimm(["show", str(out), "--event", "0", "--color-by", "instance", "--out", str(tmp_path / "e.png")],
                   cwd=REPO)
    assert res.returncode == 0 and (tmp_path / "e.png").stat().st_size > 0, res.stderr
    res = run_pimm(["predict", "--weights", str(detector_runs["full"]), "--data", str(unlabelled), "--out",
                    str(tmp_path / "again.h5"), "--save-scores"], cwd=REPO)
    assert res.returncode == 2 and "--save-scores" in res.stderr and "leave --save-scores out" in res.stderr


def test_the_summary_line_prints_an_undefined_metric_as_n_a_and_a_standard_error_where_there_is_one():
    """Purity with no predicted instance is NaN by definition: the validation line says n/a, as pimm test does."""
    line = Panoptic(num_classes=6).summary({"loss": 1.5, "ari_all_labelled": 0.25, "purity": float("nan"),
                                            "efficiency": 0.0, "events": 4})
    assert line == ("loss 1.5000 ari_all_labelled 0.2500 pq n/a purity n/a efficiency 0.0000 detection_f1 n/a "
                    "(4 events)")
    # with the standard errors of the means over events (PanopticAccumulator.result), where there is one
    line = Panoptic(num_classes=6).summary({"loss": 1.5, "ari_all_labelled": 0.25, "ari_all_labelled_sem": 0.0125,
                                            "purity": 0.5, "purity_sem": float("nan"), "efficiency": 0.0,
                                            "events": 4})
    assert line == ("loss 1.5000 ari_all_labelled 0.2500 ± 0.0125 pq n/a purity 0.5000 efficiency 0.0000 "
                    "detection_f1 n/a (4 events)")
