"""`pimm submit`: render a launch plan as a Slurm batch script for a site, and queue it.

The run directory, resolved config and launch description are written here, once, on the
submitting host; every node of every job of the chain reads them (pimm.launch.slurm_job).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path

from pimm.errors import LaunchError
from pimm.launch.run_dir import open_run_dir, write_launch_record
from pimm.launch.sbatch import chain_commands, log_pattern, render_job_script, submit_chain
from pimm.launch.sites import check_one_line, flag_for, known_sites, load_site

SITE_FLAGS = {  # --resources.<flag> -> site field
    "nnodes": int, "nproc_per_node": int, "cpus_per_proc": int, "time": str, "mem": str, "account": str,
    "partition": str, "qos": str, "constraint": str, "signal_delay_s": int,
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "submit",
        help="train a config under Slurm: render a batch script from a site profile and sbatch it",
        description="Render the launch as an sbatch script (one pimm per node, torchrun starting the processes) "
        "for a site profile and queue it, optionally as a chain of jobs that resume one another. Everything after "
        "a bare `--` is a key=value config override, as for `pimm launch`.",
        usage="pimm submit --site NAME_OR_YAML --train.config NAME_OR_PATH [options] [-- key=value ...]",
    )
    p.add_argument("--site", required=True, metavar="NAME_OR_YAML",
                   help=f"a site profile ({', '.join(known_sites())}) or the path of your own YAML "
                   "(`_base_: slurm` and what your cluster needs)")
    for name, kind in SITE_FLAGS.items():
        flag = "--resources." + name.replace("_", "-")
        p.add_argument(flag, dest=f"site_{name}", type=kind, metavar=name.upper(),
                       help=f"override the site's {name}" + (" (Slurm time: M, H:M:S, D-H:M ...)" if name == "time"
                                                              else ""))
    p.add_argument("--resources.max-restarts", dest="max_restarts", type=int, metavar="K",
                   help="torchrun restarts of the worker group after a failure, within one job (default 0)")
    p.add_argument("--train.config", dest="config", metavar="NAME_OR_PATH",
                   help="config name under configs/ or a .py path; required unless --train.resume names a run")
    p.add_argument("--run.name", dest="run_name", metavar="NAME", help="run name (default: the config's name)")
    p.add_argument("--run.timestamp", dest="timestamp", action="store_true", default=True,
                   help="append -YYYYmmdd-HHMMSS to the run name (the default)")
    p.add_argument("--run.no-timestamp", dest="timestamp", action="store_false", help="use the run name as it is")
    p.add_argument("--paths.exp-root", dest="exp_root", type=Path, default=Path("exp"), metavar="DIR",
                   help="root of all run directories, on a filesystem every node shares (default ./exp)")
    p.add_argument("--train.resume", dest="resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue a run from its newest complete checkpoint (as for pimm launch)")
    p.add_argument("--train.weight", dest="weight", metavar="PATH", help="start a new run from these weights only")
    p.add_argument("--chain.jobs", dest="chain_jobs", type=int, default=1, metavar="N",
                   help="queue N jobs, each starting when the previous one ends and resuming its checkpoint "
                   "(for runs longer than the site's time limit; default 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the batch script and the sbatch commands; create nothing, queue nothing")
    p.add_argument("--output", type=Path, metavar="PATH",
                   help="write the batch script to PATH and prepare the run directory, but queue nothing "
                   "(submit it yourself with sbatch PATH)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pimm.launch.preflight import prepare_launch  # deferred: numpy and h5py (the data checks), not for --help

    if args.chain_jobs < 1:
        raise LaunchError(f"--chain.jobs must be >= 1, got {args.chain_jobs}")
    # the flags whose values reach the batch script, checked by their names (render_job_script checks again)
    given = [(flag_for(name), getattr(args, f"site_{name}")) for name, kind in SITE_FLAGS.items() if kind is str]
    given += [("--site", args.site), ("--run.name", args.run_name), ("--train.config", args.config),
              ("--paths.exp-root", str(args.exp_root)), ("--train.resume", args.resume)]
    for flag, value in given:
        if isinstance(value, str):
            check_one_line(value, flag)
    site = load_site(args.site, {name: getattr(args, f"site_{name}") for name in SITE_FLAGS})
    if site.scheduler != "slurm":
        raise LaunchError(f"site {site.name!r} does not use Slurm (scheduler: {site.scheduler}); run it with "
                          "`pimm launch`, or pick a Slurm site")
    # the resources are the site's (the allocation is new), not those of an earlier launch
    args.nnodes, args.nproc_per_node = site.nnodes, str(site.nproc_per_node)
    args.gpus = site.nproc_per_node if site.uses_gpus else 0
    args.rdzv_endpoint = args.node_rank = None
    args.max_restarts = args.max_restarts or 0
    plan = prepare_launch(args, scheduled=True)  # the data too
    submission = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    script_path = plan.run_dir.absolute() / "slurm" / f"submit-{submission}.sbatch"
    script = render_job_script(plan, site, submission, Path.cwd())
    if args.dry_run:
        print(script)
        print("sbatch commands:")
        print("\n".join("  " + c for c in chain_commands(script_path, args.chain_jobs)))
        print(f"world size {plan.world_size} ({site.nnodes} node(s) x {plan.nproc_per_node}); logs would go to "
              f"{log_pattern(plan.run_dir.absolute())}")
        print("dry run: nothing created, nothing queued.")
        return 0
    # the machine last: a mistake in the config or flags is reported first, on any machine
    if not args.output and shutil.which("sbatch") is None:
        raise LaunchError("sbatch is not on PATH: run pimm submit on a Slurm login node; --dry-run prints the "
                          "script and --output PATH writes it without one")
    if plan.resume:
        _refuse_if_queued(plan.run_dir)
    return _write_and_queue(args, plan, site, submission, script, script_path)


def _refuse_if_queued(run_dir: Path) -> None:
    from pimm.launch.slurm_job import queued_jobs  # deferred: numpy and h5py behind it, not for --help

    if shutil.which("squeue") and (jobs := queued_jobs(run_dir)):
        ids = " ".join(map(str, jobs))
        raise LaunchError(f"run {run_dir} still has Slurm jobs pending or running: {ids}. One run has one writer: "
                          f"wait for them, or cancel them (scancel {ids}) and submit again")


def _write_and_queue(args, plan, site, submission: str, script: str, script_path: Path) -> int:
    from pimm.launch.slurm_job import record_submission  # deferred: numpy and h5py behind it, not for --help

    run_dir = plan.run_dir.absolute()
    lock = open_run_dir(plan)
    try:
        write_launch_record(plan, getattr(args, "resume_changes", None), scheduler="slurm", site=site.name,
                            site_source=str(site.source), submission=submission, chain_jobs=args.chain_jobs)
        (run_dir / "slurm_logs").mkdir(exist_ok=True)
        script_path.parent.mkdir(exist_ok=True)
        script_path.write_text(script)
        if args.output:
            args.output.write_text(script)
            print(f"pimm: wrote {args.output} for run {run_dir}; queue it with: sbatch {shlex.quote(str(args.output))}"
                  + (f" (then, for a chain, sbatch --dependency=afterany:<previous job id> ... {args.chain_jobs - 1} "
                     "more time(s))" if args.chain_jobs > 1 else ""))
            return 0
        try:
            jobs = submit_chain(script_path, args.chain_jobs,
                                lambda ids: record_submission(run_dir, submission, ids, site=site.name,
                                                              script=str(script_path)))
        except BaseException:
            if not plan.resume:  # nothing ran in it: a failed submission leaves no half-made run behind
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
    finally:
        lock.release()
    logs = str(log_pattern(run_dir)).replace("%j", "<job id>")
    print(f"pimm: queued Slurm job(s) {' '.join(map(str, jobs))} "
          f"({'a chain: each starts when the previous ends' if len(jobs) > 1 else 'one job'})")
    print(f"  run directory  {run_dir}")
    print(f"  batch script   {script_path}")
    print(f"  Slurm logs     {logs}")
    print(f"  rank logs      {run_dir / 'logs'}/rank*.log")
    print(f"  follow         tail -f {str(log_pattern(run_dir)).replace('%j', str(jobs[0]))}")
    print(f"  cancel         scancel {' '.join(map(str, jobs))}")
    sys.stdout.flush()
    return 0
