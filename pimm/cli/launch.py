"""`pimm launch`: resolve a config, check it against the resources, run torchrun."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pimm.errors import LaunchError
from pimm.launch.run_dir import open_run_dir, write_launch_record


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
                   help="print the torchrun command, world size and per-rank batch/workers; start nothing")
    p.set_defaults(run=run)


def prepare(args: argparse.Namespace, scheduled: bool = False):
    """Resolve and check everything that can be checked before a process starts -> LaunchPlan.
    scheduled: for `pimm submit`, whose rendezvous is decided in the job (pimm.launch.slurm_job)."""
    from pimm.cli.paths import config_roots
    from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
    from pimm.config.validate import check_config
    from pimm.launch.plan import make_plan, run_directory
    from pimm.launch.slurm import SlurmStep

    step = getattr(args, "slurm_step", None)
    if args.resume:
        from pimm.launch.resume import check_resume_changes, exit_if_completed, load_saved_run

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
        exit_if_completed(run_dir, cfg, config_name, f"pimm submit --site {args.site}" if scheduled else "pimm launch")
        if (args.nnodes is None and int(saved.launch.get("nnodes", 1)) > 1 and not scheduled
                and args.rdzv_endpoint is None and SlurmStep.from_env() is None):
            raise LaunchError(
                f"{run_dir} was launched on {saved.launch['nnodes']} nodes; to continue it on this machine pass "
                "--resources.nnodes 1 (the cursor is remapped to the new world size), or resume it under Slurm: "
                f"pimm submit --site SITE --train.resume {run_dir}"
            )
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
        args.nproc_per_node = args.nproc_per_node or "1"
        args.nnodes = 1 if args.nnodes is None else args.nnodes
        args.max_restarts = 0 if args.max_restarts is None else args.max_restarts
        if not scheduled and step is None and args.nnodes > 1:
            step = SlurmStep.from_env()
        if args.nnodes > 1 and step is None and args.timestamp and args.rdzv_endpoint and not scheduled:
            raise LaunchError(
                f"--resources.nnodes {args.nnodes} outside Slurm: every node must name the same run directory; "
                "pass the same --run.name NAME --run.no-timestamp on every node (or run under Slurm: pimm submit)"
            )
        run_dir = run_directory(args.exp_root, config_name, args.run_name, args.timestamp,
                                job_tag=step.tag if step else None)
    if cfg.get("validate_only") and not (args.weight or (cfg.get("pretrained") or {}).get("path")):
        raise LaunchError("validate_only=true evaluates given weights and trains nothing: pass --train.weight PATH "
                          "or set pretrained.path (weights.pth, model_best.pth, a checkpoint or export directory)")
    rdzv_id = None
    if scheduled:
        args.rdzv_endpoint, rdzv_id = "<first node of the job>:<port from the job id>", "$SLURM_JOB_ID"
    elif args.nnodes > 1 and args.rdzv_endpoint is None:
        step = step or SlurmStep.from_env()
        if step is not None:  # inside an allocation: the rendezvous comes from the Slurm step
            step.check_one_task_per_node(args.nnodes)
            args.rdzv_endpoint, rdzv_id = step.rendezvous_endpoint(), step.tag
    if args.nnodes > 1 and args.rdzv_endpoint and step is None and args.node_rank is None and not scheduled:
        raise LaunchError(
            f"--resources.nnodes {args.nnodes} outside Slurm needs --resources.node-rank R on every node "
            "(0 on the node that writes the run directory, 1..nnodes-1 on the others)"
        )
    args.slurm_step = step
    if (cfg.get("parallel") or {}).get("strategy") == "fsdp2":  # imports torch: FSDP2 runs only
        from pimm.distributed.strategy import check_strategy_fits

        check_strategy_fits(cfg)
    pretrained = cfg.get("pretrained") or {}
    weight = args.weight or (None if args.resume else pretrained.get("path"))
    if weight:  # imports torch, only here: missing, incomplete or other-model weights fail now, not in a rank
        from pimm.checkpoint.weights import check_pretrained_fits

        print(f"pimm: warm start from {check_pretrained_fits(weight, cfg['model'], pretrained).summary()}", flush=True)
    if cfg.get("freeze") or cfg.get("param_groups"):  # imports torch: patterns that match nothing fail now
        from pimm.engine.optim import check_parameter_patterns

        check_parameter_patterns(cfg)
    return make_plan(
        config_name, config_path, cfg, args.nproc_per_node, args.nnodes, run_dir,
        rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank,
        max_restarts=args.max_restarts, overrides=args.overrides,
        resume=bool(args.resume), weight=str(Path(args.weight).resolve()) if args.weight else None,
        gpus=getattr(args, "gpus", None), rdzv_id=rdzv_id,
    )


def data_files(cfg: dict) -> dict[str, str]:
    """split -> data path as configured (a relative path is relative to the current directory)."""
    return {split: cfg["data"][split]["path"] for split in ("train", "val", "test") if cfg["data"].get(split)}


def check_data(cfg: dict, global_batch: int) -> dict[str, dict]:
    """Every data set is valid for its type (a pimm event file, or PILArNet-M shards) with labels in
    0..data.num_classes-1 or task.ignore_index, and the train set fills one global batch;
    returns split -> the data's identity (pimm.data.event_file.validate_data)."""
    from pimm.data.event_file import validate_data

    checked = {}
    for split in data_files(cfg):
        info = checked[split] = validate_data(cfg["data"][split], num_classes=cfg["data"]["num_classes"],
                                              ignore_index=(cfg.get("task") or {}).get("ignore_index", -1))
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
    from pimm.launch import node

    step = args.slurm_step
    node_rank = step.node_id if step is not None else (args.node_rank or 0)
    tag = step.tag if step is not None else f"manual-{plan.rdzv_endpoint}".replace(":", "_")
    if node_rank > 0:  # node 0 writes the run directory; this node waits for it and runs its ranks
        facts = node.wait_for_announcement(plan.run_dir, tag)
        if facts.get("config_hash") != _config_hash(plan.cfg):
            raise LaunchError(f"node {node_rank} resolved a different config than node 0 (config hash "
                              f"{_config_hash(plan.cfg)} vs {facts.get('config_hash')}): every node must be given "
                              "the same config, overrides and files")
        return node.train_on_this_node(plan, None, node_rank)
    try:
        check_data(plan.cfg, plan.batches.global_batch_size)
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
            node.announce(plan.run_dir, tag, config_hash=_config_hash(plan.cfg))
        return node.train_on_this_node(plan, lock.fd)
    finally:
        lock.release()
        if plan.nnodes > 1:
            node.withdraw(plan.run_dir, tag)


def _config_hash(cfg: dict) -> str:
    from pimm.config import config_hash

    return config_hash(cfg)
