"""Stop, resume and launch the way a cluster runs them: loader workers on, signals to every process
of the job, a SIGKILLed launcher, a second launch of a running run, resume with changes."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    assert_bitwise_equal,
    attempts,
    kill_run,
    launch,
    losses,
    metrics_lines,
    pimm_in_process,
    processes_of,
    run_pimm,
    signal_all,
    start_launch,
    steps,
    wait_for_run,
    wait_until,
    weights,
)

from pimm.checkpoint.layout import newest_resumable


def _continue_command(stderr: str) -> list[str]:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("pimm: continue with: "))
    argv = shlex.split(line.removeprefix("pimm: continue with: "))
    assert argv[0] == "pimm"
    return [sys.executable, "-m", "pimm", *argv[1:]]


def _ranks(run_dir: Path) -> list[int]:
    """pids of the rank processes (not their loader workers), from the rank logs."""
    pids = []
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        for line in log.read_text().splitlines():
            if " pid " in line:
                pids.append(int(line.split(" pid ")[1].split()[0]))
    return pids


def test_sigusr1_to_every_process_with_loader_workers_then_the_printed_command_resumes_bit_exact(
    tmp_path, tiny_data, reference
):
    """What Slurm's `--signal` / `scancel --signal=USR1` does: every process of the step gets it,
    loader workers included (2 per rank here)."""
    proc = start_launch(tmp_path, tiny_data, 2, "num_worker=4", "log_event_ids=true", name="job")
    run_dir = tmp_path / "tests" / "job"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 3)
        # launcher, torchrun, 2 ranks and their 2 loader workers each
        assert wait_until(lambda: len(processes_of(proc)) >= 8, timeout=30), processes_of(proc)
        signal_all(processes_of(proc), signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
        # checked before the cleanup below kills what is left: the run left nothing behind
        assert wait_until(lambda: processes_of(proc) == [], timeout=10), processes_of(proc)
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    assert "Traceback" not in err and "killed by signal" not in err
    manifest = json.loads((run_dir / "model/last/.complete").read_text())
    last = attempts(run_dir)[-1]
    assert last["outcome"] == "interrupted by SIGUSR1" and last["checkpoint_step"] == manifest["step"]
    assert manifest["step"] < 24

    # the printed command, pasted as it is, continues the same run (2 ranks, its own config)
    res = subprocess.run(_continue_command(err), check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr
    assert attempts(run_dir)[-1]["world_size"] == 2 and attempts(run_dir)[-1]["cursor"] == "restored"
    assert steps(run_dir) == steps(reference)
    assert losses(run_dir) == losses(reference)
    assert_bitwise_equal(weights(run_dir), weights(reference))


@pytest.mark.parametrize("target", ["torchrun", "ranks"])
def test_stop_signal_to_torchrun_only_or_to_the_ranks_only(tmp_path, tiny_data, target):
    """Ranks only, under --resources.max-restarts 1: the rank's exit 75 must not be taken for a
    failure and restarted."""
    proc = start_launch(tmp_path, tiny_data, 2, "num_worker=2", "epochs=400", name=target,
                        extra=["--resources.max-restarts", "1"])
    run_dir = tmp_path / "tests" / target
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 3)
        # launcher, torchrun, 2 ranks and their loader worker each (processes_of learns their sessions)
        assert wait_until(lambda: len(processes_of(proc)) >= 6, timeout=30), processes_of(proc)
        if target == "torchrun":
            torchrun = [p for p in processes_of(proc)
                        if b"pimm.launch.torchrun" in Path(f"/proc/{p}/cmdline").read_bytes()]
            signal_all(torchrun, signal.SIGTERM)
        else:
            signal_all(_ranks(run_dir), signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert wait_until(lambda: processes_of(proc) == [], timeout=10), processes_of(proc)  # before the cleanup
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    runs = attempts(run_dir)
    assert len(runs) == 1 and runs[0]["outcome"] == "interrupted by SIGTERM"
    assert json.loads((run_dir / "model/last/.complete").read_text())["step"] == runs[0]["checkpoint_step"]


def _snapshot(run_dir: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}


def test_one_writer_sigkilled_launcher_leaves_no_process_and_the_run_resumes(tmp_path, tiny_data):
    proc = start_launch(tmp_path, tiny_data, 2, "num_worker=2", "epochs=400", name="long")
    run_dir = tmp_path / "tests" / "long"
    try:
        wait_for_run(proc, (run_dir / "model/last/.complete").exists)
        # a second launch of the running run is refused at once, naming the holder
        res = run_pimm(["launch", "--train.resume", str(run_dir)], cwd=REPO, timeout=60)
        assert res.returncode == 2, res.stderr
        assert f"in use by pid {proc.pid}" in res.stderr and "Traceback" not in res.stderr
        assert len(attempts(run_dir)) == 1
        res = run_pimm(["launch", "--train.config", "tests/tiny_semseg", "--run.name", "long", "--run.no-timestamp",
                        "--paths.exp-root", str(tmp_path), "--", f"data.train.path={tiny_data['train']}",
                        f"data.val.path={tiny_data['val']}"], cwd=REPO, timeout=60)
        assert res.returncode == 2 and "already exists" in res.stderr

        assert wait_until(lambda: len(processes_of(proc)) >= 6, timeout=30), processes_of(proc)  # sessions known
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun; the ranks are in sessions of their own
        killed_at = time.time()
        assert wait_until(lambda: processes_of(proc) == [], timeout=10), processes_of(proc)
        died_within = time.time() - killed_at
        before = _snapshot(run_dir)
        time.sleep(1.0)
        assert _snapshot(run_dir) == before  # nothing is written after
    finally:
        kill_run(proc)
    assert died_within < 10
    assert attempts(run_dir)[-1]["outcome"] == "running"  # killed: it never recorded an end

    # the kernel released the lock with its holders: the resume runs, from the newest complete checkpoint (a write
    # the kill caught between its .complete and its rename to last is finished first, so it may be newer than last)
    step = newest_resumable(run_dir / "model").step
    res = run_pimm(["launch", "--train.resume", str(run_dir), "--", f"max_steps={step + 2}"], cwd=REPO)
    assert res.returncode == 0, res.stderr
    runs = attempts(run_dir)
    assert runs[0]["outcome"].startswith("lost")
    assert runs[-1]["outcome"] == "completed" and runs[-1]["start_step"] == step
    assert runs[-1]["world_size"] == 2  # as launched
    assert runs[-1]["launch"]["overrides"] == [f"max_steps={step + 2}"]


def test_resume_refuses_changes_that_cannot_continue_the_run(tmp_path, tiny_data):
    res, run_dir = launch(tmp_path, tiny_data, 1, "debug.interrupt_at_step=2",
                          "scheduler={type: OneCycleLR, max_lr: 0.003}")
    assert res.returncode == 75, res.stderr
    config_before = (run_dir / "config.py").read_text()
    for override, expected in [
        ("model.channels=32", "model.channels: 16 in the run, 32 now"),
        ("optimizer.lr=0.001", "optimizer.lr: 0.003 in the run, 0.001 now"),
        ("epochs=4", "epochs: 2 in the run, 4 now: this changes the length of the run's OneCycleLR schedule"),
    ]:
        res = pimm_in_process(["launch", "--train.resume", str(run_dir), "--", override])
        assert res.returncode == 2, res.stderr
        message = [ln for ln in res.stderr.splitlines() if ln.startswith("pimm: error:")]
        assert len(message) == 1 and expected in message[0], res.stderr
        assert "Traceback" not in res.stderr
    assert len(attempts(run_dir)) == 1 and (run_dir / "config.py").read_text() == config_before


def test_resume_with_more_epochs_under_a_constant_schedule_continues(tmp_path, tiny_data):
    res, run_dir = launch(tmp_path, tiny_data, 1, "epochs=1", "debug.interrupt_at_step=5")
    assert res.returncode == 75, res.stderr
    res = run_pimm(["launch", "--train.resume", str(run_dir), "--", "epochs=2"], cwd=REPO)
    assert res.returncode == 0, res.stderr
    last = attempts(run_dir)[-1]
    assert last["outcome"] == "completed" and last["final_step"] == 24 and last["start_step"] == 5
    assert last["launch"]["resume_changes"] == {"epochs": [1, 2]}
    assert list(run_dir.glob("config.before-*.py"))  # the run's earlier config is kept beside it


def test_warm_start_survives_a_torchrun_restart_before_the_first_checkpoint(tmp_path, tiny_data, reference):
    best = reference / "model/model_best.pth"
    # epochs=1: the only checkpoint is the run's last step (12); the kill lands at step 2, before it
    proc = start_launch(tmp_path, tiny_data, 2, "epochs=1", name="warm",
                        extra=["--train.weight", str(best), "--resources.max-restarts", "1"])
    run_dir = tmp_path / "tests" / "warm"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 2)
        assert not (run_dir / "model/last").exists()
        os.kill(_ranks(run_dir)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        kill_run(proc)
    assert proc.returncode == 0, err
    runs = attempts(run_dir)
    assert len(runs) == 2 and runs[1]["torchrun_restart"] == 1
    assert runs[0]["resumed_from"] == runs[1]["resumed_from"] == str(best)


def test_voxel_pooling_under_bf16_autocast_computes_in_float32():
    """>1000 points in one voxel: bf16 counts saturate at 256 and bf16 sums round; pooling must not."""
    from pimm.models.point_seg_net import Block, voxel_clusters, voxel_mean

    torch.manual_seed(0)
    n = 3000
    coord = torch.cat([torch.rand(n - 10, 3) * 0.5, torch.rand(10, 3) * 50 + 10])  # one dense voxel
    cluster, counts = voxel_clusters(coord, torch.zeros(n, dtype=torch.long), 4.0)
    assert int(counts.max()) == n - 10
    features = (torch.randn(n, 8) + 3.0).bfloat16()
    exact = voxel_mean(features.double(), cluster, counts)
    assert ((voxel_mean(features, cluster, counts).double() - exact).abs() / exact.abs()).max() < 1e-2

    block = Block(32)  # and the whole block under autocast stays close to float32
    x = torch.randn(n, 32)
    reference = block(x, cluster, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = block(x, cluster, counts)
    error = (mixed.float() - reference).abs().max() / reference.abs().max()
    assert error < 0.03, float(error)


@pytest.mark.parametrize("local_rank,visible,expected", [(0, 4, 0), (3, 4, 3), (1, 1, 0), (3, 1, 0)])
def test_cuda_device_follows_the_visible_devices_the_scheduler_set(local_rank, visible, expected):
    from pimm.distributed.env import cuda_device_index

    assert cuda_device_index(local_rank, visible) == expected
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU: 2 visible"):
        cuda_device_index(2, 2)


def test_stop_signal_during_validation_checkpoints_the_epoch_end_step(tmp_path, tiny_data):
    """A long validation after step 12 (the end of epoch 1); the signal lands while it runs and
    the run stops at step 12, agreed at the epoch's end, instead of two steps into epoch 2."""
    from pimm.data.synth import write_dataset

    big_val = write_dataset(tmp_path / "val.h5", 400, seed=5)
    data = {"train": tiny_data["train"], "val": big_val}
    proc = start_launch(tmp_path, data, 2, "num_worker=2", "epochs=400", "batch_size_val=2", name="val")
    run_dir = tmp_path / "tests" / "val"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 12)  # step 12's train line: validation begins
        signal_all(processes_of(proc), signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "val" and r["step"] == 12 for r in records)  # the validation finished
    assert max(r["step"] for r in records) == 12
    assert json.loads((run_dir / "model/last/.complete").read_text())["step"] == 12
