"""Writing a run directory before any process starts: created atomically, locked, and given
the resolved config (config.py) and the launch description (launch.json) that every node and
every rank reads. Only `pimm launch` on node 0 and `pimm submit` on the submitting host write here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import time
from pathlib import Path

from pimm.checkpoint.layout import resumable
from pimm.config import config_hash, dump_config, read_run_config
from pimm.errors import LaunchError
from pimm.files import os_error_reason, write_atomic
from pimm.launch.run_lock import RunLock
from pimm.provenance import set_aside_unreadable

# directories open_run_dir made for a new run: removed again when writing it fails before any process starts
_made_for: dict[Path, list[Path]] = {}


def open_run_dir(plan) -> RunLock:
    """A new run gets a new directory (of two launches of one name, the second is refused); a
    resumed run must exist and have a checkpoint to resume. Either way the run lock is taken
    before anything is written, and returned. The resolved config is written as config.py; a
    resume with a different config keeps the old one beside it."""
    run_dir = plan.run_dir
    if not plan.resume:
        made = [d for d in (*reversed(run_dir.parents), run_dir) if not d.exists()]  # outermost first
        try:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            run_dir.mkdir()
        except FileExistsError:
            if run_dir.is_dir():
                raise LaunchError(
                    f"run directory {run_dir} already exists; resume it with --train.resume {run_dir}, "
                    "or choose another --run.name"
                ) from None
            blocker = run_dir if run_dir.exists() or run_dir.is_symlink() else run_dir.parent
            raise LaunchError(
                f"{blocker} is {_kind(blocker)} in the way of the run directory {run_dir} (a folder must be "
                "there); move or remove it, or choose another --paths.exp-root"
                + (" or --run.name" if blocker == run_dir else "")
            ) from None
        except OSError as exc:
            _remove_new_run(run_dir, made)
            raise LaunchError(cannot_write(plan, exc)) from None
        _made_for[run_dir] = made
    try:
        lock = RunLock(run_dir).acquire()
    except OSError as exc:
        _remove_new_run(run_dir, _made_for.pop(run_dir, []) if not plan.resume else None)
        raise LaunchError(cannot_write(plan, exc)) from None
    try:
        if plan.resume:
            resumable(run_dir / "model")  # 'Incomplete checkpoint directory ...' before any process starts
            said = set_aside_unreadable(run_dir)  # before the ranks read it: a damaged record is kept, not fatal
            if said is not None:
                print(f"pimm: {said}", flush=True)
            previous = run_dir / "config.py"
            if previous.exists() and config_hash(read_run_config(previous)) != config_hash(plan.cfg):
                kept = run_dir / f"config.before-{time.strftime('%Y%m%d-%H%M%S')}.py"
                previous.replace(kept)
                print(f"pimm: the config differs from the run's previous one (kept as {kept})", flush=True)
        dump_config(plan.cfg, run_dir / "config.py")
    except BaseException as exc:
        lock.release()
        if isinstance(exc, OSError):
            _remove_new_run(run_dir, _made_for.pop(run_dir, None) if not plan.resume else None)
            raise LaunchError(cannot_write(plan, exc)) from None
        raise
    return lock


def write_launch_record(plan, resume_changes: dict | None = None, **extra) -> dict:
    """launch.json: what this launch was asked for; the trainer copies parts into provenance and
    `--train.resume` and the Slurm node agents read it back (pimm.launch.plan.plan_from_run)."""
    record = {
        "config": plan.config_name, "config_path": str(plan.config_path), "overrides": plan.overrides,
        "resumed": plan.resume, "resume_changes": resume_changes or {}, "weight": plan.weight,
        "config_hash": config_hash(plan.cfg), "world_size": plan.world_size, "nnodes": plan.nnodes,
        "nproc_per_node": plan.nproc_per_node, "max_restarts": plan.max_restarts,
        "device_type": plan.device_type, "batches": plan.batches.as_dict(), "command": plan.torchrun_argv(),
        **extra,
    }
    try:
        write_atomic(plan.run_dir / "launch.json", json.dumps(record, indent=2))
    except OSError as exc:
        # nothing has run in a new run directory yet: leave nothing of it behind
        _remove_new_run(plan.run_dir, _made_for.pop(plan.run_dir, None) if not plan.resume else None)
        raise LaunchError(cannot_write(plan, exc)) from None
    _made_for.pop(plan.run_dir, None)
    return record


def cannot_write(plan, exc: OSError) -> str:
    """One line for a run directory that cannot be written: the path, the reason, what to do."""
    reason = os_error_reason(exc)
    if plan.resume:
        fix = "free space on its disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
        return f"cannot write to the run directory {plan.run_dir}: {reason}; {fix}, then resume it again"
    exp_root = plan.run_dir.parent.parent
    return f"cannot create the run directory under {exp_root}: {reason}; choose a writable --paths.exp-root"


def _kind(path: Path) -> str:
    """'a file', 'a broken symbolic link', ...: what is at `path` instead of a folder."""
    if path.is_symlink() and not path.exists():
        return "a broken symbolic link"
    return "a file" if path.is_file() else "something other than a folder"


def _remove_new_run(run_dir: Path, made: list[Path] | None) -> None:
    """Remove a new run directory and the parents made for it (innermost first, only when empty);
    made None: a resumed run, whose directory stays."""
    if made is None:
        return
    if run_dir in made:
        shutil.rmtree(run_dir, ignore_errors=True)
    for path in reversed(made):
        with contextlib.suppress(OSError):  # not empty (another run is in it now) or already gone
            path.rmdir()
