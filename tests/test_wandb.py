"""W&B offline: rank 0 logs the metrics records to RUN_DIR/wandb/, one W&B run per attempt in one
group, read back here from the offline run files with W&B's own record schema; signals to every
process of the job, wandb-core included, never cost the checkpoint."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import zlib
from pathlib import Path

import pytest
from conftest import (
    REPO,
    attempts,
    kill_run,
    launch,
    losses,
    metrics_lines,
    processes_of,
    start_launch,
    wait_for_run,
    wait_until,
)

from pimm.config import load_config
from pimm.config.validate import check_config
from pimm.errors import ConfigError

pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

NAMES = ["shower", "track", "michel", "delta", "low_energy"]  # data.names of configs/_base_
_BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records


def wandb_records(path: Path) -> list:
    """Every Record of one offline run file (`run-<id>.wandb`), decoded with W&B's protobuf schema."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += _BLOCK - pos % _BLOCK
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def attempts_logged(run_dir: Path) -> list[dict]:
    """Per offline run directory (one per attempt, in time order): run id, name, group, history
    rows {step: {key: value}}, exit code (None when the attempt never finished its W&B run)."""
    out = []
    for run in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = run.glob("run-*.wandb")
        rows: dict[int, dict] = {}
        run_id, name, group, exit_code = None, None, None, None
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, name, group = record.run.run_id, record.run.display_name, record.run.run_group
            elif kind == "exit":
                exit_code = record.exit.exit_code
            elif kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                rows.setdefault(int(items.pop("_step")), {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")})
        out.append({"run_id": run_id, "name": name, "group": group, "rows": rows, "exit_code": exit_code})
    return out


def expected_rows(run_dir: Path) -> dict[int, dict]:
    """step -> {scalar: value} that metrics.jsonl says W&B must hold."""
    rows: dict[int, dict] = {}
    for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        keys = ("loss", "lr", "events_per_s") if rec["kind"] == "train" else ("loss", "miou", "macc", "allacc",
                                                                             "accuracy")
        values = {f"{rec['kind']}/{k}": rec[k] for k in keys}
        values.update({f"val/{m}/{n}": v for m in ("iou", "precision", "recall", "f1")
                       for n, v in zip(NAMES, rec.get(m, ()))})
        rows.setdefault(rec["step"], {}).update({tag: v for tag, v in values.items() if v is not None})
    return rows


def assert_close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert (math.isnan(got[key]) and math.isnan(value)) or got[key] == pytest.approx(value, rel=1e-9), key


def wandb_core_of(proc) -> list[int]:
    """pids of the wandb-core processes among the launch's own (conftest.processes_of: rank 0 starts
    wandb-core in a session of its own)."""
    found = []
    for pid in processes_of(proc):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "wandb-core":
                found.append(pid)
        except OSError:
            continue  # gone meanwhile
    return found


def all_but_core(proc) -> int:
    """How many of the launch's processes are not wandb-core (launcher, torchrun, ranks, loader workers)."""
    return len(set(processes_of(proc)) - set(wandb_core_of(proc)))


def test_sigusr1_to_every_process_then_the_resumed_attempt_logs_the_rest(tmp_path, tiny_data, reference):
    """Every process of the job gets SIGUSR1 (ranks, 2 loader workers each, torchrun, the launcher
    and wandb-core): exit 75 with a checkpoint, the attempt's W&B run finished as 75; the resumed
    attempt's W&B run (same group) starts after the checkpoint, and the two hold every record of
    metrics.jsonl exactly once, as in an uninterrupted run."""
    proc = start_launch(tmp_path, tiny_data, 2, "num_worker=4", "wandb.enabled=true", "wandb.system_metrics=false",
                        name="job")
    run_dir = tmp_path / "tests" / "job"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 3)
        assert wait_until(lambda: all_but_core(proc) >= 8 and wandb_core_of(proc), timeout=30)
        core = wandb_core_of(proc)
        for pid in processes_of(proc):
            os.kill(pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    assert "Traceback" not in err and "W&B" not in err
    stopped_at = attempts(run_dir)[-1]["checkpoint_step"]
    assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in core), timeout=30)  # gone with rank 0

    res, run_dir = launch(tmp_path, tiny_data, 2, "num_worker=4", name="job", resume=True)  # wandb stays on
    assert res.returncode == 0, res.stderr
    first, second = attempts_logged(run_dir)
    assert first["run_id"] != second["run_id"] and first["group"] == second["group"] == "job"
    assert (first["name"], second["name"]) == ("job-attempt-1", "job-attempt-2")
    assert (first["exit_code"], second["exit_code"]) == (75, 0)
    assert max(first["rows"]) <= stopped_at < min(second["rows"])
    merged = {**first["rows"], **second["rows"]}
    expected = expected_rows(run_dir)
    assert sorted(merged) == sorted(expected) and max(merged) == 24
    for step, row in expected.items():
        assert_close(merged[step], row)
    assert losses(run_dir) == losses(reference)  # W&B changed nothing of the training


def test_sigterm_to_every_process_including_wandb_core_still_checkpoints(tmp_path, tiny_data):
    """What `scancel` does to a Slurm step: SIGTERM to every process, wandb-core included, which exits
    on it. The ranks still write their checkpoint and exit 75; W&B's loss is a warning, not a
    traceback; the resumed attempt logs to a new W&B run and finishes."""
    proc = start_launch(tmp_path, tiny_data, 2, "num_worker=4", "wandb.enabled=true", "wandb.system_metrics=false",
                        name="term")  # the tiny config's 2 epochs: 24 steps
    run_dir = tmp_path / "tests" / "term"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 3)
        assert wait_until(lambda: all_but_core(proc) >= 8 and wandb_core_of(proc), timeout=30)
        for pid in processes_of(proc):
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    assert "Traceback" not in err
    manifest = json.loads((run_dir / "model/last/.complete").read_text())
    assert attempts(run_dir)[-1]["outcome"] == "interrupted by SIGTERM"
    assert attempts(run_dir)[-1]["checkpoint_step"] == manifest["step"] < 24
    res, run_dir = launch(tmp_path, tiny_data, 2, "num_worker=4", name="term", resume=True)
    assert res.returncode == 0, res.stderr
    first, second = attempts_logged(run_dir)
    assert second["exit_code"] == 0 and min(second["rows"]) == manifest["step"] + 1 and max(second["rows"]) == 24


def test_after_a_kill_the_resumed_attempt_logs_from_its_checkpoint(killed_in_checkpoint):
    """Killed while writing the step-8 checkpoint (steps after 4 were logged, then redone from step 4):
    the killed attempt's W&B run never finished and holds what wandb-core had written; the resumed
    attempt logs every step after 4 with the numbers metrics.jsonl keeps. (conftest's shared run, which
    logs to TensorBoard as well: tests/test_tensorboard.py reads the same run.)"""
    run_dir, _ = killed_in_checkpoint
    first, second = attempts_logged(run_dir)
    assert first["exit_code"] is None and second["exit_code"] == 0  # SIGKILL: the first never finished
    expected = expected_rows(run_dir)  # metrics.jsonl: the resumed attempt's numbers for redone steps
    assert sorted(second["rows"]) == [s for s in sorted(expected) if s > 4]
    for step, row in second["rows"].items():
        assert_close(row, expected[step])
    for step, row in first["rows"].items():  # what was written before the kill is a true record
        if step <= 4:
            assert_close(row, expected[step])


def test_wandb_core_killed_by_sigterm_turns_wandb_off_not_the_training(tmp_path, tiny_data):
    """Slurm's scancel signals every process of a step; wandb-core exits on SIGTERM. The run goes on
    (this SIGTERM reached wandb-core only), warns once, and metrics.jsonl keeps every record."""
    proc = start_launch(tmp_path, tiny_data, 1, "wandb.enabled=true", "wandb.system_metrics=false", "epochs=3",
                        name="core")
    run_dir = tmp_path / "tests" / "core"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 2 and wandb_core_of(proc))
        for pid in wandb_core_of(proc):
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        kill_run(proc)
    assert proc.returncode == 0, err
    assert err.count("W&B log failed") + err.count("W&B finish failed") == 1, err
    assert "Traceback" not in err
    assert max(json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()) == 36
    assert attempts(run_dir)[-1]["outcome"] == "completed"


def test_options_checked_before_anything_starts(monkeypatch):
    cfg = load_config(REPO / "configs/tests/tiny_semseg.py")
    cfg["wandb"] = {"enabled": True, "project": "lartpc", "tags": ["a"]}
    check_config(cfg)
    for key, value, message in (("mode", "online", "wandb.mode='online' is not allowed"),
                                ("tags", "a,b", "wandb.tags='a,b' is not allowed"),
                                ("project", "", "wandb.project='' is not allowed")):
        with pytest.raises(ConfigError, match=message):
            check_config({**cfg, "wandb": {**cfg["wandb"], key: value}})
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match=r"pip install wandb==0.31.0"):
        check_config(cfg)
