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
    write_instance_table,
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


# ----------------------------------------------------------------------------- instance predictions


def _instances(event_id: int) -> dict:
    """Deterministic instance predictions of `_event(event_id)`'s points: up to 4 instances (some
    on no point), table rows in shuffled id order, momentum and vertex on odd events only."""
    n = len(_event(event_id)["pred"])
    rng = np.random.default_rng(1000 + event_id)
    k = int(rng.integers(0, 5))
    table = {"instance": rng.permutation(k), "class": rng.integers(0, 5, k), "score": rng.random(k).astype(np.float32)}
    if event_id % 2:
        table |= {"momentum": (rng.random(k) * 500).astype(np.float32),
                  "vertex": (rng.random((k, 3)) * 768).astype(np.float32)}
    return {"instance": rng.integers(-1, k, n) if k else np.full(n, -1), "instance_score": rng.random(n),
            "true_instance": rng.integers(-1, 4, n), "instance_table": table}


def _write_instances(path: Path, ids: list[int], rank: int = 0) -> Path:
    with PredictionWriter(path, num_classes=5, class_names=CLASSES, split="val", sources=["a.h5", "b,c.h5"],
                          save_scores=True, has_instances=True, attrs={"rank": rank, "world_size": 2},
                          compress=False) as w:
        for i in ids:
            w.add(i, i % 2, 100 + i, **_event(i), **_instances(i))
    return path


def test_instance_predictions_of_two_ranks_merge_and_read_back_exactly(tmp_path: Path) -> None:
    parts = [_write_instances(tmp_path / "rank0.h5", [6, 0, 4, 2], rank=0),  # unsorted: sorted on close
             _write_instances(tmp_path / "rank1.h5", [1, 3, 5, 7, 9], rank=1)]
    out = merge_predictions(parts, tmp_path / "pred.h5")
    with open_predictions(out) as p:
        assert p.has_instances and int(p.file.attrs["version"]) == 2
        assert p.event_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]
        assert p.num_instances == sum(len(_instances(i)["instance_table"]["instance"]) for i in p.event_ids)
        for i in p.event_ids.tolist():
            got, want = p.read_event(i), _instances(i)
            np.testing.assert_array_equal(got["pred"], _event(i)["pred"])
            for name in ("instance", "true_instance"):
                assert got[name].dtype == np.int32
                np.testing.assert_array_equal(got[name], want[name])
            assert got["instance_score"].dtype == np.float16
            np.testing.assert_allclose(got["instance_score"], want["instance_score"], atol=1e-3)
            table, given = got["instance_table"], want["instance_table"]
            for name in ("instance", "class", "score"):
                np.testing.assert_array_equal(table[name], given[name])
            np.testing.assert_array_equal(table["size"], [(want["instance"] == k).sum() for k in given["instance"]])
            k = len(given["instance"])
            assert table["momentum"].shape == (k,) and table["vertex"].shape == (k, 3)
            if i % 2:
                np.testing.assert_array_equal(table["momentum"], given["momentum"])
                np.testing.assert_array_equal(table["vertex"], given["vertex"])
            else:  # not given: NaN
                assert np.isnan(table["momentum"]).all() and np.isnan(table["vertex"]).all()


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    """Columns of a CSV file: through pandas.read_csv when pandas is installed, else the csv module."""
    try:
        import pandas  # deferred: pandas is optional; the csv module reads the file without it
    except ImportError:
        import csv  # deferred: only without pandas

        with open(path, newline="") as stream:
            rows = list(csv.DictReader(stream))
        return {name: np.array([row[name] for row in rows]) for name in rows[0]}
    frame = pandas.read_csv(path)
    return {name: frame[name].to_numpy() for name in frame.columns}


def test_the_instance_table_is_one_csv_row_per_instance(tmp_path: Path) -> None:
    ids = [0, 1, 2, 3, 4, 5]
    csv_path = write_instance_table(_write_instances(tmp_path / "pred.h5", ids), tmp_path / "instances.csv")
    assert csv_path.read_text().splitlines()[0] == ("event_id,source,source_index,instance,class,class_name,score,"
                                                    "size,momentum,vertex_x,vertex_y,vertex_z")
    columns = _read_csv(csv_path)
    want = {name: [] for name in columns}
    for i in ids:
        given = _instances(i)
        table = given["instance_table"]
        k = len(table["instance"])
        nan = np.full(k, np.nan)
        vertex = table.get("vertex", np.full((k, 3), np.nan))
        for name, values in (("event_id", [i] * k), ("source", [["a.h5", "b,c.h5"][i % 2]] * k),
                             ("source_index", [100 + i] * k), ("instance", table["instance"]),
                             ("class", table["class"]), ("class_name", [CLASSES[c] for c in table["class"]]),
                             ("score", table["score"]),
                             ("size", [(given["instance"] == j).sum() for j in table["instance"]]),
                             ("momentum", table.get("momentum", nan)), ("vertex_x", vertex[:, 0]),
                             ("vertex_y", vertex[:, 1]), ("vertex_z", vertex[:, 2])):
            want[name].extend(values)
    assert len(columns["event_id"]) == len(want["event_id"]) > 5
    for name in ("event_id", "source_index", "instance", "class", "size"):
        np.testing.assert_array_equal(columns[name].astype(np.int64), want[name], err_msg=name)
    assert columns["source"].tolist() == want["source"] and columns["class_name"].tolist() == want["class_name"]
    for name in ("score", "momentum", "vertex_x", "vertex_y", "vertex_z"):  # float32 text reads back exactly
        np.testing.assert_array_equal(columns[name].astype(np.float64).astype(np.float32), want[name], err_msg=name)
    with pytest.raises(DataError, match=r"r0.h5: has no instance predictions .*needs the predictions of a Panoptic"):
        write_instance_table(_write(tmp_path / "r0.h5", [0], rank=0), tmp_path / "none.csv")
    assert not (tmp_path / "none.csv").exists()


def test_version_1_files_still_read_and_a_newer_version_is_refused(tmp_path: Path) -> None:
    import h5py

    semantic = _write(tmp_path / "semantic.h5", [0, 1])
    with h5py.File(semantic, "r+") as f:
        assert int(f.attrs["version"]) == 1  # a file without instances is still version 1, for older readers
        del f.attrs["has_instances"]  # as written before instances
    with open_predictions(semantic) as p:
        assert not p.has_instances and p.num_instances == 0
        assert "instance_table" not in p.read_event(1) and "instance" not in p.read_event(1)
    with h5py.File(semantic, "r+") as f:
        f.attrs["version"] = 3
    with pytest.raises(DataError, match=r"predictions format version 3 is not supported \(this pimm reads "
                       r"versions 1, 2\); read it with the pimm that wrote it or a newer one$"):
        open_predictions(semantic)


def _one_instance_event() -> dict:
    return {"pred": [0, 1, 1], "point_index": np.arange(3), "coord": np.zeros((3, 3)), "segment": [0, 1, 1],
            "instance": [-1, 0, 0], "instance_score": [0.0, 0.9, 0.8], "true_instance": [-1, 0, 0],
            "instance_table": {"instance": [0], "class": [1], "score": [0.85]}}


@pytest.mark.parametrize("change, expected", [
    ({"instance_table": None}, "event 0 lacks instance_table: a writer with has_instances=True needs"),
    ({"true_instance": None}, r"true_instance must be given exactly when has_labels \(has_labels=True\)"),
    ({"instance": [-1, 0, 3]}, r"event 0: points of instance\(s\) \[3\] have no row in instance_table"),
    ({"instance": [-2, 0, 0]}, r"instance of event 0 must be integer ids >= 0 or -1 \(none\)"),
    ({"instance_table": {"instance": [0, 0], "class": [1, 1], "score": [1, 1]}}, "repeats an id: \\[0, 0\\]"),
    ({"instance_table": {"instance": [0], "class": [5], "score": [1]}}, r"\['class'\] of event 0 must be classes 0..4"),
    ({"instance_table": {"instance": [0], "class": [1], "score": [1], "size": [3]}},
     r"\['size'\] of event 0 is \[3\], but the points of those instances number \[2\]; leave 'size' out"),
    ({"instance_table": {"instance": [0], "class": [1], "score": [1], "energy": [1]}}, r"unknown keys \['energy'\]"),
    ({"instance_table": {"instance": [0], "class": [1], "score": [1], "vertex": [1, 2, 3]}},
     r"\['vertex'\] of event 0 has shape \(3,\), expected \(1, 3\)"),
])
def test_the_writer_refuses_inconsistent_instances_and_keeps_nothing_of_them(tmp_path: Path, change: dict,
                                                                            expected: str) -> None:
    path = tmp_path / "pred.h5"
    with PredictionWriter(path, num_classes=5, class_names=CLASSES, split="val", sources=["a.h5"],
                          has_instances=True) as w:
        with pytest.raises(ValueError, match=expected):
            w.add(0, 0, 0, **(_one_instance_event() | change))
        w.add(0, 0, 0, **_one_instance_event())
    with open_predictions(path) as p:
        assert p.num_points == 3 and p.num_instances == 1
        assert p.read_event(0)["instance_table"]["size"].tolist() == [2]


def test_a_writer_without_instances_refuses_them(tmp_path: Path) -> None:
    with PredictionWriter(tmp_path / "pred.h5", num_classes=5, class_names=CLASSES, split="val",
                          sources=["a.h5"]) as w, pytest.raises(ValueError, match=(
            r"^instance, instance_score, instance_table, true_instance given for event 0, but this writer was made "
            "with has_instances=False; pass has_instances=True to PredictionWriter$")):
        w.add(0, 0, 0, **_one_instance_event())


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
