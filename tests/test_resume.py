"""Checkpoints and resume through `pimm launch` (torchrun, gloo, CPU): exactness, topology
changes, signals, and faults that must lose nothing."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    TINY,
    assert_bitwise_equal,
    attempts,
    copy_exp,
    launch,
    launch_args,
    losses,
    pimm_in_process,
    steps,
    weights,
)


def test_interrupted_and_resumed_three_times_in_one_epoch_is_bit_exact(tmp_path, tiny_data, reference):
    for stop_at in (3, 6, 9):
        res, run_dir = launch(tmp_path, tiny_data, 2, f"debug.interrupt_at_step={stop_at}", resume=stop_at > 3)
        assert res.returncode == 75, res.stderr
        assert "interrupted by debug.interrupt_at_step" in res.stderr
    res, run_dir = launch(tmp_path, tiny_data, 2, resume=True)
    assert res.returncode == 0, res.stderr
    assert steps(run_dir) == steps(reference)
    assert losses(run_dir) == losses(reference)  # exactly, not approximately
    assert_bitwise_equal(weights(run_dir), weights(reference))
    runs = attempts(run_dir)
    assert [a["cursor"] for a in runs] == ["fresh", "restored", "restored", "restored"]
    assert [a["start_step"] for a in runs] == [0, 3, 6, 9]
    assert runs[-1]["outcome"] == "completed" and runs[0]["outcome"].startswith("interrupted")


@pytest.fixture(scope="module")
def one_rank_epoch(tmp_path_factory, tiny_data, reference_1rank):
    """batch -> an uninterrupted 1-rank run whose first epoch is the topology tests' reference: for the
    tiny config's batch 4 (and batch_size_val 4) conftest's shared 1-rank run, otherwise one epoch made
    once per batch size and shared by the parameters that use it."""
    runs = {4: reference_1rank}

    def get(batch: int):
        if batch not in runs:
            common = (f"batch_size={batch}", f"batch_size_val={batch}", "epochs=1")
            res, runs[batch] = launch(tmp_path_factory.mktemp("ref"), tiny_data, 1, *common, name="ref")
            assert res.returncode == 0, res.stderr
        return runs[batch]

    return get


@pytest.fixture(scope="module")
def interrupted_at_5(tmp_path_factory, tiny_data):
    """A 2-rank run stopped at step 5 (status 75); each test resumes its own copy."""
    res, run_dir = launch(tmp_path_factory.mktemp("at5"), tiny_data, 2, "debug.interrupt_at_step=5")
    assert res.returncode == 75, res.stderr
    return run_dir


@pytest.fixture(scope="module")
def interrupted_at_8(tmp_path_factory, tiny_data):
    """A 2-rank run checkpointing every 4 steps, stopped at step 8 (status 75); each test damages its own copy."""
    res, run_dir = launch(tmp_path_factory.mktemp("at8"), tiny_data, 2, "checkpoint_every_n_steps=4",
                          "debug.interrupt_at_step=8")
    assert res.returncode == 75, res.stderr
    return run_dir


def _one_epoch(batch: int) -> tuple[str, ...]:
    return (f"batch_size={batch}", f"batch_size_val={batch}", "epochs=1")


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory, tiny_data):
    """(ranks, batch) -> a one-epoch run of that many ranks and global batch, loader workers off, stopped at
    step 3 (status 75): made once per key and shared by the parameters that start from it; each test resumes
    its own copy."""
    runs = {}

    def get(ranks: int, batch: int):
        if (ranks, batch) not in runs:
            res, runs[ranks, batch] = launch(tmp_path_factory.mktemp(f"at3-{ranks}x{batch}"), tiny_data, ranks,
                                             *_one_epoch(batch), "num_worker=0", "debug.interrupt_at_step=3")
            assert res.returncode == 75, res.stderr
        return runs[ranks, batch]

    return get


@pytest.mark.parametrize(
    "before,after,batch,workers_after",
    [(1, 2, 4, 0), (2, 1, 4, 0), (2, 3, 6, 0), (2, 2, 4, 2)],
    ids=["1to2", "2to1", "2to3", "workers0to1"],
)
def test_topology_change_continues_mid_epoch_without_replay_or_skip(tmp_path, tiny_data, one_rank_epoch, stopped_at_3,
                                                                  before, after, batch, workers_after):
    ref = one_rank_epoch(batch)
    exp = copy_exp(stopped_at_3(before, batch), tmp_path)
    res, run_dir = launch(exp, tiny_data, after, *_one_epoch(batch), f"num_worker={workers_after}", resume=True)
    assert res.returncode == 0, res.stderr
    first_epoch = {step: ids for step, ids in steps(ref).items() if step <= 48 // batch}
    assert steps(run_dir) == first_epoch  # every global step consumed the same events
    seen = [i for ids in steps(run_dir).values() for i in ids]
    assert len(seen) == len(set(seen)) == 48 // batch * batch
    resumed = attempts(run_dir)[-1]
    assert resumed["cursor"] == "remapped" and resumed["world_size"] == after
    assert resumed["workers_per_rank"] == workers_after // after  # num_worker is the global count
    for step, loss in losses(run_dir).items():  # float summation order differs across topologies
        assert abs(loss - losses(ref)[step]) <= 1e-4 * loss


@pytest.mark.parametrize("change", ["batch_size=8", "resume_strict_state=false", "data.train.max_len=40"])
def test_unmappable_cursor_restarts_the_epoch_with_a_replay_warning(tmp_path, tiny_data, interrupted_at_5, change):
    exp = copy_exp(interrupted_at_5, tmp_path)
    res, run_dir = launch(exp, tiny_data, 2, change, resume=True)
    assert res.returncode == 0, res.stderr
    assert "may be seen twice" in res.stderr
    resumed = attempts(run_dir)[-1]
    assert resumed["cursor"] == "epoch_restarted" and "seen twice" in resumed["replay_warning"]
    # the saved epoch began again: step 6 took the first global batch of that epoch's order
    if change == "resume_strict_state=false":  # same order, same batch: step 6 repeats step 1
        assert steps(run_dir)[6] == steps(run_dir)[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_checkpoints_and_exits_with_75_then_resume_finishes(tmp_path, tiny_data, sig):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run_dir = tmp_path / "tests" / "sig"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pimm", "launch", "--train.config", TINY, "--resources.nproc-per-node", "2",
         "--run.name", "sig", "--run.no-timestamp", "--paths.exp-root", str(tmp_path), "--",
         f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", "epochs=400"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(_lines(run_dir / "metrics.jsonl")) < 5:
            time.sleep(0.1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == 75, err
    manifest = json.loads((run_dir / "model/last/.complete").read_text())
    last = attempts(run_dir)[-1]
    assert last["outcome"] == f"interrupted by {sig.name}" and last["checkpoint_step"] == manifest["step"] >= 5
    res, run_dir = launch(tmp_path, tiny_data, 2, f"max_steps={manifest['step'] + 3}", name="sig", resume=True)
    assert res.returncode == 0, res.stderr
    assert attempts(run_dir)[-1]["start_step"] == manifest["step"]


def test_second_signal_exits_at_once():
    code = (
        "import os, signal, time\n"
        "from pimm.signals import StopRequest\n"
        "s = StopRequest(); s.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1); assert s.signal_name == 'SIGTERM'\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)  # within the grace window: same request\n"
        "time.sleep(2.2); os.kill(os.getpid(), signal.SIGUSR1); time.sleep(5)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 76, res.stderr


def test_a_rank_that_learned_of_the_stop_from_another_rank_takes_its_own_late_signal_as_the_same_request(
        tmp_path):
    """On several nodes the signal reaches each node at its own moment: a rank can agree to stop (a signal on
    another rank) before its own signal comes, seconds into its checkpoint. That signal is its first, not a
    second one: exiting at once (76) would kill the rank mid-checkpoint and lose the checkpoint of every rank."""
    code = (
        "import os, signal, sys, time\n"
        "import torch.distributed as dist, torch.multiprocessing as mp\n"
        "from pimm.signals import GRACE_S, StopRequest\n"
        "def rank(r, path):\n"
        "    dist.init_process_group('gloo', store=dist.FileStore(path, 2), rank=r, world_size=2)\n"
        "    s = StopRequest(); s.install()\n"
        "    if r == 1:\n"
        "        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
        "    assert s.agreed_now()\n"
        "    if r == 0:\n"
        "        assert s.signal_name == 'a signal on another rank', s.signal_name\n"
        "        time.sleep(GRACE_S + 0.3)\n"
        "        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2)  # its own signal, late\n"
        "        print('rank 0 alive', flush=True)\n"
        "    dist.barrier(); dist.destroy_process_group()\n"
        "mp.start_processes(rank, args=(sys.argv[1],), nprocs=2, start_method='fork')\n"
    )
    store = tmp_path / "store"
    res = subprocess.run([sys.executable, "-c", code, str(store)], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and "rank 0 alive" in res.stdout, res.stderr


def test_sigkill_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, tiny_data, reference):
    res, run_dir = launch(tmp_path, tiny_data, 2, "checkpoint_every_n_steps=4", "save_iter_snapshots=true",
                          "debug.kill_during_checkpoint_at_step=8")
    assert res.returncode != 0
    assert "killed by signal 9" in res.stderr
    assert (run_dir / "model/iter_4.pth").exists()  # optional weight snapshots
    assert (run_dir / "model/.tmp-step_00000008/weights.pth").exists()  # the write really was cut
    assert json.loads((run_dir / "model/last/.complete").read_text())["step"] == 4
    res, run_dir = launch(tmp_path, tiny_data, 2, "checkpoint_every_n_steps=4", resume=True)
    assert res.returncode == 0, res.stderr
    assert attempts(run_dir)[-1]["start_step"] == 4
    assert not list((run_dir / "model").glob(".tmp-*"))
    assert_bitwise_equal(weights(run_dir), weights(reference))


@pytest.mark.parametrize("victim", ["weights.pth", "trainer.dcp"])
def test_corrupt_checkpoint_names_the_file_and_falls_back_to_an_older_one(tmp_path, tiny_data, reference,
                                                                          interrupted_at_8, victim):
    exp = copy_exp(interrupted_at_8, tmp_path)
    run_dir = exp / "tests" / interrupted_at_8.name
    target = run_dir / "model/last" / victim
    if target.is_dir():
        target = sorted(p for p in target.iterdir() if p.name.endswith(".distcp"))[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the size is unchanged
    target.write_bytes(bytes(data))
    res, run_dir = launch(exp, tiny_data, 2, "checkpoint_every_n_steps=4", resume=True)
    assert res.returncode == 0, res.stderr
    log = (run_dir / "logs/rank0.log").read_text() + (run_dir / "logs/rank1.log").read_text()
    assert f"corrupt checkpoint file {target}" in log and "falling back" in log
    assert attempts(run_dir)[-1]["start_step"] == 4
    assert_bitwise_equal(weights(run_dir), weights(reference))


def test_truncated_only_checkpoint_is_a_clear_error(tmp_path, tiny_data, interrupted):
    exp = copy_exp(interrupted, tmp_path)
    weights_file = exp / "tests" / interrupted.name / "model/last/weights.pth"
    weights_file.write_bytes(weights_file.read_bytes()[:100])
    res, _ = launch(exp, tiny_data, 1, resume=True)
    assert res.returncode != 0
    assert f"corrupt checkpoint file {weights_file}" in res.stderr and "Traceback" not in res.stderr


def test_rank_killed_under_max_restarts_resumes_by_itself(tmp_path, tiny_data, reference):
    # the tiny config's 2 epochs (24 steps): the kill lands right after the step-8 checkpoint, 16 steps before
    # the end; checkpointing changes nothing of the training, so the shared uninterrupted run is the reference
    common = ("checkpoint_every_n_steps=4", "checkpoint_async=false")
    ref = reference
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run_dir = tmp_path / "tests" / "victim"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pimm", "launch", "--train.config", TINY, "--resources.nproc-per-node", "2",
         "--resources.max-restarts", "1", "--run.name", "victim", "--run.no-timestamp",
         "--paths.exp-root", str(tmp_path), "--", f"data.train.path={tiny_data['train']}",
         f"data.val.path={tiny_data['val']}", "log_event_ids=true", *common],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not _checkpointed(run_dir, 8):
            time.sleep(0.02)
        pid = int(_pid_of(run_dir / "logs/rank1.log"))
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err
    runs = attempts(run_dir)
    assert len(runs) == 2 and runs[1]["torchrun_restart"] == 1 and runs[1]["resumed_from"]
    assert runs[1]["start_step"] >= 8
    assert runs[0]["optimizer_implementation"] == runs[1]["optimizer_implementation"] == "fused"
    assert_bitwise_equal(weights(run_dir), weights(ref))
    assert steps(run_dir) == steps(ref)


def test_weight_warm_start_and_its_errors(tmp_path, tiny_data, reference):
    # refused before any process starts
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, extra=["--train.weight", str(tmp_path / "nope.pth")]))
    assert res.returncode == 2 and "No weight found" in res.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "weights.pth").write_bytes(b"")
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, extra=["--train.weight", str(broken)]))
    assert res.returncode == 2 and "Incomplete checkpoint directory" in res.stderr
    best = reference / "model/model_best.pth"
    res, run_dir = launch(tmp_path, tiny_data, 1, "max_steps=2", name="warm", extra=["--train.weight", str(best)])
    assert res.returncode == 0, res.stderr
    assert attempts(run_dir)[0]["resumed_from"] == str(best)


def test_resume_of_a_missing_run_is_a_clear_error(tmp_path, tiny_data):
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, name="never-ran", resume=True))
    assert res.returncode == 2 and "cannot resume" in res.stderr and "never-ran" in res.stderr


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _checkpointed(run_dir: Path, step: int) -> bool:
    marker = run_dir / "model/last/.complete"
    try:
        return json.loads(marker.read_text())["step"] >= step
    except (OSError, ValueError):
        return False


def _pid_of(log: Path) -> str:
    for line in log.read_text().splitlines():
        if " pid " in line:
            return line.split(" pid ")[1].split()[0]
    raise AssertionError(f"no pid in {log}")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
