"""`pimm show --color-by instance|interaction|pid|error` and `--side-by-side`: instance predictions
of a panoptic model, and the instance truth of PILArNet-M data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_predictions import _colours, _has_colour

from pimm import cli
from pimm.cli import show
from pimm.data.dataset import PILArNetDataset
from pimm.data.pilarnet_file import PID_NAMES
from pimm.data.predictions import PredictionWriter
from pimm.data.synth import write_dataset, write_pilarnet
from pimm.display import COLOR_BY, INSTANCE_COLOURS, WRONG_COLOUR, WRONG_INSTANCE_COLOUR, EventView, load_event


def _panoptic_prediction(raw: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    """A panoptic model's prediction of one event from its truth: the true particles under other
    ids, true particle 1 merged into particle 0 (wrong instance), particle 2 given the wrong class."""
    true, segment = raw["particle"], raw["segment"]
    perm = rng.permutation(int(true.max()) + 1)
    instance = np.where(true >= 0, perm[np.maximum(true, 0)], -1)
    instance[true == 1] = perm[0]
    ids = np.unique(instance[instance >= 0])
    classes = np.array([np.bincount(segment[instance == i]).argmax() for i in ids])
    classes[ids == perm[2]] = (classes[ids == perm[2]] + 1) % 5
    pred = segment.copy()  # stuff points: the true stuff class
    for i, c in zip(ids, classes):
        pred[instance == i] = c
    return {"pred": pred, "point_index": raw["point_index"], "coord": raw["coord"], "instance": instance,
            "instance_score": rng.random(len(pred)), "instance_table": {"instance": ids, "class": classes,
                                                                      "score": rng.random(len(ids))}}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """PILArNet-M v2 shards (pid labels), a labelled and an unlabelled instance prediction file of
    their events, a semantic prediction file, v1 shards and a pimm event file."""
    root = tmp_path_factory.mktemp("show_instances")
    write_pilarnet(root / "pil", 2, seed=4, split="val")
    write_pilarnet(root / "pil_v1", 1, seed=4, split="val", revision="v1")
    dataset = PILArNetDataset(root / "pil", split="val", revision="v2", label="pid", instances=True)
    rng = np.random.default_rng(0)
    common = {"num_classes": 6, "class_names": list(PID_NAMES), "split": "val", "sources": [str(root / "pil")]}
    with PredictionWriter(root / "pred.h5", has_instances=True, **common) as labelled, \
            PredictionWriter(root / "unlabelled.h5", has_instances=True, has_labels=False, **common) as unlabelled, \
            PredictionWriter(root / "semantic.h5", **common) as semantic:
        for i in range(len(dataset)):
            raw = dataset.read_raw(i)
            event = _panoptic_prediction(raw, rng)
            labelled.add(i, 0, i, segment=raw["segment"], true_instance=raw["particle"], **event)
            unlabelled.add(i, 0, i, **event)
            semantic.add(i, 0, i, event["pred"], raw["point_index"], raw["coord"], segment=raw["segment"])
    dataset.close()
    return {"pred": root / "pred.h5", "unlabelled": root / "unlabelled.h5", "semantic": root / "semantic.h5",
            "pilarnet": root / "pil", "pilarnet_v1": root / "pil_v1",
            "event_file": write_dataset(root / "d.h5", 2, seed=3)}


@pytest.fixture
def pimm(capsys):
    """`pimm show ...` in this process -> (exit status, stdout, stderr)."""

    def run(*args: str | Path) -> tuple[int, str, str]:
        code = cli.main(["show", *map(str, args)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def panels(monkeypatch) -> list[list[str]]:
    """The titles of the 3D panels of every figure saved (one list per figure)."""
    from matplotlib.figure import Figure

    drawn: list[list[str]] = []
    savefig = Figure.savefig

    def record(fig, *args, **kwargs):
        drawn.append([ax.get_title() for ax in fig.axes if ax.name == "3d"])
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return drawn


def test_predicted_instances_each_get_a_colour(files, pimm, panels) -> None:
    code, out, err = pimm(files["pred"], "--event", "0", "--color-by", "instance")
    png = files["pred"].parent / "display" / "pred-event_0-instance.png"  # its own name: no other view replaced
    assert (code, out, err) == (0, f"{png}\n", "")
    assert panels == [["prediction: 3D"]]
    colours = _colours(png)
    assert sum(_has_colour(colours, c) for c in INSTANCE_COLOURS) >= 5
    assert not _has_colour(colours, WRONG_COLOUR)


def test_errors_mark_the_merged_particle_and_the_wrong_class(files, pimm, panels, tmp_path) -> None:
    out = tmp_path / "errors.png"
    assert pimm(files["pred"], "--event", "0", "--color-by", "error", "--out", out) == (0, f"{out}\n", "")
    assert panels == [["errors: 3D"]]
    colours = _colours(out)
    assert _has_colour(colours, WRONG_INSTANCE_COLOUR) and _has_colour(colours, WRONG_COLOUR)


def test_side_by_side_draws_truth_and_prediction(files, pimm, panels, tmp_path) -> None:
    out = tmp_path / "e.png"
    assert pimm(files["pred"], "--event", "1", "--color-by", "instance", "--side-by-side", "--out", out) == \
        (0, f"{out}\n", "")
    assert panels == [["truth: 3D", "prediction: 3D"]]
    assert len(_colours(out)) > 20


@pytest.mark.parametrize("case, color_by, side_by_side, headers, legend", [
    ("pred", "class", True, ["truth", "prediction"], "muon"),
    ("pred", "error", True, ["truth", "prediction", "errors"], "instance 0"),
    ("semantic", "error", False, ["errors"], "wrong class"),
    ("pilarnet", "interaction", False, ["truth"], "interaction 0"),
    ("pilarnet", "pid", False, ["truth"], "muon"),
])
def test_each_view_has_its_panels(files, case: str, color_by: str, side_by_side: bool, headers: list[str],
                                  legend: str) -> None:
    view = load_event(files[case], 0, "val", color_by, side_by_side)
    panels = view.columns()
    assert [p.header for p in panels] == headers
    assert legend in [g.name for p in panels for g in p.groups]


def test_a_matched_prediction_takes_its_true_instance_colour() -> None:
    true = np.array([0, 0, 0, 1, 1, 1, 2, 2, -1, -1])
    pred = np.array([5, 5, 5, 3, 3, 0, -1, -1, 7, -1])  # 5 = true 0, 3 = true 1 (IoU 2/3), 0 and 7 unmatched
    view = EventView(coord=np.zeros((10, 3)), class_names=["a"], title="", truth=np.zeros(10, np.int64),
                     pred=np.zeros(10, np.int64), true_instance=true, pred_instance=pred, color_by="error")
    np.testing.assert_array_equal(view.instance_slots()[1], [0, 0, 0, 1, 1, 3, -1, -1, 4, -1])
    # wrong instance: the point of true 1 in pred 0, true 2's points in none, the stuff point in pred 7
    np.testing.assert_array_equal(view.error_key(), [-2, -2, -2, -2, -2, -5, -5, -5, -5, -2])


def test_a_pilarnet_file_shows_its_true_particles(files, pimm, panels, tmp_path) -> None:
    out = tmp_path / "particles.png"
    code, stdout, err = pimm(files["pilarnet"], "--split", "val", "--event", "1", "--color-by", "instance",
                             "--out", out)
    assert (code, stdout, err) == (0, f"{out}\n", "")
    assert panels == [["truth: 3D"]]
    colours = _colours(out)
    assert sum(_has_colour(colours, c) for c in INSTANCE_COLOURS) >= 5


@pytest.mark.parametrize("case, options, expected", [
    ("semantic", ["--color-by", "instance"], "--color-by instance: {path} holds no instance predictions"),
    ("unlabelled", ["--color-by", "error"], "--color-by error compares the prediction with the truth, and {path} "
                                            "has no truth"),
    ("unlabelled", ["--side-by-side"], "--side-by-side puts the truth beside the prediction, and {path} has no truth"),
    ("pred", ["--color-by", "pid"], "--color-by pid colours the truth of PILArNet-M data; {path} is a prediction"),
    ("pilarnet", ["--color-by", "error"], "--color-by error compares a prediction with the truth; {path} is a data"),
    ("pilarnet", ["--side-by-side"], "--side-by-side puts the truth beside a prediction; {path} is a data file"),
    ("event_file", ["--color-by", "interaction"], "--color-by interaction shows instance labels, which a pimm "
                                                  "event file ({path}) does not have"),
    ("pilarnet_v1", ["--color-by", "pid"], "--color-by pid: {path} (PILArNet-M revision v1) has no particle types"),
])
def test_a_view_the_file_cannot_give_is_refused_in_one_line(files, pimm, tmp_path, case: str, options: list[str],
                                                            expected: str) -> None:
    out = tmp_path / "e.png"
    code, stdout, err = pimm(files[case], "--event", "0", "--split", "val", *options, "--out", out)
    assert (code, stdout) == (2, "")
    assert err.startswith("pimm: error: " + expected.format(path=files[case])) and err.count("\n") == 1, err
    assert not out.exists()


def test_the_command_line_offers_every_colouring_the_display_draws() -> None:
    assert show.COLOR_BY == COLOR_BY


def test_a_prediction_of_no_instance_is_drawn_beside_its_truth(files, pimm, panels, tmp_path) -> None:
    """An early checkpoint may predict no instance in an event: every view of it still draws (the truth's
    particles unmatched, every labelled thing point an instance error)."""
    dataset = PILArNetDataset(files["pilarnet"], split="val", revision="v2", label="pid", instances=True)
    raw = dataset.read_raw(0)
    dataset.close()
    none = np.full(len(raw["segment"]), -1)
    path = tmp_path / "none.h5"
    with PredictionWriter(path, has_instances=True, num_classes=6, class_names=list(PID_NAMES), split="val",
                          sources=[str(files["pilarnet"])]) as writer:
        writer.add(0, 0, 0, segment=raw["segment"], true_instance=raw["particle"], pred=raw["segment"],
                   point_index=raw["point_index"], coord=raw["coord"], instance=none,
                   instance_score=np.zeros(len(none)),
                   instance_table={"instance": none[:0], "class": none[:0], "score": np.zeros(0)})
    for color_by in ("instance", "error"):
        out = tmp_path / f"{color_by}.png"
        assert pimm(path, "--event", "0", "--color-by", color_by, "--side-by-side", "--out", out) == \
            (0, f"{out}\n", "")
    assert panels[0] == ["truth: 3D", "prediction: 3D"]
    assert _has_colour(_colours(tmp_path / "error.png"), WRONG_INSTANCE_COLOUR)
