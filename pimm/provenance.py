"""provenance.json: one record per attempt of a run (each launch, each torchrun restart).

Rank 0 owns the file; every write replaces it atomically, so a crash never leaves it half-written.
An attempt that never recorded its end (the process was killed) is marked as such by the next one.
A file that is not a readable record (cut short by a copy, edited by hand) is never lost: it is
renamed to provenance.json.corrupt-<time> before anything starts (`set_aside_unreadable`), and the
run starts a fresh record.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from pathlib import Path

import pimm
from pimm.files import write_atomic
from pimm.json_io import dumps
from pimm.startup import rank_start

PROVENANCE = "provenance.json"
log = logging.getLogger("pimm")


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


def _problem(path: Path) -> str | None:
    """Why the provenance record at `path` cannot be read ('not JSON: ...'); None when it can (or is absent)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return "not UTF-8 text"
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc})"
    attempts = doc.get("attempts") if isinstance(doc, dict) else None
    if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
        return "not a provenance record (no list of attempts)"
    return None


def set_aside_unreadable(run_dir: Path) -> str | None:
    """When RUN/provenance.json cannot be read as a record, rename it to provenance.json.corrupt-<time>
    (kept for a person to read; the run starts a fresh record) and return one line saying so; None
    when it is readable or absent. OSError when it cannot be read or renamed."""
    path = Path(run_dir) / PROVENANCE
    problem = _problem(path)
    if problem is None:
        return None
    kept = path.with_name(f"{PROVENANCE}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    while kept.exists():  # two in one second: never replace one that was kept
        kept = kept.with_name(kept.name + "+")
    os.replace(path, kept)
    return (f"{path} is {problem}; kept as {kept.name}, and this launch starts a fresh record of the run's "
            "attempts (the checkpoints are unaffected)")


class Provenance:
    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / PROVENANCE
        self.enabled = enabled
        self.record: dict = {}

    def _load(self) -> dict:
        # the launch set an unreadable file aside already; one damaged since is set aside here
        said = set_aside_unreadable(self.path.parent)
        if said is not None:
            log.warning("%s", said)
        if self.path.exists():
            return json.loads(self.path.read_text())
        return {"run_dir": str(self.path.parent), "attempts": []}

    def _store(self, doc: dict) -> None:
        write_atomic(self.path, dumps(doc, indent=2, default=str))

    def start(self, **fields) -> None:
        """Open a new attempt record with the environment facts plus `fields`."""
        if not self.enabled:
            return
        # deferred: the ranks have torch loaded; the launcher uses this module (set_aside_unreadable) without it
        import torch

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
            "rank_start": rank_start(),
            "torch_threads": torch.get_num_threads(),
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
        attempts, index = doc["attempts"], self.record["attempt"] - 1
        if index < len(attempts):
            attempts[index] = self.record
        else:  # the file was set aside since this attempt started: the fresh record keeps this attempt
            attempts.append(self.record)
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
