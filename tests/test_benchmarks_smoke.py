"""The throughput benchmark runs end to end (tiny settings, world size 1). No speed is asserted:
timings on a shared machine are noise at this size; this only proves `make bench` works."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from pimm.panoptic_metrics import PanopticAccumulator

FIELDS = ("pimm_events_per_s", "hand_events_per_s", "ratio", "ratio_per_point", "pimm_events_per_s_windows",
          "loader_events_per_s_per_rank", "consumption_events_per_s_per_rank", "loader_headroom")


TINY_RUNS = ["--set", "model.channels=8", "--steps", "6", "--warmup", "2", "--log-every", "2", "--repeats", "1",
             "--world-sizes", "1", "--loader-batches", "8"]


def run_throughput(*args: str) -> str:
    """benchmarks/throughput.py ARGS with the tiny config; its stdout once it exited 0."""
    argv = [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--config", "tests/tiny_semseg", *args]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the benchmark kills the run it has in progress on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise AssertionError(f"benchmark timed out\n{stdout}\n{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    for column in ("world size", "pimm events/s", "hand-written events/s", "ratio pimm/hand",
                   "loader events/s per rank", "consumption events/s per rank", "loader headroom"):
        assert column in stdout, column
    return stdout


def panoptic_benchmark():
    """benchmarks/panoptic.py as a module, for the tests that call its functions in this process."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    # deferred: the script imports scikit-learn, which the other tests of this file do not need
    import panoptic

    return panoptic


def assert_one_row(result: dict) -> dict:
    (row,) = result["results"]
    assert row["world_size"] == 1 and row["per_rank_batch"] == row["global_batch"] == 4
    for field in FIELDS:
        assert isinstance(row[field], float) and math.isfinite(row[field]) and row[field] > 0, (field, row[field])
    assert len(row["runs"]["pimm"]) == len(row["runs"]["hand"]) == 1
    assert row["runs"]["hand"][0]["steps"] == 6 and row["runs"]["hand"][0]["warmup"] == 2
    return row


def test_throughput_benchmark_runs_and_reports_every_field(tmp_path, tiny_data):
    out = tmp_path / "bench.json"
    run_throughput("--data", str(tiny_data["train"]), *TINY_RUNS, "--out", str(out))
    result = json.loads(out.read_text())
    assert result["settings"]["steps"] == 6 and result["settings"]["overrides"] == ["model.channels=8"]
    assert result["settings"]["layout"] == "pimm" and result["settings"]["points_per_event"] is None
    assert_one_row(result)


def test_throughput_benchmark_on_the_pilarnet_layout_prints_its_ratios(tmp_path):
    """`--layout pilarnet`: generates PILArNet-M layout shards (here 32 events of about 300 points) where
    --data is missing, trains both sides through PILArNetDataset and prints its ratios."""
    data, out = tmp_path / "pilarnet", tmp_path / "bench.json"
    stdout = run_throughput("--layout", "pilarnet", "--data", str(data), "--synth-events", "32",
                            "--points-per-event", "300", *TINY_RUNS, "--out", str(out))
    assert f"generating {data} (32 events, seed 1)" in stdout
    assert len(list((data / "train").glob("train_*.h5"))) == 4  # the benchmark's shards
    result = json.loads(out.read_text())
    assert result["settings"]["layout"] == "pilarnet" and result["settings"]["points_per_event"] == 300
    assert result["settings"]["target_ratio"] == 0.97
    row = assert_one_row(result)
    assert f"world 1: ratio {row['ratio']:.3f} (target >= 0.97: " in stdout
    assert all(row["mean_points_per_event"][side] > 0 for side in ("pimm", "hand"))


def test_evaluate_benchmark_prints_its_table(tmp_path):
    """benchmarks/evaluate.py end to end at 1 and 2 ranks on a few events (no speed asserted)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "evaluate.py"), "--config", "tests/tiny_semseg", "--events",
            "16", "--batch", "2", "--repeats", "1", "--ranks", "1,2"]
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    header, *rows = res.stdout.strip().splitlines()[-3:]
    assert "pimm/hand" in header and "predictions added" in header
    assert [row.split()[0] for row in rows] == ["1", "2"] and all(row.split()[1] == "16" for row in rows)


def test_label_efficiency_benchmark_pretrains_exports_and_fine_tunes_every_row(tmp_path):
    """benchmarks/label_efficiency.py at toy size (a few pretraining steps, 4 fine-tuning steps, 10 held-out events):
    the table's three rows, the JSON's runs, the lin and fft runs loading the exported encoder (the lin run's frozen
    encoder ends as exported), the plot (no score asserted)."""
    import torch

    out, work = tmp_path / "le.json", tmp_path / "work"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "label_efficiency.py"), "--pretrain-seconds", "1",
                          "--labelled", "10,20", "--finetune-steps", "4", "--val-events", "10", "--points-per-event",
                          "200", "--work", str(work), "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    table = [line for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert table[0] == "| fine-tuning | val mIoU, 10 labelled | val mIoU, 20 labelled |"
    assert [line.split("|")[1].strip() for line in table[1:]] == ["scratch", "lin", "fft"]
    result = json.loads(out.read_text())
    assert 4 <= result["pretraining"]["steps"] <= result["pretraining"]["events_generated"] // 8
    runs = {(r["mode"], r["labelled"]): r for r in result["runs"]}
    assert set(runs) == {(m, n) for m in ("scratch", "lin", "fft") for n in (10, 20)}
    assert all(0.0 <= r["miou"] <= 1.0 and r["steps"] == 4 for r in runs.values())
    assert runs["scratch", 10]["pretrained_loaded"] == 0 and runs["lin", 10]["pretrained_loaded"] > 0
    assert runs["lin", 20]["pretrained_loaded"] == runs["fft", 20]["pretrained_loaded"]
    exported = torch.load(work / "pretrained" / "model.pth", weights_only=True)["state_dict"]
    lin = torch.load(work / "runs" / "lin_20_seed0" / "model" / "last" / "weights.pth", weights_only=True)
    encoder = [k for k in lin if k.startswith("backbone.")]
    assert encoder and all(torch.equal(lin[k], exported[f"module.student.{k}"]) for k in encoder)
    assert (tmp_path / "le.png").read_bytes()[:4] == b"\x89PNG"


def test_published_parity_benchmark_prints_its_table(tmp_path):
    """benchmarks/published_parity.py --quick: a 2-stage PT-v3m2 on one generated event (no size asserted)."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "published_parity.py"), "--quick"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=180, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [
        "published vs published (other seed)", "pimm vs published", "published: alone vs batched (seed 0)"]


def test_optimizer_step_benchmark_compares_both_implementations_on_a_config(tmp_path):
    """benchmarks/optimizer_step.py on the tiny config: one row, both sides timed, the same update (no speed
    asserted)."""
    out = tmp_path / "optimizer.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "optimizer_step.py"), "--config", "tests/tiny_semseg",
            "--steps", "2", "--repeats", "2", "--out", str(out)]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch default ms" in res.stdout and "tests/tiny_semseg" in res.stdout
    (row,) = json.loads(out.read_text())["results"]
    assert row["implementation"] == {"pimm": {"fused": True, "foreach": None},
                                     "torch default": {"fused": None, "foreach": None}}
    assert row["ms"]["pimm"]["n"] == row["ms"]["torch default"]["n"] == 2 and row["ratio"] > 0
    assert row["max_abs_difference"] < 1e-5


def test_startup_benchmark_measures_both_modes_of_a_start_up():
    """benchmarks/startup.py, torchrun's start-up once in each mode: one row with both CPU times and their ratio
    (no speed asserted)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "startup.py"), "--start-up", "torchrun", "--repeats", "1"]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = [line for line in res.stdout.splitlines() if line.startswith("torchrun ")]
    on, paused, ratio = (cell.strip() for cell in row.split("|")[1:])
    assert float(on.split()[0]) > 0 and float(paused.split()[0]) > 0 and ratio.endswith("x"), res.stdout


def test_rank_start_benchmark_times_a_launch_of_each_start():
    """benchmarks/rank_start.py, one 1-rank launch of each start: a CPU row and a wall row with both
    numbers and their ratio (no speed asserted)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "rank_start.py"), "--nproc", "1", "--repeats", "1"]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith(("CPU s", "wall s"))]
    assert len(rows) == 2, res.stdout
    for row in rows:
        new, forked, ratio = (cell.strip() for cell in row.split("|")[1:])
        assert float(new.split()[0]) > 0 and float(forked.split()[0]) > 0 and ratio.endswith("x"), res.stdout


def test_panoptic_benchmark_trains_both_models_and_prints_one_table(tmp_path):
    """benchmarks/panoptic.py on a few small generated events, 3 training steps per model (--steps: the same
    training on any machine, said in the output): the detector's rows (the published post-processing, the
    config's connected pieces, without and with its collinear ones joined) and both DBSCAN rows, each detector
    row's per-event differences from DBSCAN, the step-time ratio and the matching share (no score asserted)."""
    out = tmp_path / "p.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "panoptic.py"), "--steps", "3", "--events", "8",
                          "--test-events", "3", "--select-events", "3", "--points-per-event", "300", "--eps", "2,6",
                          "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 training steps per model" in res.stdout
    table = [line for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    split = next(i for i, line in enumerate(table) if line.startswith("| difference |"))
    table, difference_table = table[:split], table[split:]
    rows = [line.split("|")[1].strip() for line in table]
    assert rows[:4] == ["method", "detector (detector-v1m1), published post-processing",
                        "detector, + connected pieces (radius 12, >= 20 points)",
                        "detector, + connected pieces, collinear ones joined (cosine above 0.9)"]
    assert rows[4].startswith("DBSCAN eps ") and rows[4].endswith(", predicted semantics")
    assert rows[5].startswith("DBSCAN eps ") and rows[5].endswith(", true semantics")
    result = json.loads(out.read_text())
    assert set(result["eps"].values()) <= {2.0, 6.0}
    assert set(result["dbscan_radius_selection"]["true"]) == {"2.0", "6.0"}
    assert list(result["rows"]) == rows[1:]
    assert all(0.0 <= row["purity"] <= 1.0 or math.isnan(row["purity"]) for row in result["rows"].values())
    # each detector row minus DBSCAN on predicted semantics, per event on the same events: ARI (all labelled) is
    # defined for every event on both sides, so its mean difference is the difference of the rows' means
    differences = result["differences_from_dbscan_predicted"]
    assert list(differences) == rows[1:4]
    assert [line.split("|")[1].strip() for line in difference_table] == ["difference",
                                                                         *(f"{row} minus DBSCAN" for row in rows[1:4])]
    for row in rows[1:4]:
        ari = differences[row]["ari_all_labelled"]
        assert differences[row]["ari_all_labelled_events"] == 3.0
        dbscan = result["rows"][rows[4]]["ari_all_labelled"]
        assert ari == pytest.approx(result["rows"][row]["ari_all_labelled"] - dbscan)
        assert f"| {row} minus DBSCAN | {ari:+.3f} ± {differences[row]['ari_all_labelled_sem']:.3f} |" in res.stdout
    timing, training = result["timing"], result["training"]
    assert timing["pairs"] >= 1 and timing["detector_step_s"] > 0 and timing["semantic_step_s"] > 0
    assert 0.0 < timing["matching_share"] < 1.0
    assert f"ratio {timing['ratio']:.2f}x (goal <= 1.3x" in res.stdout
    assert training["detector"]["steps"] == training["semantic"]["steps"] == 3
    assert all(training[name]["cpu_seconds"] > 0 for name in ("detector", "semantic"))
    assert 0.0 <= result["detector_mask_recall"] <= 1.0
    per_event = result["instances_per_event"]
    assert list(per_event) == ["true particles", *rows[1:]]
    assert per_event["true particles"] > 0 and all(count >= 0 for count in per_event.values())
    assert (f"instances per held-out event: {per_event['true particles']:.1f} true particles; "
            + "; ".join(f"{row} {per_event[row]:.1f}" for row in rows[1:])) in res.stdout
    assert f"{100 * result['detector_mask_recall']:.0f}% of the held-out particles have a query mask at IoU >= 0.5" \
        in res.stdout


class StandInTrainee:
    """What benchmarks/panoptic.py's train loop asks of a model in training, each step costing `cost` CPU seconds."""

    def __init__(self, cost: float) -> None:
        self.cost, self.step_seconds, self.step_cpu_seconds, self.fractions = cost, [], [], []
        self.cfg = {"batch_size": 2}

    @property
    def spent(self) -> float:
        return sum(self.step_cpu_seconds)

    def set_lr(self, fraction: float) -> None:
        self.fractions.append(fraction)

    def step(self, batch, timer) -> None:
        self.step_seconds.append(self.cost)
        self.step_cpu_seconds.append(self.cost)


def test_panoptic_benchmark_cpu_seconds_budget_stops_each_model_once_it_has_spent_them(monkeypatch):
    """--seconds (the default budget): each model steps until its own steps have spent the CPU seconds, the dearer
    one taking fewer steps; the learning rate follows the share of the budget spent. (The benchmark's own run, above,
    uses --steps; the two budgets share everything but Budget.)"""
    panoptic = panoptic_benchmark()
    monkeypatch.setattr(panoptic, "collate_events", lambda events: events)
    detector, semantic = StandInTrainee(1.0), StandInTrainee(0.4)
    panoptic.train(detector, semantic, list(range(6)), panoptic.Budget(seconds=3.0), seed=0)
    assert (len(detector.step_seconds), len(semantic.step_seconds)) == (3, 8)  # 3 x 1.0 s; 8 x 0.4 s >= 3 s
    assert detector.fractions == pytest.approx([0, 1 / 3, 2 / 3])
    assert panoptic.Budget(steps=5).fraction(semantic) == 8 / 5
    assert panoptic.Budget(steps=5).describe() == "5 training steps"


def test_panoptic_benchmark_timing_pairs_only_times_the_steps(tmp_path):
    """--timing-pairs: the warm-up and N alternating pairs, the ratio printed and written; no table, no scores."""
    out = tmp_path / "t.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "panoptic.py"), "--timing-pairs", "1", "--events",
                          "8", "--test-events", "1", "--points-per-event", "300", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| method |" not in res.stdout and "(goal <= 1.3x" in res.stdout
    result = json.loads(out.read_text())
    assert set(result) == {"settings", "voxels_per_event", "timing"} and result["timing"]["pairs"] == 1


def test_panoptic_benchmark_refuses_what_it_cannot_run_with_one_line(capsys):
    """A radius that is no positive number, or --seconds with --steps, is refused by the argument check (exit 2,
    nothing generated); a config that is not there, or a semantic config that is no SemanticSegmentation, ends
    with one line naming it, not a traceback: the script once as a command, the other refusals through its main()."""
    args = ["--steps", "1", "--events", "8"]
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "panoptic.py"), *args, "--detector-config",
                          "bench/nope"], cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 1, res.stdout + res.stderr
    (line,) = res.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("benchmarks/panoptic.py: config 'bench/nope' not found"), line
    main = panoptic_benchmark().main
    for more, code, message in (
            (["--eps", "4,,8"], 2, "--eps '4,,8' is not a comma-separated list of numbers"),
            (["--eps", "-1"], 2, "--eps '-1': every DBSCAN radius must be a positive number of voxels"),
            (["--seconds", "5"], 2, "--seconds 5 and --steps 1 are two budgets: give one of them"),
            (["--semantic-config", "bench/panoptic_detector"], None,
             "--semantic-config has task type Panoptic; it must be SemanticSegmentation")):
        with pytest.raises(SystemExit) as refused:
            main([*args, *more])
        if code is None:  # raised with its message: Python prints the one line and exits with 1
            assert message in str(refused.value.code), (more, refused.value.code)
        else:  # argparse: usage and the message on stderr, exit 2
            assert refused.value.code == code and message in capsys.readouterr().err, more


def test_mask_recall_counts_the_particles_some_query_mask_covers_at_the_iou_threshold():
    """Hand-worked: particle 0 (points 0-3) is covered by query 0 at IoU 3/4; particle 1 (points 4-5) only by query
    1's mask, which also takes points 0-3, IoU 2/6; point 6 is labelled nothing and counts in no mask."""
    mask_recall = panoptic_benchmark().mask_recall
    logits = torch.full((2, 7), -5.0)
    logits[0, :3] = 5.0  # 3 of particle 0's 4 points
    logits[0, 6] = 5.0  # and the unlabelled point: not counted
    logits[1, :6] = 5.0
    truth = np.array([0, 0, 0, 0, 1, 1, -1])
    assert mask_recall(logits, truth, mask_threshold=0.5, iou_threshold=0.5) == (1, 2)
    assert mask_recall(logits, truth, mask_threshold=0.5, iou_threshold=0.3) == (2, 2)
    assert mask_recall(logits, truth, mask_threshold=0.5, iou_threshold=0.8) == (0, 2)


def test_dbscan_makes_one_instance_per_dense_group_of_each_class_and_says_how_many():
    """Hand-made: class 0 has two groups of points 10 voxels apart, class 1 one group touching the first, class 2 is
    stuff; at radius 2 DBSCAN makes three instances (groups of different classes stay apart even where they touch),
    stuff and points with no class in none."""
    bench = panoptic_benchmark()
    coord = np.array([[0, 0, 0], [1, 0, 0], [11, 0, 0], [12, 0, 0], [2, 0, 0], [3, 0, 0], [4, 0, 0], [30, 0, 0]],
                     dtype=np.float32)
    point_class = np.array([0, 0, 0, 0, 1, 1, 2, -1])
    truth = np.array([0, 0, 1, 1, 2, 2, -1, -1])
    event = bench.HeldOutEvent(event_id=3, batch={}, coord=coord, true_instance=truth, true_class=point_class,
                               predicted_class=point_class)
    meter = PanopticAccumulator(3, (2,), 0.5)
    assert bench.score_dbscan(meter, event, point_class, (2,), eps=2.0, min_samples=1) == 3
    found = bench.dbscan_instances(coord, point_class, (2,), eps=2.0, min_samples=1)
    assert (found[:2] == found[0]).all() and (found[2:4] == found[2]).all() and (found[4:6] == found[4]).all()
    assert len({found[0], found[2], found[4]}) == 3 and (found[6:] == -1).all()
    assert meter.result()["ari_all_labelled"] == pytest.approx(1.0)
