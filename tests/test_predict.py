"""`pimm predict`: predictions without labels from a run or an export, on pimm event files and
PILArNet-M shards, equal to `pimm test --save-predictions` on the labelled original; one-line refusals."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
from conftest import REPO, pimm_in_process, run_pimm

from pimm.cli import main
from pimm.data.predictions import open_predictions


@pytest.fixture
def trained(tested_run):
    """conftest's shared finished 1-rank run (4 steps; its config also has a data.test)."""
    return tested_run.run_dir


@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory, tiny_data):
    """The tiny val file without its `segment` dataset."""
    path = tmp_path_factory.mktemp("unlabelled") / "nolabels.h5"
    shutil.copy(tiny_data["val"], path)
    with h5py.File(path, "a") as f:
        del f["segment"]
    return path


def predict(*args, cwd=REPO):
    return run_pimm(["predict", *map(str, args)], cwd=cwd)


def read(path):
    with open_predictions(path) as preds:
        events = {int(i): preds.read_event(int(i)) for i in preds.event_ids}
        return preds.header(), preds.provenance, events


def test_unlabelled_file_at_2_ranks_equals_pimm_test(trained, evaluations, unlabelled, tiny_data, tmp_path):
    out = tmp_path / "preds.h5"
    res = predict("--weights", trained, "--data", unlabelled, "--out", out, "--resources.nproc-per-node", 2,
                  "--save-scores")
    assert res.returncode == 0, res.stderr
    assert list(tmp_path.iterdir()) == [out]  # the hidden scratch directory is gone
    with h5py.File(out, "r") as f:
        assert "segment" not in f and "scores" in f
    header, provenance, events = read(out)
    assert not header["has_labels"] and sorted(events) == list(range(12))
    assert provenance["world_size"] == 2 and len(provenance["weights_sha256"]) == 64
    assert provenance["data"]["num_events"] == 12 and provenance["data"]["content_hash"]

    # `pimm test --save-predictions` of the same run's labelled data.test (the tiny val file), at 1 rank
    res, test_dir = evaluations["one"]
    assert res.returncode == 0, res.stderr
    assert "--save-predictions" in res.args and f"data.test={{type: LArTPCDataset, path: {tiny_data['val']}}}" in (
        (trained / "launch.json").read_text())
    _, tested_provenance, tested = read(test_dir / "predictions.h5")
    assert sorted(tested) == sorted(events)
    assert tested_provenance["weights_sha256"] == provenance["weights_sha256"]
    for i, event in tested.items():
        assert np.array_equal(events[i]["pred"], event["pred"]), i
        assert np.array_equal(events[i]["coord"], event["coord"])

    # pimm test refuses the unlabelled file in one line that points at pimm predict
    res = pimm_in_process(["test", "--run-dir", str(trained), "--out", str(tmp_path / "t2"), "--",
                           f"data.test={{type: LArTPCDataset, path: {unlabelled}}}"])
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "pimm predict" in lines[0], res.stderr


def test_pilarnet_shards_and_an_export(trained, unlabelled, tmp_path, capsys):
    from pimm.data.synth import write_pilarnet

    write_pilarnet(tmp_path / "shards", 5, seed=3, shards=2, split="test")
    out = tmp_path / "out" / "pilarnet.h5"
    out.parent.mkdir()
    res = predict("--weights", trained, "--data", tmp_path / "shards", "--split", "test", "--out", out,
                  "--resources.nproc-per-node", 2)
    assert res.returncode == 0, res.stderr
    header, provenance, events = read(out)
    assert not header["has_labels"] and sorted(events) == list(range(5)) and len(header["sources"]) == 2
    assert provenance["data"]["layout"] == "pilarnet" and provenance["data"]["split"] == "test"
    with h5py.File(out, "r") as f:
        assert "segment" not in f

    export = tmp_path / "export"
    assert main(["export", "--run-dir", str(trained), str(export)]) == 0
    capsys.readouterr()
    from_export = tmp_path / "export.h5"
    res = predict("--weights", export, "--data", unlabelled, "--out", from_export)
    assert res.returncode == 0, res.stderr
    _, provenance, events = read(from_export)
    assert provenance["world_size"] == 1 and sorted(events) == list(range(12))
    assert json.loads((export / "config.json").read_text())["num_classes"] == header["num_classes"]


@pytest.mark.parametrize("case", ["missing_weights", "weights_file", "missing_data", "not_event_file", "existing_out"])
def test_bad_input_exits_2_with_one_line(trained, unlabelled, tmp_path, capsys, case):
    (tmp_path / "exists.h5").write_text("")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros(3)
    weights, data, out, expect = {
        "missing_weights": (tmp_path / "nope", unlabelled, tmp_path / "p.h5", "does not exist"),
        "weights_file": (tmp_path / "exists.h5", unlabelled, tmp_path / "p.h5", "model config"),
        "missing_data": (trained, tmp_path / "none.h5", tmp_path / "p.h5", "--data"),
        "not_event_file": (trained, tmp_path / "other.h5", tmp_path / "p.h5", "not a pimm event file"),
        "existing_out": (trained, unlabelled, tmp_path / "exists.h5", "never overwritten"),
    }[case]
    code = main(["predict", "--weights", str(weights), "--data", str(data), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("pimm: error:"), lines
    assert expect in lines[0]
    assert not (tmp_path / "p.h5").exists() and not (tmp_path / ".p.h5.pimm-predict").exists()
