"""Writing a run directory before any process starts: created atomically, locked, and given
the resolved config (config.py) and the launch description (launch.json) that every node and
every rank reads. Only `pimm launch` on node 0 and `pimm submit` on the submitting host write here.
"""

from __future__ import annotations

import json
import time

from pimm.errors import LaunchError
from pimm.launch.run_lock import RunLock


def open_run_dir(plan) -> RunLock:
    """A new run gets a new directory (of two launches of one name, the second is refused); a
    resumed run must exist and have a checkpoint to resume. Either way the run lock is taken
    before anything is written, and returned. The resolved config is written as config.py; a
    resume with a different config keeps the old one beside it."""
    from pimm.checkpoint.layout import resumable
    from pimm.config import config_hash, dump_config, load_config

    run_dir = plan.run_dir
    if not plan.resume:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
        except FileExistsError:
            raise LaunchError(
                f"run directory {run_dir} already exists; resume it with --train.resume {run_dir}, "
                "or choose another --run.name"
            ) from None
    lock = RunLock(run_dir).acquire()
    try:
        if plan.resume:
            resumable(run_dir / "model")  # 'Incomplete checkpoint directory ...' before any process starts
            previous = run_dir / "config.py"
            if previous.exists() and config_hash(load_config(previous)) != config_hash(plan.cfg):
                kept = run_dir / f"config.before-{time.strftime('%Y%m%d-%H%M%S')}.py"
                previous.replace(kept)
                print(f"pimm: the config differs from the run's previous one (kept as {kept})", flush=True)
        dump_config(plan.cfg, run_dir / "config.py")
    except BaseException:
        lock.release()
        raise
    return lock


def write_launch_record(plan, resume_changes: dict | None = None, **extra) -> dict:
    """launch.json: what this launch was asked for; the trainer copies parts into provenance and
    `--train.resume` and the Slurm node agents read it back (pimm.launch.plan.plan_from_run)."""
    from pimm.config import config_hash

    record = {
        "config": plan.config_name, "config_path": str(plan.config_path), "overrides": plan.overrides,
        "resumed": plan.resume, "resume_changes": resume_changes or {}, "weight": plan.weight,
        "config_hash": config_hash(plan.cfg), "world_size": plan.world_size, "nnodes": plan.nnodes,
        "nproc_per_node": plan.nproc_per_node, "max_restarts": plan.max_restarts,
        "device_type": plan.device_type, "batches": plan.batches.as_dict(), "command": plan.torchrun_argv(),
        **extra,
    }
    tmp = plan.run_dir / "launch.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(plan.run_dir / "launch.json")
    return record
