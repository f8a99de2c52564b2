"""provenance.json: one record per attempt of a run (each launch, each torchrun restart).

Rank 0 owns the file; every write replaces it atomically, so a crash never leaves it half-written.
An attempt that never recorded its end (the process was killed) is marked as such by the next one.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import pimm
from pimm.json_io import dumps


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def git_state(repo: Path) -> dict:
    """Commit and dirty flag of the pimm source tree (None when it is not a git checkout)."""
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


class Provenance:
    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / "provenance.json"
        self.enabled = enabled
        self.record: dict = {}

    def _load(self) -> dict:
        if self.path.exists():
            return json.loads(self.path.read_text())
        return {"run_dir": str(self.path.parent), "attempts": []}

    def _store(self, doc: dict) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(dumps(doc, indent=2, default=str))
        os.replace(tmp, self.path)

    def start(self, **fields) -> None:
        """Open a new attempt record with the environment facts plus `fields`."""
        if not self.enabled:
            return
        doc = self._load()
        for attempt in doc["attempts"]:
            if attempt.get("end_time") is None:
                attempt["end_time"] = None
                attempt["outcome"] = "lost: the processes ended without recording (killed or crashed)"
        self.record = {
            "attempt": len(doc["attempts"]) + 1,
            "start_time": _now(),
            "end_time": None,
            "outcome": "running",
            "pimm_version": pimm.__version__,
            "git": git_state(Path(pimm.__file__).resolve().parents[1]),
            "torch_version": torch.__version__,
            "python": platform.python_version(),
            "host": platform.node(),
            "torchrun_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "slurm": _slurm_facts(),
            **fields,
        }
        doc["attempts"].append(self.record)
        self._store(doc)

    def update(self, **fields) -> None:
        if not self.enabled:
            return
        self.record.update(fields)
        doc = self._load()
        doc["attempts"][self.record["attempt"] - 1] = self.record
        self._store(doc)

    def end(self, outcome: str, **fields) -> None:
        self.update(end_time=_now(), outcome=outcome, **fields)


def _slurm_facts() -> dict | None:
    """The Slurm job this attempt ran in (None outside Slurm)."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    names = {"job_id": "SLURM_JOB_ID", "step_id": "SLURM_STEP_ID", "job_name": "SLURM_JOB_NAME",
             "nodelist": "SLURM_JOB_NODELIST", "partition": "SLURM_JOB_PARTITION", "account": "SLURM_JOB_ACCOUNT"}
    return {key: os.environ.get(var) for key, var in names.items()}
