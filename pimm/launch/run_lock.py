"""One run directory, one writer: an exclusive `flock` on `<run>/.lock`, held by `pimm launch`
(and inherited by torchrun) for as long as the run is running.

The kernel releases the lock when its last holder dies, so a crashed or SIGKILLed run never
blocks its own resume. The lock file names the holder (pid, host, start time, command) so a
refused launch can say who has the run.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from pimm.errors import LaunchError

LOCK_NAME = ".lock"


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise LaunchError naming the process that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LaunchError(self._refusal(holder)) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": " ".join(sys.argv), "slurm_job": os.environ.get("SLURM_JOB_ID")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError:  # e.g. no space left for the holder's line: the caller says so
            os.close(fd)
            raise
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closes our descriptor; the lock ends when torchrun's copy closes too
            self.fd = None

    def _refusal(self, holder: dict) -> str:
        if not holder:
            who = "another launch (its lock file names no holder yet)"
        else:
            who = f"pid {holder.get('pid')} on host {holder.get('host')}, running since {holder.get('since')}"
            if holder.get("slurm_job"):
                who += f" in Slurm job {holder['slurm_job']}"
            if holder.get("command"):
                who += f" ({holder['command']})"
        return (
            f"run directory {self.run_dir} is in use by {who}. One run has one writer: wait until it "
            f"finishes, or stop it (kill -TERM <pid> checkpoints and exits) and then resume. The lock "
            f"{self.path} is released by the kernel when that process ends."
        )


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
