"""FSDP2 (`parallel.strategy="fsdp2"`, torch's fully_shard) on CPU with gloo, through real launches:
parity with DDP, checkpoints that move between DDP, FSDP2 and other world sizes, lockstep
evaluation on uneven shards, and the errors found before any process starts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, attempts, copy_exp, launch, losses, pimm_in_process, steps, weights

FSDP2 = "parallel.strategy=fsdp2"
# FSDP2 reduce-scatters gradients where DDP all-reduces them, and divides by the world size at a
# different point: the same float32 sums in another order. At 2 ranks each element is a + b either
# way, so what differs is the rounding of the division (about 1 ulp, 6e-8 relative) compounding
# through AdamW over the steps; 1e-5 relative leaves two orders of magnitude of margin while any
# real error (a missing gradient reduction, optimizer state lost on resume) is far larger.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


def assert_close_runs(run_dir, ref_dir, from_step: int = 1) -> None:
    ours, theirs = losses(run_dir), losses(ref_dir)
    assert sorted(ours) == sorted(theirs)
    worst = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours if s >= from_step)
    assert worst <= LOSS_RTOL, f"largest relative loss difference {worst:.2e}"
    theirs_w = weights(ref_dir)
    for key, value in weights(run_dir).items():
        torch.testing.assert_close(value, theirs_w[key], rtol=0, atol=WEIGHT_ATOL)


def test_fsdp2_matches_ddp_step_for_step(tmp_path, tiny_data, reference):
    res, run_dir = launch(tmp_path, tiny_data, 2, FSDP2, name="fsdp2")
    assert res.returncode == 0, res.stderr
    assert len(losses(run_dir)) == 24  # 2 epochs x 12 steps
    assert steps(run_dir) == steps(reference)
    assert_close_runs(run_dir, reference)
    (attempt,) = attempts(run_dir)
    assert attempt["strategy"] == "fsdp2"
    assert attempt["host_allocator"].startswith("glibc, mmap threshold 1048576 bytes (set by pimm for FSDP2")
    log = (run_dir / "logs/rank0.log").read_text()
    assert "fsdp2: 4 Block module(s) sharded, then the root, over 2 ranks" in log or "fsdp2:" in log
    # weights.pth is the full, unsharded state dict that the bare model loads
    from pimm.config import load_config
    from pimm.models import build_model

    model = build_model(load_config(run_dir / "config.py")["model"])
    model.load_state_dict(torch.load(run_dir / "model/last/weights.pth", weights_only=True))


def test_a_ddp_checkpoint_resumes_under_fsdp2(tmp_path, tiny_data, reference, interrupted_at_7):
    # conftest's shared 2-rank DDP run stopped at step 7 (it also logs to TensorBoard); this test resumes a copy
    exp = copy_exp(interrupted_at_7, tmp_path)
    assert attempts(exp / "tests" / interrupted_at_7.name)[-1]["strategy"] == "ddp"
    res, run_dir = launch(exp, tiny_data, 2, FSDP2, name=interrupted_at_7.name, resume=True)
    assert res.returncode == 0, res.stderr
    assert "parallel.strategy: 'ddp' -> 'fsdp2'" in res.stdout
    resumed = attempts(run_dir)[-1]
    assert resumed["start_step"] == 7 and resumed["cursor"] == "restored" and resumed["strategy"] == "fsdp2"
    assert steps(run_dir) == steps(reference)
    # optimizer moments came back too: without them the losses after step 7 would differ by far more
    assert_close_runs(run_dir, reference)


def test_an_fsdp2_checkpoint_resumes_at_three_ranks_and_under_ddp(tmp_path, tiny_data):
    # batch 12 splits over 1, 2 and 3 ranks; 11 validation events leave the ranks uneven shards,
    # which FSDP2's collective forward must survive (padded with masked batches, counted once)
    common = ("batch_size=12", "batch_size_val=6", "data.val.max_len=11", "epochs=3")
    res, ref_dir = launch(tmp_path, tiny_data, 1, *common, name="single")
    assert res.returncode == 0, res.stderr
    res, run_dir = launch(tmp_path, tiny_data, 2, FSDP2, *common, "debug.interrupt_at_step=3", name="moves")
    assert res.returncode == 75, res.stderr
    res, run_dir = launch(tmp_path, tiny_data, 3, FSDP2, *common, "max_steps=8", name="moves", resume=True)
    assert res.returncode == 0, res.stderr
    res, run_dir = launch(tmp_path, tiny_data, 2, "parallel.strategy=ddp", *common, "max_steps=None",
                          name="moves", resume=True)
    assert res.returncode == 0, res.stderr
    cuts = [(a["start_step"], a["cursor"], a["world_size"], a["strategy"]) for a in attempts(run_dir)]
    assert cuts == [(0, "fresh", 2, "fsdp2"), (3, "remapped", 3, "fsdp2"), (8, "remapped", 2, "ddp")]
    assert steps(run_dir) == steps(ref_dir)  # nothing replayed or skipped across the moves
    # 1 vs N ranks: the same sums in another order (tests/test_training.py uses 1e-4 for 1 vs 2)
    ours, theirs = losses(run_dir), losses(ref_dir)
    assert max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours) <= 1e-4
    vals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [v for v in vals if v["kind"] == "val"]
    assert vals and all(v["events"] == 11 for v in vals)  # every validation event exactly once at 2 and 3 ranks
    ref_vals = [json.loads(line) for line in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    ref_vals = {v["step"]: v for v in ref_vals if v["kind"] == "val"}
    for v in vals:
        assert abs(v["miou"] - ref_vals[v["step"]]["miou"]) < 1e-3


@pytest.mark.parametrize("override,expected", [
    ("parallel.wrap_classes=[Blok]", "parallel.wrap_classes names ['Blok'], which PointSegNet does not contain; "
                                     "its module classes are: Block,"),
    ("parallel.strategy=tp", "not implemented in pimm"),
    ("parallel.strategy=pipeline", "not implemented in pimm"),
    ("parallel.strategy=fsdp", "'fsdp2' is torch.distributed.fsdp.fully_shard"),
])
def test_strategy_errors_stop_before_any_process(tmp_path, tiny_data, override, expected):
    extra = [FSDP2] if "wrap_classes" in override else []
    res = pimm_in_process(["launch", "--train.config", TINY, "--resources.nproc-per-node", "2", "--paths.exp-root",
                           str(tmp_path), "--", f"data.train.path={tiny_data['train']}",
                           f"data.val.path={tiny_data['val']}", *extra, override])
    assert res.returncode == 2, res.stderr
    assert expected in res.stderr and "Traceback" not in res.stderr
    assert not any(tmp_path.iterdir())
