"""Shared fixtures: free ports, small generated data sets, and a runner for the pimm CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """Small train/val event files, generated once per test session."""
    from pimm.data.synth import write_dataset

    root = tmp_path_factory.mktemp("data")
    return {
        "train": write_dataset(root / "train.h5", 48, seed=11),
        "val": write_dataset(root / "val.h5", 12, seed=12),
    }


def run_pimm(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m pimm ARGS` in its own process group; kill the whole group if it hangs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pimm", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"pimm {' '.join(args)} timed out\nstdout:\n{out}\nstderr:\n{err}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of ours may outlive the test
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
