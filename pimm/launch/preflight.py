"""The pre-flight of `pimm launch` and `pimm submit`: everything that can be checked before a
process starts, in one order, each check by the module that owns it and called from here alone,
ending in the LaunchPlan.

    1. the config: a config file, or for --train.resume the run's own (pimm.launch.resume reads the
       run's records), with the overrides, checked (pimm.config.validate)
    2. a resume: the pre-flight measures what it compares (the train set's events, pimm.launch.plan;
       the two models' parameters, pimm.models) and pimm.launch.resume decides: what changed, what
       it refuses, whether the run already completed
    3. the resources and the rendezvous (Slurm step, endpoint, node rank)
    4. the batch plan (pimm.launch.plan: processes against the machine, pimm.distributed.batch)
    5. the data (pimm.launch.plan.check_data: each split valid, the train set fills a global batch)
    6. what builds the model on the meta device: the freeze and param_groups patterns, the
       strategy's fit, the warm-start weights (these import torch, for the configs that need them only)

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
from pimm.errors import ConfigError, LaunchError, PimmError
from pimm.launch.plan import LaunchPlan, check_data, check_split, make_plan, run_directory
from pimm.launch.resume import SavedRun, TrainSet, load_saved_run, resume_run
from pimm.launch.slurm import SlurmStep


def prepare_launch(args: argparse.Namespace, scheduled: bool = False) -> LaunchPlan:
    """Check everything that can be checked before a process starts, in the order above, and return
    the LaunchPlan. For --train.resume the launch's resources default to the run's own, and a run
    that already trained everything its config asks for exits 0 (SystemExit) before anything is
    written. scheduled: for `pimm submit`, whose rendezvous is decided in the job (pimm.launch.slurm_job)."""
    weight = _weight_path(args.weight)
    source = _source(args)
    saved = load_saved_run(source) if args.resume else None
    cfg = apply_overrides(saved.cfg if saved else load_config(source), parse_overrides(args.overrides))
    check_config(cfg)
    if saved is None:
        config_name, config_path, run_dir, checked = (args.config.removesuffix(".py"), source,
                                                      _new_run_dir(args, scheduled), {})
    else:
        config_name, run_dir = saved.config_name, saved.run_dir
        config_path = Path(saved.launch.get("config_path") or run_dir / "config.py")
        checked = _continue(args, saved, cfg, scheduled)
    if cfg.get("validate_only") and not (args.weight or (cfg.get("pretrained") or {}).get("path")):
        raise LaunchError("validate_only=true evaluates given weights and trains nothing: pass --train.weight PATH "
                          "or set pretrained.path (weights.pth, model_best.pth, a checkpoint or export directory)")
    rdzv_id = _rendezvous(args, scheduled)
    plan = make_plan(
        config_name, config_path, cfg, args.nproc_per_node, args.nnodes, run_dir,
        rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank,
        max_restarts=args.max_restarts, overrides=args.overrides,
        resume=bool(args.resume), weight=weight,
        gpus=getattr(args, "gpus", None), rdzv_id=rdzv_id,
    )
    plan.data = check_data(cfg, plan.batches.global_batch_size, checked)
    _check_model_fit(cfg, args.weight or (None if args.resume else (cfg.get("pretrained") or {}).get("path")))
    return plan


def _source(args: argparse.Namespace) -> Path:
    """Where the launch's config comes from: the run directory that --train.resume continues, or
    the config file of a new run."""
    if args.resume is True and not args.config:
        raise LaunchError("--train.resume needs the run: --train.resume RUN_DIR, or --train.config with --run.name")
    if args.resume:
        return (run_directory(args.exp_root, args.config.removesuffix(".py"), args.run_name, False)
                if args.resume is True else Path(args.resume))
    if not args.config:
        raise LaunchError("--train.config is required (a config name such as demo/semseg, or a .py path)")
    return resolve_config_path(args.config, config_roots())


def _new_run_dir(args: argparse.Namespace, scheduled: bool) -> Path:
    """The run directory of a new run, with the launch's resources defaulted."""
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
    return run_directory(args.exp_root, args.config.removesuffix(".py"), args.run_name, args.timestamp,
                         job_tag=step.tag if step else None)


def _continue(args: argparse.Namespace, saved: SavedRun, cfg: dict, scheduled: bool) -> dict[str, dict]:
    """Measure what the resume of `saved` with `cfg` compares, let pimm.launch.resume decide, and
    default the launch's resources to the run's own; exits 0 (SystemExit) when the run already
    trained everything `cfg` asks for. Returns the splits checked here (the train set), for check_data."""
    model_changed = ((saved.cfg["model"], saved.cfg["data"].get("num_classes"))
                     != (cfg["model"], cfg["data"].get("num_classes")))
    mismatch = _parameter_mismatch(saved.cfg["model"], cfg["model"]) if model_changed else None
    train_then, train_now = _train_sets(saved.cfg, cfg)
    state = resume_run(saved, cfg, train_then, train_now, mismatch,
                       f"pimm submit --site {args.site}" if scheduled else "pimm launch")
    args.resume_changes = state.changes
    if state.completed is not None:  # before anything is written or locked: nothing to do
        print(state.completed, flush=True)
        raise SystemExit(0)
    run_dir = saved.run_dir
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
    return {"train": train_now.identity} if train_now.identity else {}


def _train_sets(saved_cfg: dict, cfg: dict) -> tuple[TrainSet, TrainSet]:
    """The train set of the run's config and of `cfg` (one check when both name the same data), each
    checked (pimm.launch.plan.check_split) or with the error that check raised: a resume raises it
    only where it needs the count (a run that completed is told so without it)."""
    checked: dict[str, TrainSet] = {}
    for which, config in (("now", cfg), ("then", saved_cfg)):
        if which == "then" and config["data"]["train"] == cfg["data"]["train"]:
            checked[which] = checked["now"]
            continue
        try:
            checked[which] = TrainSet(identity=check_split(config, "train"))
        except (PimmError, OSError, KeyError, TypeError, ValueError) as exc:
            checked[which] = TrainSet(error=exc)
    return checked["then"], checked["now"]


def _parameter_mismatch(old_model: dict, new_model: dict) -> str | None:
    """How the two models' parameters differ, in short; None when they match. (Builds both on the
    meta device: no memory, no weights.)"""
    import torch  # deferred: torch takes seconds to import; only a resume that changes the model needs it

    from pimm.models import build_model  # deferred: as above

    with torch.device("meta"):
        old = {k: tuple(v.shape) for k, v in build_model(old_model).state_dict().items()}
        new = {k: tuple(v.shape) for k, v in build_model(new_model).state_dict().items()}
    missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    reshaped = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    parts = []
    if reshaped:
        parts.append(f"{len(reshaped)} with a new shape, e.g. {reshaped[0]} {list(old[reshaped[0]])} -> "
                     f"{list(new[reshaped[0]])}")
    if missing:
        parts.append(f"{len(missing)} gone, e.g. {missing[0]}")
    if extra:
        parts.append(f"{len(extra)} new, e.g. {extra[0]}")
    return "; ".join(parts) or None


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
    the freeze and param_groups patterns, FSDP2's wrap classes, the warm-start weights (said on one line)."""
    if (cfg.get("backends") or {}).get("sparse_conv") == "spconv" and importlib.util.find_spec("spconv") is None:
        raise ConfigError("backends.sparse_conv='spconv' but spconv is not installed here: pip install spconv-cu126 "
                          "(the build for your CUDA), or use 'torch' (pure PyTorch) or 'auto'")
    if cfg.get("freeze") or cfg.get("param_groups"):
        from pimm.engine.optim import check_parameter_patterns  # deferred: imports torch; these configs only

        check_parameter_patterns(cfg)
    if (cfg.get("parallel") or {}).get("strategy") == "fsdp2":
        from pimm.distributed.strategy import check_strategy_fits  # deferred: imports torch; FSDP2 runs only

        check_strategy_fits(cfg)
    if weight:
        from pimm.checkpoint.weights import check_pretrained_fits  # deferred: imports torch; warm starts only

        print(f"pimm: warm start from {check_pretrained_fits(weight, cfg['model'], cfg.get('pretrained')).summary()}",
              flush=True)


def _weight_path(weight: str | None) -> str | None:
    """--train.weight as the ranks get it: an absolute path, or an hf:// address as it is."""
    if not weight:
        return None
    return weight if is_hub_path(weight) else str(Path(weight).resolve())
