"""`pimm launch`: resolve a config, check it against the resources, run torchrun."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pimm.config import config_hash
from pimm.errors import LaunchError


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
                   help="start a new run from these weights only (weights.pth, model_best.pth, a checkpoint dir or "
                   "a `pimm export` dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command and, under it, the one `pimm launch` line that runs the same "
                   "plan (every choice spelled out, overrides quoted for a POSIX shell), the world size and "
                   "per-rank batch/workers; start nothing")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # deferred: the launch machinery imports h5py and numpy (the data checks), which `pimm --help` does without
    from pimm.launch.plan import data_files
    from pimm.launch.preflight import prepare_launch

    plan = prepare_launch(args)
    if args.dry_run:
        print(plan.describe(dry_run=True))
        for split, path in data_files(plan.cfg).items():
            print(f"data.{split}: {path} (ok, {plan.data[split]['num_events']} events)")
        print(f"dry run: nothing started, nothing written. `pimm launch` without --dry-run first writes "
              f"{plan.run_dir / 'config.py'} and launch.json, then runs the torchrun command above; the "
              "line pasted does all of that.")
        return 0
    # deferred: what only a launch that runs needs (a dry run prints and returns above)
    from pimm.launch import node
    from pimm.launch.run_dir import open_run_dir, write_launch_record

    step = args.slurm_step
    node_rank = step.node_id if step is not None else (args.node_rank or 0)
    tag = step.tag if step is not None else f"manual-{plan.rdzv_endpoint}".replace(":", "_")
    if node_rank > 0:  # node 0 writes the run directory; this node waits for it and runs its ranks
        facts = node.wait_for_announcement(plan.run_dir, tag)
        if facts.get("config_hash") != config_hash(plan.cfg):
            raise LaunchError(f"node {node_rank} resolved a different config than node 0 (config hash "
                              f"{config_hash(plan.cfg)} vs {facts.get('config_hash')}): every node must be given "
                              "the same config, overrides and files")
        return node.train_on_this_node(plan, None, node_rank)
    try:
        lock = open_run_dir(plan)
    except LaunchError as exc:
        if plan.nnodes > 1:
            node.announce_refusal(plan.run_dir, tag, str(exc))
        raise
    try:
        write_launch_record(plan, getattr(args, "resume_changes", None))
        print(plan.describe(), flush=True)
        shutil.rmtree(plan.run_dir / "errors", ignore_errors=True)  # errors of an earlier attempt
        if plan.nnodes > 1:
            node.announce(plan.run_dir, tag, config_hash=config_hash(plan.cfg))
        return node.train_on_this_node(plan, lock.fd)
    finally:
        lock.release()
        if plan.nnodes > 1:
            node.withdraw(plan.run_dir, tag)
