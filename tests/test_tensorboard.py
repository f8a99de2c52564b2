"""TensorBoard scalars: rank 0 writes the metrics records to RUN_DIR/tensorboard/, read back here with
TensorBoard's own reader; a resumed run continues the same curves with every step exactly once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import copy_exp, launch

from pimm.config import load_config
from pimm.config.validate import check_config
from pimm.errors import ConfigError

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAMES = ["shower", "track", "michel", "delta", "low_energy"]  # data.names of configs/_base_


def expected_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] that metrics.jsonl says TensorBoard must show."""
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        keys = ("loss", "lr", "events_per_s") if rec["kind"] == "train" else ("loss", "miou", "macc", "allacc",
                                                                             "accuracy")
        values = {f"{rec['kind']}/{k}": rec[k] for k in keys}
        values.update({f"val/{m}/{n}": v for m in ("iou", "precision", "recall", "f1")
                       for n, v in zip(NAMES, rec.get(m, ()))})
        values = {tag: v for tag, v in values.items() if v is not None}  # null in metrics.jsonl: not a scalar
        for tag, value in values.items():
            out.setdefault(tag, []).append((rec["step"], value))
    return out


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def raw_steps(run_dir: Path, tag: str, files=None) -> list[int]:
    """The steps of `tag` in every event file (or those named in `files`), in reading order, before any purge."""
    return [e.step for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
            if files is None or path.name in files
            for e in EventFileLoader(str(path)).Load()
            if e.HasField("summary") and any(v.tag == tag for v in e.summary.value)]


def assert_same_curves(run_dir: Path) -> None:
    expected, shown = expected_scalars(run_dir), tensorboard_scalars(run_dir)
    assert sorted(shown) == sorted(expected)
    for tag, points in expected.items():
        steps = [s for s, _ in shown[tag]]
        assert steps == [s for s, _ in points], tag  # each step exactly once, in order
        for (_, got), (_, want) in zip(shown[tag], points):
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6), tag


def test_interrupted_then_resumed_run_has_continuous_curves(tmp_path, tiny_data, interrupted_at_7):
    # conftest's shared 2-rank run stopped at step 7 with tensorboard.enabled=true; this test resumes a copy
    exp = copy_exp(interrupted_at_7, tmp_path)
    run_dir = exp / "tests" / interrupted_at_7.name
    assert "tensorboard.enabled=true" in (run_dir / "launch.json").read_text()
    assert len(list((run_dir / "tensorboard").iterdir())) == 1  # rank 0 only
    assert [s for s, _ in tensorboard_scalars(run_dir)["train/loss"]] == list(range(1, 8))
    res, run_dir = launch(exp, tiny_data, 1, resume=True)  # the run's own config keeps TensorBoard on
    assert res.returncode == 0, res.stderr
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # one event file per attempt
    assert_same_curves(run_dir)
    assert [s for s, _ in tensorboard_scalars(run_dir)["train/loss"]] == list(range(1, 25))
    assert [s for s, _ in tensorboard_scalars(run_dir)["val/miou"]] == [12, 24]


def test_steps_redone_after_a_kill_are_shown_once_with_the_new_values(killed_in_checkpoint):
    # killed while writing the step-8 checkpoint: steps 5..8 (and later) were logged, then redone from step 4
    # (conftest's shared run, which logs to W&B as well: tests/test_wandb.py reads the same run)
    run_dir, killed_files = killed_in_checkpoint
    assert len(killed_files) == 1
    first = raw_steps(run_dir, "train/events_per_s", killed_files)
    assert first[-1] >= 8
    raw = raw_steps(run_dir, "train/events_per_s")
    assert len(raw) > len(set(raw))  # the event files do hold the redone steps twice ...
    assert_same_curves(run_dir)  # ... and TensorBoard shows each once, with the resumed attempt's values


def test_enabled_without_the_package_fails_before_anything_starts(monkeypatch):
    cfg = load_config(REPO / "configs/tests/tiny_semseg.py")
    cfg["tensorboard"] = {"enabled": True}
    check_config(cfg)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "tensorboard" else object())
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        check_config(cfg)
    cfg["tensorboard"] = {"enabled": "yes"}
    with pytest.raises(ConfigError, match="tensorboard.enabled='yes' is not allowed"):
        check_config(cfg)
