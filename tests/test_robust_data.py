"""Non-finite data and metrics: refused at launch (one line, exit 2, nothing written) or left out
with data.<split>.skip_nonfinite=true; every JSON file pimm writes is standard JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO, TINY, pimm_in_process, run_pimm

from pimm.config import load_config, resolve_config_path
from pimm.config.paths import config_roots
from pimm.data.event_file import validate_data
from pimm.data.event_format import select_events
from pimm.data.pilarnet_file import write_pilarnet_file
from pimm.data.synth import pilarnet_event, write_dataset, write_pilarnet
from pimm.errors import DataError
from pimm.json_io import dumps, metric_text
from pimm.models import build_model


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every parser outside Python does."""
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _spoil(path: Path, events: dict[int, tuple[str, int, float]]) -> Path:
    """Set, per event index, one value of a pimm event file: (dataset, column or -1, value)."""
    with h5py.File(path, "r+") as f:
        offsets = f["offsets"][:]
        for event, (name, column, value) in events.items():
            row = int(offsets[event]) + 2  # point 2 of the event
            if column < 0:
                f[name][row] = value
            else:
                f[name][row, column] = value
    return path


def _launch(exp: Path, train: str, val: str, *extra: str, dry_run: bool = False, overrides=(), refused=False):
    """`pimm launch` of the tiny config on this data; refused=True: a launch the test expects to be refused
    before any process starts, run through pimm's CLI in this process."""
    args = ["launch", "--train.config", TINY, "--resources.nproc-per-node", "1", "--run.name", "run",
            "--run.no-timestamp", "--paths.exp-root", str(exp), *(["--dry-run"] if dry_run else []), *extra,
            "--", f"data.train={train}", f"data.val={val}", *overrides]
    return pimm_in_process(args) if refused else run_pimm(args, cwd=REPO, timeout=180)


def _event_file_spec(path: Path, **kw) -> str:
    options = "".join(f", {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items())
    return f"{{type: LArTPCDataset, path: {path}{options}}}"


def _problem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_nan_coordinate_refuses_the_launch_in_one_line(tmp_path: Path, tiny_data) -> None:
    train = _spoil(write_dataset(tmp_path / "train.h5", 48, seed=11), {5: ("coord", 1, math.nan)})
    for dry_run in (True, False):
        res = _launch(tmp_path / "exp", _event_file_spec(train), _event_file_spec(tiny_data["val"]), dry_run=dry_run,
                      refused=True)
        assert res.returncode == 2, res.stdout + res.stderr
        lines = _problem_lines(res.stderr)
        assert len(lines) == 1, res.stderr
        assert (f"{train}: event 5 has a non-finite y coordinate (nan) at point 2 of the event; 1 of 48 events"
                in lines[0]), lines[0]
        assert "set data.<split>.skip_nonfinite=true" in lines[0]
        assert not (tmp_path / "exp").exists()  # no run directory


def test_inf_energy_in_a_pilarnet_shard_refuses_the_launch_in_one_line(tmp_path: Path) -> None:
    events = [pilarnet_event(21, i) for i in range(8)]
    events[3]["point"][7, 3] = np.inf
    write_pilarnet_file(tmp_path / "d" / "train" / "train_000.h5", events)
    write_pilarnet(tmp_path / "d", 4, seed=22, split="val")

    def spec(split: str) -> str:
        return f"{{type: PILArNetDataset, path: {tmp_path / 'd'}, split: {split}, volume_size: 256.0}}"

    res = _launch(tmp_path / "exp", spec("train"), spec("val"), overrides=["batch_size=2"], refused=True)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = _problem_lines(res.stderr)
    assert len(lines) == 1, res.stderr
    assert "train_000.h5: event 3 has a non-finite energy (inf); 1 of 8 events of this file" in lines[0], lines[0]
    assert "skip_nonfinite=true" in lines[0]
    assert not (tmp_path / "exp").exists()
    # the scan is part of the cached index: a second check reads nothing but the index
    assert (tmp_path / "d" / "train" / "train_000.h5.pimm-index.npz").exists()


def test_skip_nonfinite_drops_the_events_on_the_command_line_and_trains(tmp_path: Path, tiny_data) -> None:
    train = _spoil(write_dataset(tmp_path / "train.h5", 48, seed=11), {
        5: ("coord", 0, math.nan), 17: ("energy", -1, math.inf), 30: ("coord", 2, -math.inf)})
    res = _launch(tmp_path / "exp", _event_file_spec(train, skip_nonfinite=False),
                  _event_file_spec(tiny_data["val"]), overrides=["data.train.skip_nonfinite=true", "max_steps=2",
                                                                 "epochs=1", "checkpoint_async=false"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"data {train}: dropped 3 of 48 events with non-finite values (skip_nonfinite=true)" in res.stderr
    run_dir = tmp_path / "exp" / "tests" / "run"
    assert "dropped 3 of 48 events" in (run_dir / "logs" / "rank0.log").read_text()
    # the dropped set is part of the data identity a resume checks
    prov = strict_json((run_dir / "provenance.json").read_text())
    data = prov["attempts"][0]["data"]["train"]
    assert data["num_events"] == 45
    info, _, _, events = select_events(train, skip_nonfinite=True)
    assert data["content_hash"] == info["content_hash"] != h5py.File(train, "r").attrs["content_hash"]
    assert 5 not in events and 17 not in events and len(events) == 45
    for name in ("summary.json", "model/model_best.json"):
        strict_json((run_dir / name).read_text())
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        strict_json(line)


def test_dropped_events_change_the_data_identity(tmp_path: Path) -> None:
    a = _spoil(write_dataset(tmp_path / "a.h5", 6, seed=3), {1: ("coord", 0, math.nan)})
    b = _spoil(write_dataset(tmp_path / "b.h5", 6, seed=3), {2: ("coord", 0, math.nan)})
    clean = write_dataset(tmp_path / "c.h5", 6, seed=3)
    hashes = [select_events(p, skip_nonfinite=True)[0]["content_hash"] for p in (a, b, clean)]
    assert len(set(hashes)) == 3
    # without drops the identity is the file's own (runs of clean data resume as before)
    assert hashes[2] == h5py.File(clean, "r").attrs["content_hash"]


def test_nonfinite_validation_is_loud_and_summary_is_standard_json(tmp_path: Path, tiny_data) -> None:
    cfg = load_config(resolve_config_path(TINY, config_roots()))
    state = build_model(cfg["model"]).state_dict()
    state = {k: v.fill_(math.nan) if v.is_floating_point() else v for k, v in state.items()}
    torch.save(state, tmp_path / "nan.pth")
    res = _launch(tmp_path / "exp", _event_file_spec(tiny_data["train"]), _event_file_spec(tiny_data["val"]),
                  "--train.weight", str(tmp_path / "nan.pth"), overrides=["validate_only=true"])
    warning = [line for line in res.stderr.splitlines() if "not finite" in line]
    assert warning and "validation epoch 0 step 0: loss not finite (loss=nan)" in warning[0], res.stderr
    run_dir = tmp_path / "exp" / "tests" / "run"
    summary = strict_json((run_dir / "summary.json").read_text())
    assert summary["final_val"]["loss"] is None and summary["final_val"]["nonfinite"] == ["loss"]
    assert summary["best_value"] is None
    record = strict_json((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["loss"] is None and record["nonfinite"] == ["loss"]
    strict_json((run_dir / "provenance.json").read_text())
    assert not (run_dir / "model" / "model_best.pth").exists()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "validation finished" in res.stdout and "(loss null (not finite), 12 events)" in res.stdout, res.stdout


def test_dumps_writes_null_for_every_nonfinite_number() -> None:
    value = {"a": math.nan, "b": [math.inf, 1.5, np.float32("nan"), np.float64(-np.inf)], "c": (2, "x")}
    assert strict_json(dumps(value)) == {"a": None, "b": [None, 1.5, None, None], "c": [2, "x"]}


def test_a_metric_that_is_null_or_not_finite_prints_as_n_a() -> None:
    """Every console line of metrics (pimm test's, a task's validation line) prints through metric_text: a value
    read back as null and a NaN straight from the meter print alike."""
    assert [metric_text(v) for v in (None, math.nan, np.float32("nan"), -math.inf)] == ["n/a"] * 4
    # with a standard error where it is finite; a value that is not stays n/a
    assert [metric_text(0.25, 0.0125), metric_text(0.25, math.nan), metric_text(0.25, None), metric_text(None, 0.1)] \
        == ["0.2500 ± 0.0125", "0.2500", "0.2500", "n/a"]
    assert [metric_text(v) for v in (0.123456, np.float64(1.0), 0)] == ["0.1235", "1.0000", "0.0000"]


def test_empty_event_file_says_it_has_no_events(tmp_path: Path, tiny_data) -> None:
    empty = tmp_path / "empty.h5"
    with h5py.File(empty, "w") as f:
        f.create_dataset("coord", shape=(0, 3), dtype="<f4")
        f.create_dataset("energy", shape=(0,), dtype="<f4")
        f.create_dataset("segment", shape=(0,), dtype="u1")
        f.create_dataset("offsets", data=np.zeros(1, np.int64))
        f.attrs.update(format="pimm-events", format_version=1, num_events=0, content_hash="0" * 64)
    res = _launch(tmp_path / "exp", _event_file_spec(empty), _event_file_spec(tiny_data["val"]), dry_run=True,
                  refused=True)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"event file {empty}: the file has no events (num_events=0, 0 point rows)" in res.stderr
    assert "inconsistent" not in res.stderr


def test_negative_cluster_size_is_named_plainly(tmp_path: Path) -> None:
    event = pilarnet_event(5, 0)
    event["cluster"][1, 0] = -event["cluster"][1, 0]
    path = write_pilarnet_file(tmp_path / "neg.h5", [pilarnet_event(5, 1), event])
    spec = f"{{type: PILArNetDataset, path: {path}, volume_size: 256.0}}"
    res = _launch(tmp_path / "exp", spec, spec, dry_run=True, refused=True)
    assert res.returncode == 2, res.stdout + res.stderr
    assert (f"{path}: event 1: cluster 1 has size {int(event['cluster'][1, 0])}; a cluster's size is its number "
            "of points and cannot be negative") in res.stderr, res.stderr


def test_the_point_scan_is_cached_beside_the_file_and_redone_when_it_changes(tmp_path: Path, monkeypatch) -> None:
    from pimm.data import event_format as event_file

    path = write_dataset(tmp_path / "e.h5", 6, seed=3)
    spec = {"type": "LArTPCDataset", "path": str(path)}
    validate_data(spec, num_classes=5)
    scans = []
    real_scan = event_file._scan_points
    monkeypatch.setattr(event_file, "_scan_points", lambda *a: scans.append(a) or real_scan(*a))
    validate_data(spec, num_classes=5)
    assert not scans  # the second launch reads no point
    with pytest.raises(DataError, match=r"event \d has label \d, outside 0..2"):
        validate_data(spec, num_classes=3)  # labels are checked from the cache too
    _spoil(path, {4: ("energy", -1, math.nan)})
    with pytest.raises(DataError, match="event 4 has a non-finite energy"):
        validate_data(spec, num_classes=5)
    assert len(scans) == 1


def test_pilarnet_scan_checks_the_columns_pimm_reads(tmp_path: Path) -> None:
    events = [pilarnet_event(9, i) for i in range(6)]
    events[1]["point"][4, 6] = np.nan  # dx: not read by pimm
    events[2]["point"][:, 5] = 3e38  # electrons: finite values whose sum overflows to inf
    spec = {"type": "PILArNetDataset", "path": str(write_pilarnet_file(tmp_path / "a.h5", events))}
    assert validate_data(spec)["num_events"] == 6
    events[4]["point"][9, 0] = -np.inf
    events[4]["point"][11, 3] = np.nan
    spec["path"] = str(write_pilarnet_file(tmp_path / "b.h5", events))
    with pytest.raises(DataError, match=r"b.h5: event 4 has a non-finite x coordinate \(-inf\); 1 of 6 events"):
        validate_data(spec)
    info = validate_data({**spec, "skip_nonfinite": True})
    assert (info["num_events"], info["nonfinite_dropped"]) == (5, 1)
