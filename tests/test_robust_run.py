"""How a run ends when the world misbehaves, through `pimm launch` with real processes: a run
root that cannot be written, a disk that fills during training, a rank killed by a signal, and
Ctrl-C. Each failure must end with one line that says what happened, and what is on disk must
let the run continue.

The disk tests mount small tmpfs file systems (read-only, or too small), which needs root with
CAP_SYS_ADMIN; without it they are skipped, saying so."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    attempts,
    kill_run,
    launch,
    metrics_lines,
    run_pimm,
    start_launch,
    wait_for_run,
)

from pimm.checkpoint.layout import verify


@contextlib.contextmanager
def tmpfs(mount_point: Path, size: str, read_only: bool = False):
    """A tmpfs of `size` at mount_point for the duration of the block; skips the test when this
    process may not mount."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) and the mount command; this test process has not")
    mount_point.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


def fill(folder: Path) -> None:
    """Write folder/fill until its file system is full."""
    fd = os.open(folder / "fill", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("case", ["read-only", "full", "a file", "under a file"])
def test_an_unwritable_exp_root_is_one_line_and_exit_2_with_nothing_left_behind(tmp_path, tiny_data, case):
    with contextlib.ExitStack() as stack:
        if case == "read-only":
            root = stack.enter_context(tmpfs(tmp_path / "ro", "1m", read_only=True)) / "exp"
            reason = "read-only file system"
        elif case == "full":
            root = stack.enter_context(tmpfs(tmp_path / "full", "64k"))
            fill(root)
            reason = "no space left on device"
        else:
            blocker = tmp_path / "plain-file"
            blocker.write_text("not a directory")
            root = blocker if case == "a file" else blocker / "exp"
            reason = f"{blocker} is a file, not a directory"
        res, _ = launch(root, tiny_data, 2)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            f"pimm: error: cannot create the run directory under {root}: {reason}; choose a writable --paths.exp-root"
        ]
        assert "Traceback" not in res.stdout
        if case == "full":  # no lock, no half-made run directory
            assert [p.name for p in root.iterdir()] == ["fill"]


def test_a_disk_that_fills_during_training_ends_with_one_line_and_the_run_resumes(tmp_path, tiny_data):
    # one checkpoint of the tiny config is ~320 KB: 640 KB holds the run and its step-4 checkpoint,
    # not the step-8 one written beside it (epochs=1: 12 steps, so the resume has only 8 left to train)
    exp = tmp_path / "exp"
    with tmpfs(exp, "640k"):
        proc = start_launch(exp, tiny_data, 2, "checkpoint_every_n_steps=4", "epochs=1")
        run_dir = exp / "tests" / "run"
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            kill_run(proc)
        assert proc.returncode == 1, err
        line = last_line(err)
        staging = run_dir / "model" / ".tmp-step_00000008"
        assert line.startswith(f"pimm: rank 0 failed: cannot write the checkpoint of step 8 to {staging}: "
                               "no space left on device"), err
        assert "Traceback" not in err
        assert "the last complete checkpoint is step 4" in err
        model = run_dir / "model"
        assert not staging.exists()  # removed: it frees the space it took
        # another rank may have begun the next write before it learned of the failure: never complete
        assert [p.name for p in model.iterdir() if (p / ".complete").exists()] == ["last"]
        assert verify(model / "last")["step"] == 4
        # with room again, the printed command continues from step 4
        subprocess.run(["mount", "-o", "remount,size=16m", str(exp)], check=True)
        res = run_pimm(["launch", "--train.resume", str(run_dir)], cwd=Path(__file__).parents[1])
        assert res.returncode == 0, res.stderr
        assert attempts(run_dir)[-1]["start_step"] == 4
        assert not list(model.glob(".tmp-*"))


def disturbed_run(tmp_path, tiny_data, disturb) -> tuple[int, str, Path]:
    """A long 2-rank run of the tiny config; once it has logged 3 steps, `disturb(run_dir, launcher)`;
    returns (exit status, stderr, run directory) once it has ended."""
    exp = tmp_path / "exp"
    proc = start_launch(exp, tiny_data, 2, "epochs=50")
    run_dir = exp / "tests" / "run"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 3)
        disturb(run_dir, proc)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_run(proc)
    return proc.returncode, err, run_dir


def test_kill_9_of_rank_1_is_named_as_the_cause(tmp_path, tiny_data):
    killed = []

    def kill_rank_1(run_dir: Path, _launcher) -> None:
        log = (run_dir / "logs" / "rank1.log").read_text()
        killed.append(int(re.search(r"rank 1 pid (\d+)", log).group(1)))
        os.kill(killed[0], signal.SIGKILL)

    status, err, _ = disturbed_run(tmp_path, tiny_data, kill_rank_1)
    assert status == 1, err
    assert re.fullmatch(rf"pimm: rank 1 \(pid {killed[0]}, local rank 1 on \S+\) was killed by signal 9 \(SIGKILL\); "
                        r"rank 0 then lost its connection", last_line(err)), err


def test_ctrl_c_writes_a_checkpoint_and_prints_the_continue_command(tmp_path, tiny_data):
    # what a terminal does: SIGINT to its foreground group, pimm launch and torchrun
    status, err, run_dir = disturbed_run(tmp_path, tiny_data, lambda _run_dir, proc: os.killpg(proc.pid, signal.SIGINT))
    assert status == 75, err
    step = json.loads((run_dir / "model" / "last" / ".complete").read_text())["step"]
    assert step >= 3
    lines = err.strip().splitlines()
    assert lines[-2] == (f"pimm: interrupted by SIGINT: wrote the checkpoint of step {step} "
                         f"({run_dir / 'model' / 'last'}) (exit status 75)"), err
    assert lines[-1] == f"pimm: continue with: pimm launch --train.resume {run_dir} --resources.nproc-per-node 2"


def test_a_second_ctrl_c_after_the_grace_time_kills_torchrun_at_once():
    from pimm.signals import GRACE_S, StopForwarder

    # stands in for torchrun busy with its graceful shutdown: it ignores the first SIGINT
    code = "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(9)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        with StopForwarder(child) as stops:
            os.kill(os.getpid(), signal.SIGINT)
            assert child.poll() is None and stops.signal_name == "SIGINT" and not stops.killed
            time.sleep(GRACE_S + 0.2)
            os.kill(os.getpid(), signal.SIGINT)
            assert child.wait(timeout=10) == -signal.SIGKILL and stops.killed
    finally:
        child.kill()
        child.wait()
