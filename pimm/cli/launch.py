"""`pimm launch`: resolve a config, check it against the resources, run torchrun."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pimm.errors import EXIT_CHECKPOINTED, LaunchError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="train a config with torchrun (single process, DDP)",
        description="Train a config: one process per GPU with NCCL, or N CPU processes with gloo. "
        "Everything after a bare `--` is a key=value config override (values parsed as YAML, "
        "dotted keys patch nested dicts), e.g. `-- epochs=2 data.train.max_len=32`.",
        usage="pimm launch --train.config NAME_OR_PATH [options] [-- key=value ...]",
    )
    p.add_argument("--train.config", dest="config", metavar="NAME_OR_PATH",
                   help="config name under configs/ (e.g. demo/semseg) or a path to a .py config; "
                   "required unless --train.resume names a run directory")
    p.add_argument("--resources.nproc-per-node", dest="nproc_per_node", metavar="N|auto",
                   help="processes per node: one per GPU; on a CPU-only machine N gloo processes; "
                   "auto = all visible GPUs, or 1 without GPUs (default 1; on resume: as the run was launched)")
    p.add_argument("--resources.nnodes", dest="nnodes", type=int, metavar="M",
                   help="number of nodes (default 1; on resume: as launched); more than one needs "
                   "--resources.rdzv-endpoint")
    p.add_argument("--resources.rdzv-endpoint", dest="rdzv_endpoint", metavar="HOST:PORT",
                   help="rendezvous endpoint shared by all nodes (multi-node only)")
    p.add_argument("--resources.node-rank", dest="node_rank", type=int, metavar="R",
                   help="this node's rank (multi-node, optional with c10d rendezvous)")
    p.add_argument("--resources.max-restarts", dest="max_restarts", type=int, metavar="K",
                   help="torchrun restarts of the whole worker group after a failure (default 0; on resume: as "
                   "launched)")
    p.add_argument("--run.name", dest="run_name", metavar="NAME",
                   help="run name (default: the config's name); the run directory is <exp-root>/<group>/<name>")
    p.add_argument("--run.timestamp", dest="timestamp", action="store_true", default=True,
                   help="append -YYYYmmdd-HHMMSS to the run name (the default)")
    p.add_argument("--run.no-timestamp", dest="timestamp", action="store_false",
                   help="use the run name as it is (needed to resume a run by name)")
    p.add_argument("--paths.exp-root", dest="exp_root", type=Path, default=Path("exp"), metavar="DIR",
                   help="root of all run directories (default ./exp)")
    p.add_argument("--train.resume", dest="resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue a run from its newest complete checkpoint: RUN_DIR (e.g. exp/demo/semseg-"
                   "20261202-114630), or <exp-root>/<group>/<run.name> without it (the name used as given). "
                   "Reuses the run's own resolved config (RUN_DIR/config.py) and its launch (processes, nodes, "
                   "restarts); `-- key=value` overrides and --resources flags apply on top and are recorded in "
                   "provenance. Changes that cannot continue the run (model shape, optimizer, schedule length) "
                   "are refused before anything starts")
    p.add_argument("--train.weight", dest="weight", metavar="PATH",
                   help="start a new run from these weights only (weights.pth, model_best.pth or a checkpoint dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command, world size and per-rank batch/workers; start nothing")
    p.set_defaults(run=run)


def prepare(args: argparse.Namespace):
    """Resolve and check everything that can be checked before a process starts -> LaunchPlan."""
    from pimm.cli.paths import config_roots
    from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
    from pimm.config.validate import check_config
    from pimm.launch.plan import make_plan, run_directory

    if args.resume:
        from pimm.launch.resume import check_resume_changes, load_saved_run

        if args.resume is True and not args.config:
            raise LaunchError("--train.resume needs the run: --train.resume RUN_DIR, or --train.config with --run.name")
        if args.resume is True:
            run_dir = run_directory(args.exp_root, args.config.removesuffix(".py"), args.run_name, False)
        else:
            run_dir = Path(args.resume)
        saved = load_saved_run(run_dir)
        config_name = saved.config_name
        config_path = Path(saved.launch.get("config_path") or run_dir / "config.py")
        cfg = apply_overrides(saved.cfg, parse_overrides(args.overrides))
        check_config(cfg)
        args.resume_changes = check_resume_changes(saved, cfg)
        for key, default in (("nproc_per_node", "1"), ("nnodes", 1), ("max_restarts", 0)):
            if getattr(args, key) is None:
                setattr(args, key, str(saved.launch.get(key, default)) if key == "nproc_per_node"
                        else saved.launch.get(key, default))
        changes = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in args.resume_changes.items()) or "none"
        print(f"pimm: resuming {run_dir} with its own config ({run_dir / 'config.py'}; a config file edited since "
              f"is not read) and {args.nproc_per_node} process(es) per node; config changes: {changes}", flush=True)
    else:
        if not args.config:
            raise LaunchError("--train.config is required (a config name such as demo/semseg, or a .py path)")
        config_path = resolve_config_path(args.config, config_roots())
        cfg = apply_overrides(load_config(config_path), parse_overrides(args.overrides))
        check_config(cfg)
        config_name = args.config.removesuffix(".py")
        run_dir = run_directory(args.exp_root, config_name, args.run_name, args.timestamp)
        args.nproc_per_node = args.nproc_per_node or "1"
        args.nnodes = 1 if args.nnodes is None else args.nnodes
        args.max_restarts = 0 if args.max_restarts is None else args.max_restarts
    if args.weight:  # imports torch, only here: missing, incomplete or other-model weights fail now, not in a rank
        from pimm.checkpoint.weights import check_weights_fit

        check_weights_fit(args.weight, cfg["model"])
    return make_plan(
        config_name, config_path, cfg, args.nproc_per_node, args.nnodes, run_dir,
        rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank,
        max_restarts=args.max_restarts, overrides=args.overrides,
        resume=bool(args.resume), weight=str(Path(args.weight).resolve()) if args.weight else None,
    )


def data_files(cfg: dict) -> dict[str, str]:
    """split -> data path as configured (a relative path is relative to the current directory)."""
    return {split: cfg["data"][split]["path"] for split in ("train", "val", "test") if cfg["data"].get(split)}


def check_data(cfg: dict, global_batch: int) -> dict[str, dict]:
    """Every data file is a valid pimm event file with labels in 0..data.num_classes-1, and the
    train set fills one global batch; returns split -> the file's identity (validate_event_file)."""
    from pimm.data.event_file import validate_event_file

    checked = {}
    for split, path in data_files(cfg).items():
        info = checked[split] = validate_event_file(path, num_classes=cfg["data"]["num_classes"])
        if split == "train":
            max_len = cfg["data"]["train"].get("max_len")
            events = min(info["num_events"], max_len) if max_len else info["num_events"]
            if events < global_batch:
                raise LaunchError(
                    f"data.train has {events} events, fewer than one global batch (batch_size={global_batch}); "
                    "use more events or a smaller batch_size"
                )
    return checked


def run(args: argparse.Namespace) -> int:
    plan = prepare(args)
    if args.dry_run:
        checked = check_data(plan.cfg, plan.batches.global_batch_size)  # the same checks as a real launch
        print(plan.describe())
        for split, path in data_files(plan.cfg).items():
            print(f"data.{split}: {path} (ok, {checked[split]['num_events']} events)")
        print(f"dry run: nothing started, nothing written. `pimm launch` without --dry-run first writes "
              f"{plan.run_dir / 'config.py'} and launch.json, then runs the torchrun command above: it is shown "
              "for inspection, not for pasting.")
        return 0
    check_data(plan.cfg, plan.batches.global_batch_size)
    from pimm.config import config_hash

    run_dir = plan.run_dir
    lock = _prepare_run_dir(plan)
    try:
        launch_record = {
            "config": plan.config_name, "config_path": str(plan.config_path), "overrides": plan.overrides,
            "resumed": plan.resume, "resume_changes": getattr(args, "resume_changes", None) or {},
            "config_hash": config_hash(plan.cfg), "world_size": plan.world_size, "nnodes": plan.nnodes,
            "nproc_per_node": plan.nproc_per_node, "max_restarts": plan.max_restarts,
            "device_type": plan.device_type, "batches": plan.batches.as_dict(), "command": plan.torchrun_argv(),
        }
        (run_dir / "launch.json").write_text(json.dumps(launch_record, indent=2))
        print(plan.describe(), flush=True)
        shutil.rmtree(run_dir / "errors", ignore_errors=True)  # errors of an earlier attempt
        attempts_before = len(_attempts(run_dir))
        returncode = _run_torchrun(plan.torchrun_argv(), lock.fd)
    finally:
        lock.release()
    attempts = _attempts(run_dir)[attempts_before:]
    outcome = attempts[-1].get("outcome", "unknown") if attempts else "unknown"
    if outcome.startswith("interrupted"):
        return _report_interrupted(plan, outcome)
    if returncode != 0:
        _report_failure(run_dir, returncode)
        return returncode
    _report_success(run_dir)
    return 0


def _prepare_run_dir(plan):
    """A new run gets a new directory (created atomically: of two launches of one name, the
    second is refused); a resumed run must exist. Either way the run lock is taken before
    anything is written, and returned. The resolved config is written as config.py; a resume
    with a different config keeps the old one beside it."""
    from pimm.checkpoint.layout import resumable
    from pimm.config import config_hash, dump_config, load_config
    from pimm.launch.run_lock import RunLock

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


def _attempts(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "provenance.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


def _report_interrupted(plan, outcome: str) -> int:
    from pimm.launch.resume import continue_command

    command = continue_command(plan.run_dir, plan.nproc_per_node, plan.nnodes, plan.max_restarts)
    print(f"\npimm: {outcome}; a complete checkpoint is in {plan.run_dir / 'model' / 'last'}", file=sys.stderr)
    print(f"pimm: continue with: {command}", file=sys.stderr)
    return EXIT_CHECKPOINTED


def _run_torchrun(argv: list[str], lock_fd: int) -> int:
    """Run torchrun (see pimm.signals for who handles which signal): it dies with pimm launch,
    holds the run lock as long as it lives, and gets SIGTERM for a SIGTERM or SIGUSR1 sent here."""
    from pimm.signals import die_with_parent, forward_stop_signals

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # preexec_fn is safe here: pimm launch runs no threads
    proc = subprocess.Popen(argv, env=env, pass_fds=(lock_fd,), preexec_fn=die_with_parent)  # noqa: PLW1509
    previous = forward_stop_signals(proc)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to the whole group; let torchrun finish
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report_failure(run_dir: Path, returncode: int) -> None:
    errors = sorted((run_dir / "errors").glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    print(f"\npimm: training failed (torchrun exit status {returncode})", file=sys.stderr)
    for path in errors:
        print(f"pimm: {path.stem.replace('rank', 'rank ')} failed: {path.read_text().strip()}", file=sys.stderr)
    if not errors:
        print(f"pimm: no rank reported an error; see the logs in {run_dir / 'logs'}", file=sys.stderr)


def _report_success(run_dir: Path) -> None:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    final = summary.get("final_val") or {}
    print("\npimm: training finished")
    if final:
        print(f"  validation mIoU  {final['miou']:.4f} (loss {final['loss']:.4f}, {final['events']} events)")
    print(f"  run directory    {run_dir}")
    print(f"  config           {run_dir / 'config.py'}")
    print(f"  logs             {run_dir / 'logs'}/rank*.log")
    print(f"  metrics          {run_dir / 'metrics.jsonl'}")
    print(f"  plot             {run_dir / 'plot.png'}")
    print(f"  checkpoint       {run_dir / 'model' / 'last'}")
