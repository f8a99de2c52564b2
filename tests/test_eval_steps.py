"""eval_every_n_steps: validation (with the complete metric set) after every N-th optimizer step,
mid-epoch, at the same steps and with the same results and best model when the run is stopped by
SIGUSR1 (every process, loader workers on) and resumed on another number of processes."""

from __future__ import annotations

import json
import signal

import pytest
from conftest import kill_run, launch, metrics_lines, processes_of, signal_all, start_launch, wait_for_run

EVERY_5 = ("eval_every_n_steps=5", "epochs=2", "num_worker=2")  # 12 steps per epoch, 24 in all


def val_records(run_dir) -> dict[int, dict]:
    """step -> the last validation record of that step (a resumed run may repeat none)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "val"}


def test_validation_every_n_steps_survives_a_stop_and_a_topology_change(tmp_path, tiny_data):
    res, ref = launch(tmp_path / "a", tiny_data, 2, *EVERY_5, name="ref")
    assert res.returncode == 0, res.stderr
    reference = val_records(ref)
    # every 5th step mid-epoch, and the epoch ends (12, 24) once each
    assert sorted(reference) == [5, 10, 12, 15, 20, 24]
    for record in reference.values():
        for key in ("miou", "macc", "allacc", "precision", "recall", "f1", "confusion", "class_points"):
            assert key in record, key
    lines = (ref / "metrics.jsonl").read_text().splitlines()
    assert sum(json.loads(x)["kind"] == "val" for x in lines) == 6  # no step validated twice
    assert (ref / "model" / "step_00000020" / ".complete").is_file()  # checkpointed right after its validation

    exp = tmp_path / "b"
    proc = start_launch(exp, tiny_data, 2, *EVERY_5, name="job")
    run_dir = exp / "tests" / "job"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 8)  # past the validation of step 5
        signal_all(processes_of(proc), signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    stopped = json.loads((run_dir / "model/last/.complete").read_text())["step"]
    assert 5 <= stopped < 24
    res, _ = launch(exp, tiny_data, 1, name="job", resume=True)  # on 1 process instead of 2
    assert res.returncode == 0, res.stderr
    resumed = val_records(run_dir)
    assert sorted(resumed) == sorted(reference)
    for step, record in reference.items():  # 2 -> 1 process: the same events, sums in another order
        assert resumed[step]["events"] == record["events"], step
        assert resumed[step]["miou"] == pytest.approx(record["miou"], abs=0.01), step
        assert resumed[step]["loss"] == pytest.approx(record["loss"], rel=1e-3), step
    for step in range(5, stopped + 1, 5):  # validated before the stop: recorded once, exactly as in the reference
        assert resumed[step]["confusion"] == reference[step]["confusion"], step
    best = json.loads((ref / "model" / "model_best.json").read_text())
    assert json.loads((run_dir / "model" / "model_best.json").read_text())["step"] == best["step"]
