"""Shared fixtures: free ports, small generated data sets, and a runner for the pimm CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


SLURM_HOWTO = "start the local two-node cluster with `bash scripts/slurm_local.sh up`"


def require_slurm_cluster() -> None:
    """Skip the calling test when no Slurm cluster answers `sinfo`; fail instead when the run must
    have one (PIMM_REQUIRE_SLURM=1, which .ci/run sets, or CI)."""
    try:
        ok = shutil.which("sinfo") is not None and subprocess.run(
            ["sinfo", "-h"], capture_output=True, timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    if ok:
        return
    if os.environ.get("PIMM_REQUIRE_SLURM") == "1" or os.environ.get("CI"):
        pytest.fail(f"no Slurm cluster answers `sinfo`, and this test run requires one (PIMM_REQUIRE_SLURM=1 or CI "
                    f"is set): {SLURM_HOWTO} before the tests", pytrace=False)
    pytest.skip(f"needs a Slurm cluster: {SLURM_HOWTO}")


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


# -- runs of the tiny config through `pimm launch` (shared by the resume and hardening tests) --

TINY = "tests/tiny_semseg"  # 48 train events / batch 4 = 12 steps per epoch


def launch(exp, tiny_data, nproc, *overrides, name="run", resume=False, extra=()):
    args = ["launch", "--train.config", TINY, "--resources.nproc-per-node", str(nproc), "--run.name", name,
            "--run.no-timestamp", "--paths.exp-root", str(exp), *extra]
    if resume:
        args.append("--train.resume")
    res = run_pimm([*args, "--", f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}",
                    "log_event_ids=true", *overrides], cwd=REPO)
    return res, exp / "tests" / name


def steps(run_dir: Path) -> dict[int, list[int]]:
    """step -> the global batch's event ids (ranks concatenated in rank order)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in (run_dir / "logs").glob("event_ids_rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {})[rec["rank"]] = rec["event_ids"]
    return {s: [i for r in sorted(ranks) for i in ranks[r]] for s, ranks in sorted(by_step.items())}


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model/last/weights.pth", weights_only=True)


def attempts(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "provenance.json").read_text())["attempts"]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_data):
    """An uninterrupted 2-rank run of 2 epochs (24 steps)."""
    res, run_dir = launch(tmp_path_factory.mktemp("ref"), tiny_data, 2, name="ref")
    assert res.returncode == 0, res.stderr
    return run_dir


def start_launch(exp, tiny_data, nproc, *overrides, name="run", extra=()) -> subprocess.Popen:
    """`pimm launch` of the tiny config in the background, in a session of its own (like a batch job)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "pimm", "launch", "--train.config", TINY, "--resources.nproc-per-node", str(nproc),
            "--run.name", name, "--run.no-timestamp", "--paths.exp-root", str(exp), *extra, "--",
            f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", *overrides]
    return subprocess.Popen(args, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def processes_of(run_dir: Path) -> list[int]:
    """Every live process whose command line names `run_dir` or its run name: launcher, torchrun,
    ranks and their (forked) loader workers."""
    needles = (str(run_dir).encode(), f"--run.name {run_dir.name} ".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            state = next((ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if "Z" not in state and any(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float = 120, every: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def wait_for_run(proc: subprocess.Popen, predicate, timeout: float = 120) -> None:
    """Wait until `predicate()` holds while the launch runs; fail with its output if it ended first."""
    if not wait_until(lambda: predicate() or proc.poll() is not None, timeout):
        raise AssertionError(f"timed out after {timeout} s waiting for the run")
    if not predicate():
        out, err = proc.communicate()
        raise AssertionError(f"the launch ended (status {proc.returncode}) before it got there:\n{err[-3000:]}")


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def signal_all(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids` (as Slurm signals every process of a step); gone ones are skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Test cleanup: SIGKILL the launcher's group and anything else of the run still alive."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in processes_of(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
