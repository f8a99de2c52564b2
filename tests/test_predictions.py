"""Prediction files (writer, rank-part merge, reader, metrics) and the `pimm show` event display."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from pimm import cli
from pimm.data.predictions import (
    PredictionWriter,
    merge_predictions,
    open_predictions,
    partial_path,
    read_event,
)
from pimm.data.synth import write_dataset, write_pilarnet
from pimm.display import WRONG_COLOUR
from pimm.errors import DataError
from pimm.tasks.metrics import metrics_from_predictions

CLASSES = ["shower", "track", "michel", "delta", "low_energy"]


def _event(event_id: int, num_classes: int = 5) -> dict[str, np.ndarray]:
    """Deterministic points of event `event_id` (event 5 has none)."""
    rng = np.random.default_rng(event_id)
    n = 0 if event_id == 5 else int(rng.integers(1, 60))
    scores = rng.random((n, num_classes)).astype(np.float32)
    return {"pred": scores.argmax(1), "point_index": np.arange(n) * 2, "coord": rng.random((n, 3)) * 256,
            "segment": rng.integers(-1, num_classes, n), "scores": scores / scores.sum(1, keepdims=True)}


def _write(path: Path, ids: list[int], rank: int | None = None, world_size: int = 2, **extra) -> Path:
    attrs = {"weights_sha256": "ab" * 32} | ({} if rank is None else {"rank": rank, "world_size": world_size})
    with PredictionWriter(path, num_classes=5, class_names=CLASSES, split="val", sources=["a.h5", "b.h5"],
                          save_scores=True, attrs=attrs | extra) as w:
        for i in ids:
            w.add(i, i % 2, 100 + i, **_event(i))
    return path


def test_two_rank_parts_merge_into_one_sorted_file_with_every_event_once(tmp_path: Path) -> None:
    parts = [_write(tmp_path / "rank0.h5", [6, 0, 4, 2], rank=0),  # unsorted: sorted on close
             _write(tmp_path / "rank1.h5", [1, 3, 5, 7, 9], rank=1)]
    with open_predictions(parts[0]) as p:
        assert p.event_ids.tolist() == [0, 2, 4, 6]
    out = merge_predictions(parts, tmp_path / "pred.h5")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["pred.h5"]  # parts removed, no partial left
    with open_predictions(out) as p:
        assert p.event_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]
        assert p.class_names == CLASSES and p.split == "val" and p.sources == ["a.h5", "b.h5"]
        assert p.provenance == {"weights_sha256": "ab" * 32, "world_size": 2}
        assert p.num_points == sum(len(_event(i)["pred"]) for i in p.event_ids)
        assert p.file["pred"].compression == "gzip" and p.file["coord"].maxshape == (None, 3)
        for i in p.event_ids.tolist():
            got, want = p.read_event(i), _event(i)
            assert (got["event_id"], got["source"], got["source_index"]) == (i, ["a.h5", "b.h5"][i % 2], 100 + i)
            np.testing.assert_array_equal(got["pred"], want["pred"])
            np.testing.assert_array_equal(got["point_index"], want["point_index"])
            np.testing.assert_array_equal(got["segment"], want["segment"])
            np.testing.assert_array_equal(got["coord"], want["coord"].astype(np.float32))
            assert got["scores"].dtype == np.float16 and got["scores"].shape == (len(want["pred"]), 5)
            np.testing.assert_allclose(got["scores"], want["scores"], atol=1e-3)
    assert read_event(out, 7)["source_index"] == 107
    with pytest.raises(DataError, match=r"^event 8 is not in .*pred.h5 \(it holds 9 events, ids 0..9\)$"):
        read_event(out, 8)


def test_a_writer_that_never_closes_leaves_only_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "pred.h5"
    script = (
        "import os, sys, numpy as np\n"
        "from pimm.data.predictions import PredictionWriter\n"
        f"w = PredictionWriter({str(path)!r}, num_classes=2, class_names=['a', 'b'], split='val', sources=['x'])\n"
        "for i in range(300):\n"
        "    w.add(i, 0, i, np.zeros(1000), np.arange(1000), np.zeros((1000, 3)), segment=np.zeros(1000))\n"
        "sys.stdout.flush(); os._exit(0)  # killed: no close()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert not path.exists() and partial_path(path).exists()
    with pytest.raises(DataError, match=r"pred.h5: not a complete pimm predictions file \(found pred.h5.partial"):
        open_predictions(path)
    with pytest.raises(DataError, match="not a complete pimm predictions file|not a readable HDF5 file"):
        open_predictions(partial_path(path))
    with pytest.raises(DataError, match=r"part .*pred.h5 is missing \(found pred.h5.partial: that rank did not"):
        merge_predictions([path], tmp_path / "merged.h5")
    # a writer left in a `with` block by an exception leaves nothing at all
    with pytest.raises(RuntimeError), PredictionWriter(tmp_path / "b.h5", num_classes=2, class_names=["a", "b"],
                                                       split="val", sources=["x"]):
        raise RuntimeError("evaluation failed")
    assert not (tmp_path / "b.h5").exists() and not partial_path(tmp_path / "b.h5").exists()


def test_merge_refuses_a_duplicated_event_and_a_missing_rank(tmp_path: Path) -> None:
    a = _write(tmp_path / "r0.h5", [0, 2, 4], rank=0)
    b = _write(tmp_path / "r1.h5", [1, 2, 3], rank=1)
    with pytest.raises(DataError, match=r"event 2 is in both .*r0.h5 and .*r1.h5"):
        merge_predictions([a, b], tmp_path / "pred.h5")
    assert a.exists() and b.exists() and not (tmp_path / "pred.h5").exists()
    assert not partial_path(tmp_path / "pred.h5").exists()
    c = _write(tmp_path / "r2.h5", [5], rank=2, world_size=3)
    with pytest.raises(DataError, match="differ in provenance world_size"):
        merge_predictions([a, c], tmp_path / "pred.h5")
    with pytest.raises(DataError, match=r"ranks \[0\] of world_size 2; rank\(s\) \[1\] missing"):
        merge_predictions([a], tmp_path / "pred.h5")
    with pytest.raises(DataError, match=r"\[0, 0\]"):
        merge_predictions([a, a], tmp_path / "pred.h5")


def test_prediction_files_follow_the_umask(tmp_path: Path) -> None:
    """A part, a merged file and an unsorted writer's file get 0666 & ~umask (readable by a group)."""
    previous = os.umask(0o027)
    try:
        parts = [_write(tmp_path / "r0.h5", [0, 2], rank=0), _write(tmp_path / "r1.h5", [3, 1], rank=1)]
        modes = [p.stat().st_mode & 0o777 for p in parts]
        merged = merge_predictions(parts, tmp_path / "pred.h5")
    finally:
        os.umask(previous)
    assert modes == [0o640, 0o640] and merged.stat().st_mode & 0o777 == 0o640


def test_metrics_from_predictions_match_a_hand_computed_confusion_matrix(tmp_path: Path) -> None:
    path = tmp_path / "pred.h5"
    with PredictionWriter(path, num_classes=3, class_names=["a", "b", "c"], split="test", sources=["x"],
                          has_labels=True) as w:
        w.add(0, 0, 0, pred=[0, 0, 1, 2, 2], point_index=np.arange(5), coord=np.zeros((5, 3)),
              segment=[0, 1, 1, -1, 2])
        w.add(1, 0, 1, pred=[1, 0, 2], point_index=np.arange(3), coord=np.zeros((3, 3)), segment=[1, -1, 0])
    m = metrics_from_predictions(path)
    # rows truth, columns prediction; the two points labelled -1 are left out
    assert m["confusion"] == [[1, 0, 1], [1, 2, 0], [0, 0, 1]]
    assert m["points"] == 6 and m["events"] == 2 and m["accuracy"] == pytest.approx(4 / 6)
    assert m["iou"] == pytest.approx([1 / 3, 2 / 3, 1 / 2])
    assert m["miou"] == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)
    # with another ignore_index the -1 labels are not classes
    with pytest.raises(DataError, match="truth label -1 is outside 0..2 and is not ignore_index=2"):
        metrics_from_predictions(path, ignore_index=2)


# ----------------------------------------------------------------------------- pimm show


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A pimm event file, PILArNet shards, and a prediction file of the event file's events
    (15% of points predicted wrong, 5% unlabelled)."""
    from pimm.data.dataset import LArTPCDataset

    root = tmp_path_factory.mktemp("show")
    data = write_dataset(root / "data.h5", 4, seed=3)
    write_pilarnet(root / "pilarnet", 3, seed=4, shards=2, split="val")
    dataset = LArTPCDataset(data)
    rng = np.random.default_rng(0)
    with PredictionWriter(root / "pred.h5", num_classes=5, class_names=dataset.class_names, split="val",
                          sources=[str(data)]) as w:
        for i in range(len(dataset)):
            raw = dataset.read_raw(i)
            truth, n = raw["segment"].astype(np.int16), len(raw["segment"])
            pred = np.where(rng.random(n) < 0.15, (truth + 1) % 5, truth)
            truth[rng.random(n) < 0.05] = -1
            w.add(i, 0, i, pred, np.arange(n), raw["coord"], segment=truth)
    dataset.close()
    return {"data": data, "pilarnet": root / "pilarnet", "pred": root / "pred.h5"}


@pytest.fixture
def pimm(capsys):
    """`pimm ...` in this process -> (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _colours(png: Path) -> np.ndarray:
    from matplotlib.image import imread

    image = imread(png)[..., :3]
    assert image.std() > 0.05, f"{png} is blank"
    return np.unique((image.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0)


def _has_colour(colours: np.ndarray, hex_colour: str) -> bool:
    rgb = np.array([int(hex_colour[k : k + 2], 16) for k in (1, 3, 5)])
    return bool((np.abs(colours.astype(int) - rgb).max(axis=1) <= 3).any())


def test_show_draws_truth_prediction_and_the_wrong_points_of_a_prediction_file(files, pimm, tmp_path,
                                                                                  monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = pimm("show", files["pred"], "--event", "2")
    png = files["pred"].parent / "display" / "pred-event_2.png"  # beside the file drawn, not in the current directory
    assert (code, out, err) == (0, f"{png}\n", "")
    assert list(tmp_path.iterdir()) == []
    colours = _colours(png)
    assert len(colours) > 20 and _has_colour(colours, WRONG_COLOUR)


@pytest.mark.parametrize("source", ["data", "pilarnet"])
def test_show_draws_the_truth_of_a_data_file(files, pimm, tmp_path, source: str) -> None:
    out = tmp_path / f"{source}.png"
    split = ["--split", "val"] if source == "pilarnet" else []
    code, stdout, err = pimm("show", files[source], "--event", "1", "--out", out, *split)
    assert (code, stdout, err) == (0, f"{out}\n", "")
    colours = _colours(out)
    assert len(colours) > 20 and not _has_colour(colours, WRONG_COLOUR)


def test_show_html_holds_the_event_points(files, pimm, tmp_path) -> None:
    pytest.importorskip("plotly", reason="--html needs the display extra: pip install -e '.[display]'")
    out = tmp_path / "event.html"
    assert pimm("show", files["pred"], "--event", "0", "--out", out, "--html")[:2] == (0, f"{out}\n")
    html = out.read_text()
    coord = read_event(files["pred"], 0)["coord"].astype(np.float64)
    for x in np.round(coord[:: max(len(coord) // 10, 1)], 2).ravel():
        assert f"{float(x)!r}" in html
    assert "<script" in html and "src=\"http" not in html  # plotly.js inline: opens offline


def test_show_html_without_plotly_names_the_pip_command(files, pimm, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if not installed
    code, out, err = pimm("show", files["pred"], "--event", "0", "--out", tmp_path / "e.html", "--html")
    assert (code, out) == (2, "")
    assert err == "pimm: error: --html needs plotly, which is not installed; install it with " \
                  "`pip install -e '.[display]'`\n"


@pytest.mark.parametrize("case", ["missing", "not_hdf5", "other_hdf5", "unknown_event", "incomplete",
                                  "unknown_data_event"])
def test_show_refuses_bad_input_in_one_line(files, pimm, tmp_path, case: str) -> None:
    import h5py

    path, event = {"missing": tmp_path / "nope.h5", "not_hdf5": tmp_path / "notes.txt",
                   "other_hdf5": tmp_path / "other.h5", "unknown_event": files["pred"],
                   "incomplete": tmp_path / "pred.h5", "unknown_data_event": files["data"]}[case], "1"
    if case == "not_hdf5":
        path.write_text("not an event file\n")
    if case == "other_hdf5":
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros(3)
    if case == "incomplete":
        partial_path(path).write_bytes(b"")
    if case.startswith("unknown"):
        event = "17"
    code, out, err = pimm("show", path, "--event", event, "--out", tmp_path / "e.png")
    assert (code, out) == (2, "")
    assert err.startswith("pimm: error: ") and err.count("\n") == 1, err
    expected = {"missing": "no such file", "not_hdf5": "not a readable HDF5 file",
                "other_hdf5": "not a pimm event file", "unknown_event": "event 17 is not in",
                "incomplete": "not a complete pimm predictions file (found pred.h5.partial",
                "unknown_data_event": "event 17 is not in"}[case]
    assert expected in err
    assert not (tmp_path / "e.png").exists()


def test_python_m_pimm_show_is_registered(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pimm", "show", tmp_path / "nope.h5", "--event", "0"], check=False,
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith("pimm: error: ") and proc.stderr.count("\n") == 1, proc.stderr
