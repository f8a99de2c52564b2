"""Real multi-process training through `pimm launch` (torchrun, gloo, CPU)."""

import json
from pathlib import Path

import torch
from conftest import LR0_OVERRIDES, REPO, run_pimm

from pimm.models import build_model

TINY = "tests/tiny_semseg"


def launch(tmp_path, tiny_data, nproc, *overrides, name="run"):
    res = run_pimm(
        ["launch", "--train.config", TINY, "--resources.nproc-per-node", str(nproc), "--run.name", name,
         "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), "--",
         f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", *overrides],
        cwd=REPO,
    )
    return res, tmp_path / "exp" / "tests" / name


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_two_rank_run_learns_and_leaves_a_complete_run_directory(tmp_path, tiny_data):
    # 8 fixed events, no augmentation: the loss must fall clearly within 20 steps
    res, run_dir = launch(tmp_path, tiny_data, 2, "data.train.max_len=8", "data.train.augment=false", "epochs=10",
                          "sync_bn=true")
    assert res.returncode == 0, res.stderr
    losses = [r["loss"] for r in records(run_dir, "train")]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    for rel in ("config.py", "launch.json", "logs/rank0.log", "logs/rank1.log", "metrics.jsonl", "plot.png",
                "model/last/weights.pth", "model/last/.complete", "model/model_best.pth", "summary.json"):
        assert (run_dir / rel).exists(), rel
    assert "training finished" in res.stdout and str(run_dir) in res.stdout
    val = records(run_dir, "val")
    assert len(val) == 10 and all(v["events"] == 12 for v in val)
    # the weights load into the bare model without any process group
    model = build_model(dict(type="PointSegNet", in_channels=4, num_classes=5, channels=16, grid_sizes=[4, 16]))
    model.load_state_dict(torch.load(run_dir / "model/last/weights.pth", weights_only=True))
    rank0_log = (run_dir / "logs/rank0.log").read_text()
    assert "world size 2" in rank0_log and "strategy ddp" in rank0_log
    assert "sync_bn=True ignored: SyncBatchNorm needs CUDA" in rank0_log


def test_one_and_two_ranks_give_the_same_loss_curve(reference_1rank, reference):
    """Same global batch and seed: per-step losses agree to 1e-4 relative (float summation order only).
    conftest's shared uninterrupted runs of the tiny config (2 epochs, batch 4) at 1 and at 2 ranks."""
    run1, run2 = reference_1rank, reference
    assert [json.loads((run / "launch.json").read_text())["world_size"] for run in (run1, run2)] == [1, 2]
    loss1 = [r["loss"] for r in records(run1, "train")]
    loss2 = [r["loss"] for r in records(run2, "train")]
    assert len(loss1) == len(loss2) == 24
    for step, (a, b) in enumerate(zip(loss1, loss2), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: 1 rank {a} vs 2 ranks {b}"
    w1 = torch.load(run1 / "model/last/weights.pth", weights_only=True)
    w2 = torch.load(run2 / "model/last/weights.pth", weights_only=True)
    for key in w1:
        assert torch.allclose(w1[key], w2[key], atol=1e-5), key


def test_same_weights_give_the_same_validation_metrics_on_one_and_two_ranks(lr0_runs):
    # lr=0 keeps the seeded initial weights: both runs evaluate identical models (conftest's shared pair;
    # its training-set transforms do not touch the validation set)
    assert "optimizer.lr=0" in LR0_OVERRIDES and "batch_size_val=2" in LR0_OVERRIDES
    v1, v2 = records(lr0_runs[1], "val")[-1], records(lr0_runs[2], "val")[-1]
    assert v1["events"] == v2["events"] == 12 and v1["points"] == v2["points"]
    assert v1["miou"] == v2["miou"] and v1["iou"] == v2["iou"]
    assert abs(v1["loss"] - v2["loss"]) <= 1e-6 * v1["loss"]


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_weights(tmp_path, tiny_data):
    # 48 events / batch 4 = 12 steps per epoch: the epoch-1 checkpoint exists when step 14 fails
    res, run_dir = launch(tmp_path, tiny_data, 2, "debug.nonfinite_loss_at_step=14")
    assert res.returncode != 0
    assert "non-finite loss at step 14" in res.stderr
    assert "rank 0 failed" in res.stderr and "rank 1 failed" in res.stderr
    assert json.loads((run_dir / "model/last/.complete").read_text())["step"] == 12
    weights = torch.load(run_dir / "model/last/weights.pth", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())
