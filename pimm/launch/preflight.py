"""The pre-flight of `pimm launch` and `pimm submit`: everything that can be checked before a
process starts, in one order, each check by the module that owns it, ending in the LaunchPlan.

    1. the config: a config file with the overrides (pimm.config), or for --train.resume the run's
       own with what the resume changes and whether the run already completed (pimm.launch.resume)
    2. the resources and the rendezvous (Slurm step, endpoint, node rank)
    3. the batch plan (pimm.launch.plan: processes against the machine, pimm.distributed.batch)
    4. the data (pimm.launch.plan.check_data: each split valid, the train set fills a global batch)
    5. what builds the model on the meta device: the strategy's fit, the warm-start weights, the
       freeze and param_groups patterns (these import torch, for the configs that need them only)

The cheap checks come first: a typo or an impossible split is refused before any data is read.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from pimm.checkpoint.hub import is_hub_path
from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
from pimm.config.paths import config_roots
from pimm.config.validate import check_config
from pimm.errors import ConfigError, LaunchError
from pimm.launch.plan import LaunchPlan, check_data, make_plan, run_directory
from pimm.launch.resume import resume_run
from pimm.launch.slurm import SlurmStep


def prepare_launch(args: argparse.Namespace, scheduled: bool = False) -> LaunchPlan:
    """Check everything that can be checked before a process starts, in one order, each check by the
    module that owns it, and return the LaunchPlan: the config (for --train.resume the run's own, with
    what the resume changes and whether the run already completed: pimm.launch.resume), the
    resources and rendezvous, the batch plan (pimm.launch.plan), the data (pimm.data), and last what
    builds the model on the meta device: the strategy's fit, the warm-start weights, the parameter
    patterns. scheduled: for `pimm submit`, whose rendezvous is decided in the job (pimm.launch.slurm_job)."""
    config_name, config_path, cfg, run_dir = _resumed_run(args, scheduled) if args.resume else _new_run(args, scheduled)
    if cfg.get("validate_only") and not (args.weight or (cfg.get("pretrained") or {}).get("path")):
        raise LaunchError("validate_only=true evaluates given weights and trains nothing: pass --train.weight PATH "
                          "or set pretrained.path (weights.pth, model_best.pth, a checkpoint or export directory)")
    rdzv_id = _rendezvous(args, scheduled)
    plan = make_plan(
        config_name, config_path, cfg, args.nproc_per_node, args.nnodes, run_dir,
        rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank,
        max_restarts=args.max_restarts, overrides=args.overrides,
        resume=bool(args.resume), weight=_weight_path(args.weight),
        gpus=getattr(args, "gpus", None), rdzv_id=rdzv_id,
    )
    plan.data = check_data(cfg, plan.batches.global_batch_size)
    _check_model_fit(cfg, args.weight or (None if args.resume else (cfg.get("pretrained") or {}).get("path")))
    return plan


def _new_run(args: argparse.Namespace, scheduled: bool) -> tuple[str, Path, dict, Path]:
    """(config name, config path, resolved and checked config, run directory) of a new run."""
    if not args.config:
        raise LaunchError("--train.config is required (a config name such as demo/semseg, or a .py path)")
    config_path = resolve_config_path(args.config, config_roots())
    cfg = apply_overrides(load_config(config_path), parse_overrides(args.overrides))
    check_config(cfg)
    config_name = args.config.removesuffix(".py")
    args.nproc_per_node = args.nproc_per_node or "1"
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    args.max_restarts = 0 if args.max_restarts is None else args.max_restarts
    step = getattr(args, "slurm_step", None)
    if not scheduled and step is None and args.nnodes > 1:
        step = args.slurm_step = SlurmStep.from_env()
    if args.nnodes > 1 and step is None and args.timestamp and args.rdzv_endpoint and not scheduled:
        raise LaunchError(
            f"--resources.nnodes {args.nnodes} outside Slurm: every node must name the same run directory; "
            "pass the same --run.name NAME --run.no-timestamp on every node (or run under Slurm: pimm submit)"
        )
    run_dir = run_directory(args.exp_root, config_name, args.run_name, args.timestamp,
                            job_tag=step.tag if step else None)
    return config_name, config_path, cfg, run_dir


def _resumed_run(args: argparse.Namespace, scheduled: bool) -> tuple[str, Path, dict, Path]:
    """(config name, config path, config, run directory) of the run --train.resume continues, with
    the launch's resources defaulting to the run's own; exits 0 (SystemExit) when the run already
    trained everything its config asks for."""
    if args.resume is True and not args.config:
        raise LaunchError("--train.resume needs the run: --train.resume RUN_DIR, or --train.config with --run.name")
    run_dir = (run_directory(args.exp_root, args.config.removesuffix(".py"), args.run_name, False)
               if args.resume is True else Path(args.resume))
    state = resume_run(run_dir, args.overrides, f"pimm submit --site {args.site}" if scheduled else "pimm launch")
    saved, config_name = state.saved, state.saved.config_name
    args.resume_changes = state.changes
    if state.completed is not None:  # before anything is written or locked: nothing to do
        print(state.completed, flush=True)
        raise SystemExit(0)
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
    changes = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in state.changes.items()) or "none"
    print(f"pimm: resuming {run_dir} with its own config ({run_dir / 'config.py'}; a config file edited since "
          f"is not read) and {args.nproc_per_node} process(es) per node; config changes: {changes}", flush=True)
    return config_name, Path(saved.launch.get("config_path") or run_dir / "config.py"), state.cfg, run_dir


def _rendezvous(args: argparse.Namespace, scheduled: bool) -> str | None:
    """The rendezvous of a multi-node launch (args.rdzv_endpoint, args.slurm_step) and its id: from
    the Slurm step inside an allocation, placeholders that the job fills in under `pimm submit`."""
    step = getattr(args, "slurm_step", None)
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
    return rdzv_id


def _check_model_fit(cfg: dict, weight: str | None) -> None:
    """What needs the model (built on the meta device, so torch is imported for these configs only):
    FSDP2's wrap classes, the warm-start weights (said on one line), the freeze and param_groups patterns."""
    if (cfg.get("backends") or {}).get("sparse_conv") == "spconv" and importlib.util.find_spec("spconv") is None:
        raise ConfigError("backends.sparse_conv='spconv' but spconv is not installed here: pip install spconv-cu126 "
                          "(the build for your CUDA), or use 'torch' (pure PyTorch) or 'auto'")
    if (cfg.get("parallel") or {}).get("strategy") == "fsdp2":
        from pimm.distributed.strategy import check_strategy_fits  # deferred: imports torch; FSDP2 runs only

        check_strategy_fits(cfg)
    if weight:
        from pimm.checkpoint.weights import check_pretrained_fits  # deferred: imports torch; warm starts only

        print(f"pimm: warm start from {check_pretrained_fits(weight, cfg['model'], cfg.get('pretrained')).summary()}",
              flush=True)
    if cfg.get("freeze") or cfg.get("param_groups"):
        from pimm.engine.optim import check_parameter_patterns  # deferred: imports torch; these configs only

        check_parameter_patterns(cfg)


def _weight_path(weight: str | None) -> str | None:
    """--train.weight as the ranks get it: an absolute path, or an hf:// address as it is."""
    if not weight:
        return None
    return weight if is_hub_path(weight) else str(Path(weight).resolve())
