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
    p.add_argument("--train.config", dest="config", required=True, metavar="NAME_OR_PATH",
                   help="config name under configs/ (e.g. demo/semseg) or a path to a .py config")
    p.add_argument("--resources.nproc-per-node", dest="nproc_per_node", default="1", metavar="N|auto",
                   help="processes per node: one per GPU; on a CPU-only machine N gloo processes; "
                   "auto = all visible GPUs, or 1 without GPUs (default 1)")
    p.add_argument("--resources.nnodes", dest="nnodes", type=int, default=1, metavar="M",
                   help="number of nodes (default 1); more than one needs --resources.rdzv-endpoint")
    p.add_argument("--resources.rdzv-endpoint", dest="rdzv_endpoint", metavar="HOST:PORT",
                   help="rendezvous endpoint shared by all nodes (multi-node only)")
    p.add_argument("--resources.node-rank", dest="node_rank", type=int, metavar="R",
                   help="this node's rank (multi-node, optional with c10d rendezvous)")
    p.add_argument("--resources.max-restarts", dest="max_restarts", type=int, default=0, metavar="K",
                   help="torchrun restarts of the whole worker group after a failure (default 0)")
    p.add_argument("--run.name", dest="run_name", metavar="NAME",
                   help="run name (default: the config's name); the run directory is <exp-root>/<group>/<name>")
    p.add_argument("--run.timestamp", dest="timestamp", action="store_true", default=True,
                   help="append -YYYYmmdd-HHMMSS to the run name (the default)")
    p.add_argument("--run.no-timestamp", dest="timestamp", action="store_false",
                   help="use the run name as it is (needed to resume a run by name)")
    p.add_argument("--paths.exp-root", dest="exp_root", type=Path, default=Path("exp"), metavar="DIR",
                   help="root of all run directories (default ./exp)")
    p.add_argument("--train.resume", dest="resume", action="store_true",
                   help="continue run <exp-root>/<group>/<run.name> from its newest complete checkpoint "
                   "(the name is used as given: no timestamp is added)")
    p.add_argument("--train.weight", dest="weight", metavar="PATH",
                   help="start a new run from these weights only (weights.pth, model_best.pth or a checkpoint dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command, world size and per-rank batch/workers; start nothing")
    p.set_defaults(run=run)


def prepare(args: argparse.Namespace):
    """Resolve and check everything that can be checked before a process starts -> LaunchPlan."""
    from pimm.cli.paths import config_roots
    from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
    from pimm.config.required import check_config
    from pimm.launch.plan import make_plan, run_directory

    config_path = resolve_config_path(args.config, config_roots())
    cfg = apply_overrides(load_config(config_path), parse_overrides(args.overrides))
    check_config(cfg)
    config_name = args.config.removesuffix(".py")
    run_dir = run_directory(args.exp_root, config_name, args.run_name, args.timestamp and not args.resume)
    if args.weight:
        from pimm.checkpoint.weights import resolve_weight_path

        resolve_weight_path(args.weight)  # 'No weight found' / 'Incomplete checkpoint directory' now, not later
    return make_plan(
        config_name, config_path, cfg, args.nproc_per_node, args.nnodes, run_dir,
        rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank,
        max_restarts=args.max_restarts, overrides=args.overrides,
        resume=args.resume, weight=str(Path(args.weight).resolve()) if args.weight else None,
    )


def data_files(cfg: dict) -> dict[str, str]:
    return {split: cfg["data"][split]["path"] for split in ("train", "val", "test") if cfg["data"].get(split)}


def check_data(cfg: dict, global_batch: int) -> None:
    """Every data file exists and is a pimm event file; the train set fills one global batch."""
    from pimm.data.event_file import validate_event_file

    for split, path in data_files(cfg).items():
        info = validate_event_file(path)
        if split == "train":
            max_len = cfg["data"]["train"].get("max_len")
            events = min(info["num_events"], max_len) if max_len else info["num_events"]
            if events < global_batch:
                raise LaunchError(
                    f"data.train has {events} events, fewer than one global batch (batch_size={global_batch}); "
                    "use more events or a smaller batch_size"
                )


def run(args: argparse.Namespace) -> int:
    plan = prepare(args)
    if args.dry_run:
        print(plan.describe())
        for split, path in data_files(plan.cfg).items():
            state = "ok" if Path(path).is_file() else "MISSING"
            print(f"data.{split}: {path} ({state})")
        return 0
    check_data(plan.cfg, plan.batches.global_batch_size)
    from pimm.config import config_hash

    run_dir = plan.run_dir
    _prepare_run_dir(plan)
    launch_record = {
        "config": plan.config_name, "config_path": str(plan.config_path), "overrides": plan.overrides,
        "config_hash": config_hash(plan.cfg), "world_size": plan.world_size, "nnodes": plan.nnodes,
        "nproc_per_node": plan.nproc_per_node, "device_type": plan.device_type,
        "batches": plan.batches.as_dict(), "command": plan.torchrun_argv(),
    }
    (run_dir / "launch.json").write_text(json.dumps(launch_record, indent=2))
    print(plan.describe(), flush=True)
    shutil.rmtree(run_dir / "errors", ignore_errors=True)  # errors of an earlier attempt
    attempts_before = len(_attempts(run_dir))
    returncode = _run_torchrun(plan.torchrun_argv())
    attempts = _attempts(run_dir)[attempts_before:]
    outcome = attempts[-1].get("outcome", "unknown") if attempts else "unknown"
    if outcome.startswith("interrupted"):
        return _report_interrupted(plan, outcome)
    if returncode != 0:
        _report_failure(run_dir, returncode)
        return returncode
    _report_success(run_dir)
    return 0


def _prepare_run_dir(plan) -> None:
    """A new run gets a new directory; a resumed run must exist. The resolved config is written
    as config.py; a resume with a different config keeps the old one beside it."""
    from pimm.checkpoint.layout import resumable
    from pimm.config import config_hash, dump_config, load_config

    run_dir = plan.run_dir
    if plan.resume:
        if not run_dir.is_dir():
            raise LaunchError(
                f"cannot resume: run directory {run_dir} does not exist; check --run.name and --paths.exp-root"
            )
        resumable(run_dir / "model")  # 'Incomplete checkpoint directory ...' before any process starts
        previous = run_dir / "config.py"
        if previous.exists() and config_hash(load_config(previous)) != config_hash(plan.cfg):
            kept = run_dir / f"config.before-{time.strftime('%Y%m%d-%H%M%S')}.py"
            previous.replace(kept)
            print(f"pimm: the config differs from the run's previous one (kept as {kept})", flush=True)
    elif run_dir.exists():
        raise LaunchError(
            f"run directory {run_dir} already exists; resume it with --train.resume, or choose another --run.name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(plan.cfg, run_dir / "config.py")


def _attempts(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "provenance.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


def _report_interrupted(plan, outcome: str) -> int:

    print(f"\npimm: {outcome}; a complete checkpoint is in {plan.run_dir / 'model' / 'last'}", file=sys.stderr)
    print(f"pimm: continue with: pimm launch --train.config {plan.config_name} --run.name {plan.run_dir.name} "
          f"--paths.exp-root {plan.run_dir.parents[1]} --train.resume", file=sys.stderr)
    return EXIT_CHECKPOINTED


def _run_torchrun(argv: list[str]) -> int:
    """Run torchrun; SIGTERM or SIGUSR1 sent to pimm reaches it as SIGTERM, which torchrun
    forwards to every worker (each then checkpoints and exits)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(argv, env=env)
    forwarded = (signal.SIGTERM, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, lambda _s, _f: proc.send_signal(signal.SIGTERM)) for sig in forwarded}
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
