"""`pimm validate-scaling`: the pre-flight scaling checklist as one command with a report.

The input is checked here, before any process starts (exit 2); the runs, the checks and the
report are in pimm.validate. Exit 0 when every check passes, 1 when one fails.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
from pathlib import Path

from pimm.cli.bench import _count, parse_ranks, resolve
from pimm.config import parse_overrides
from pimm.errors import EXIT_FAILED, ConfigError, LaunchError
from pimm.launch.sbatch import job_prologue, queue
from pimm.launch.sites import load_site


def add_parser(sub) -> None:
    p = sub.add_parser(
        "validate-scaling",
        help="run the scaling checklist (1 vs N ranks, finite loss, parameters, eval, interrupt/resume) with a report",
        description="Before a long job: train the same tiny run (global batch and seed fixed) at every rank count "
        "and check finite losses, identical batches, agreeing losses, parameter counts and replicas, evaluation "
        "metrics, one complete checkpoint, an interrupt (SIGUSR1 to the whole job, loader workers on) resumed on "
        "the same topology and at another rank count. Every run is a real `pimm launch` under --out/runs; "
        "report.md, report.json and loss_curves.png go to --out. Stages 3-5 run only when the checks before them "
        "passed. Everything after a bare `--` is a key=value config override for every run.",
        usage="pimm validate-scaling --train.config NAME_OR_PATH [--ranks 1,2] [--steps K] [--strategy ddp|fsdp2] "
        "[--out DIR] [-- key=value ...]",
    )
    p.add_argument("--train.config", dest="config", required=True, metavar="NAME_OR_PATH",
                   help="config name under configs/ (e.g. tests/tiny_semseg) or a path to a .py config")
    p.add_argument("--ranks", default="1,2", metavar="N,N,...",
                   help="comma-separated world sizes, at least two (default 1,2)")
    p.add_argument("--steps", default="10", metavar="K", help="optimizer steps per run (default 10, at least 4)")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp2"),
                   help="parallel.strategy of the multi-rank runs (default ddp)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for the report and the runs; must not hold a report yet "
                   "(default exp/validate_scaling/<config name>-YYYYmmdd-HHMMSS)")
    p.add_argument("--timeout", default="900", metavar="SECONDS", help="seconds before one run is killed (default 900)")
    p.add_argument("--site", metavar="NAME_OR_YAML",
                   help="run the checklist as one Slurm job on one node of this site (as for pimm submit); the "
                   "report lands in --out, which must be on a filesystem the node shares")
    for name in ("time", "account", "partition", "qos"):
        p.add_argument(f"--resources.{name}", dest=f"site_{name}", metavar=name.upper(),
                       help=f"with --site: override the site's {name}")
    p.set_defaults(run=run)


def prepare(config: str, ranks: list[int], steps: int, strategy: str, out: Path, overrides: list[str],
            timeout_s: float):
    """Resolve and check everything before any process starts -> pimm.validate.scaling.Spec;
    ConfigError/LaunchError (exit 2) for anything a run would refuse or the checklist cannot use."""
    # deferred: the data checks and the checklist import h5py and numpy, which `pimm --help` does without
    from pimm.launch.plan import check_data
    from pimm.validate.scaling import CONTROLLED, INTERRUPT_AT_STEP, MIN_STEPS, Spec, run_overrides

    if len(ranks) < 2:
        raise LaunchError(f"--ranks needs at least two rank counts to compare (e.g. 1,2), got {ranks}")
    if steps < MIN_STEPS:
        raise LaunchError(f"--steps must be >= {MIN_STEPS}: check 4 signals the run at step {INTERRUPT_AT_STEP} "
                          f"and it stops a step or two later; got {steps}")
    keys = [key for key, _ in parse_overrides(overrides)]
    for key in keys:
        if key in CONTROLLED:
            instead = f"use {CONTROLLED[key]}" if CONTROLLED[key] else "every run sets it itself"
            raise ConfigError(f"override {key}=... is not accepted by validate-scaling: {instead}")
    if out.exists() and not out.is_dir():
        raise LaunchError(f"--out {out} exists and is not a folder; name a folder for the report")
    if any((out / name).exists() for name in ("report.json", "report.md", "runs")):
        raise LaunchError(f"--out {out} already holds a validation report or its runs; pick another --out "
                          "(or remove that folder)")
    every_run = run_overrides(overrides, keys, ranks, steps, strategy)
    cfg = resolve(config, every_run, ranks, [strategy])  # the batch split at every rank count, FSDP2's fit
    if int(cfg.get("num_worker") or 0) < max(ranks):
        raise ConfigError(f"num_worker={cfg.get('num_worker')} leaves ranks without loader workers at {max(ranks)} "
                          f"ranks; check 4 signals a job with loader workers: use num_worker >= {max(ranks)} or "
                          "leave it out (validate-scaling then uses 2 per rank)")
    if not cfg["data"].get("val"):
        raise ConfigError("check 3 evaluates on the validation set: set data.val (e.g. -- data.val.path=...)")
    global_batch = int(cfg["batch_size"])
    train = check_data(cfg, global_batch)["train"]
    max_len = cfg["data"]["train"].get("max_len")
    events = min(train["num_events"], max_len) if max_len else train["num_events"]
    expected = min(steps, events // global_batch * int(cfg["epochs"]))
    if expected < MIN_STEPS:
        raise ConfigError(f"the config trains only {expected} steps ({events} events, batch_size {global_batch}, "
                          f"epochs {cfg['epochs']}); validate-scaling needs {MIN_STEPS}: raise epochs")
    return Spec(config, cfg, ranks, expected, strategy, out, list(overrides), every_run, timeout_s, global_batch)


def run(args: argparse.Namespace) -> int:
    from pimm.validate.scaling import FAIL, validate_scaling  # deferred: as in prepare()

    ranks = parse_ranks(args.ranks)
    steps = _count("--steps", args.steps, 1)
    timeout = _count("--timeout", args.timeout, 1)
    out = args.out or Path("exp/validate_scaling") / (
        f"{Path(args.config.removesuffix('.py')).name}-{time.strftime('%Y%m%d-%H%M%S')}")
    spec = prepare(args.config, ranks, steps, args.strategy, out.absolute(), args.overrides, timeout)
    if args.site:
        return _submit(args, spec, ranks, steps, timeout)
    report = validate_scaling(spec)
    print(f"\npimm validate-scaling: {report['verdict']} ({out / 'report.md'})")
    for check in report["checks"]:
        print(f"  {check['id']} {check['status']:4}  {check['title']}")
    failed = [c for c in report["checks"] if c["status"] == FAIL]
    for check in failed:
        print(f"pimm: check {check['id']} failed: {check['reason']}", file=sys.stderr)
    return EXIT_FAILED if failed else 0


def _submit(args: argparse.Namespace, spec, ranks: list[int], steps: int, timeout: float) -> int:
    """The checklist as one batch job on one node: the same command, run there, writing to --out."""
    site = load_site(args.site, {"nnodes": 1, "nproc_per_node": max(ranks),
                                 **{k: getattr(args, f"site_{k}") for k in ("time", "account", "partition", "qos")}})
    if site.scheduler != "slurm":
        raise LaunchError(f"site {site.name!r} does not use Slurm; run validate-scaling without --site")
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch is not on PATH: run this on a Slurm login node, or without --site")
    out = spec.out
    command = site.wrap([site.python or sys.executable, "-m", "pimm", "validate-scaling", "--train.config",
                         args.config, "--ranks", ",".join(map(str, ranks)), "--steps", str(steps), "--strategy",
                         args.strategy, "--out", str(out), "--timeout", str(int(timeout)), "--", *args.overrides])
    # no time-limit signal: the checklist signals its own runs, and USR1 would end its driver
    prologue = job_prologue(site, f"validate-{out.name}", str(out / "slurm-%j.out"), Path.cwd(),
                            time_limit_signal=False)
    script = "\n".join(["#!/bin/bash", f"# pimm validate-scaling on site {site.name}: report in {out}", *prologue,
                        f"exec {shlex.join(command)}", ""])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "validate-scaling.sbatch"
    path.write_text(script)
    job = queue(path)
    print(f"pimm: queued Slurm job {job}: validate-scaling of {args.config} at ranks {','.join(map(str, ranks))} "
          f"on one node of {site.name}")
    print(f"  report     {out / 'report.md'} (and report.json, loss_curves.png)")
    print(f"  job log    {out / f'slurm-{job}.out'}")
    print("  the job's exit status is the command's: 0 every check passed, 1 one failed")
    return 0
