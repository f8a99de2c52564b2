"""torchrun as pimm's child process: the training of a node (pimm.launch.node) and every
evaluation (pimm.launch.evaluate) start their ranks through `run_torchrun`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pimm.engine.failure import REPORT_DIR_ENV
from pimm.signals import StopForwarder, die_with_parent


def run_torchrun(argv: list[str], lock_fd: int | None, report_dir: Path | None = None) -> tuple[int, StopForwarder]:
    """Run torchrun (see pimm.signals for who handles which signal): it dies with this process,
    holds the run lock (when this node has it) as long as it lives, gets the stop signals sent
    here, and its ranks report into `report_dir` (a local folder, pimm.engine.failure). Returns its
    exit status and what this process was signalled."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if report_dir is not None:
        env[REPORT_DIR_ENV] = str(report_dir)
    pass_fds = (lock_fd,) if lock_fd is not None else ()
    # preexec_fn is safe here: pimm runs no threads at this point
    proc = subprocess.Popen(argv, env=env, pass_fds=pass_fds, preexec_fn=die_with_parent)  # noqa: PLW1509
    with StopForwarder(proc) as stops:
        return proc.wait(), stops
