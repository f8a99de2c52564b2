"""The Slurm rendering of a launch plan: one batch script per submission, and the sbatch calls
that queue it (a chain of N jobs, each waiting for the previous one to end however it ended).

The script starts one pimm node agent per node (`srun --ntasks-per-node=1`); each agent runs
torchrun for its node's processes (pimm.launch.slurm_job). Before and after that step, a short
check on the batch host keeps the chain honest (resume, nothing left to do, no progress).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pimm
from pimm.errors import LaunchError
from pimm.launch.sites import check_one_line

NOTHING_TO_DO = 3  # `slurm_job begin`: the run already finished; the job ends with 0


def log_pattern(run_dir: Path) -> Path:
    return run_dir / "slurm_logs" / "slurm-%j.out"


def render_job_script(plan, site, submission: str, workdir: Path) -> str:
    """The batch script for `plan` on `site`; every path absolute (the job starts elsewhere).
    LaunchError when a value holds a control character (see check_one_line)."""
    run_dir = plan.run_dir.absolute()
    python = site.python or sys.executable
    for what, value in (("the run directory", str(run_dir)), ("the config name", plan.config_name),
                        ("the python", python), ("the submission", submission)):
        check_one_line(value, what)

    def pimm_job(*args: str) -> str:
        return shlex.join(site.wrap([python, "-m", "pimm.launch.slurm_job", *args]))

    srun = ["srun", "--nodes", str(site.nnodes), "--ntasks-per-node=1",
            f"--cpus-per-task={site.cpus_per_proc * site.nproc_per_node}"]
    lines = [
        "#!/bin/bash",
        f"# pimm submit: run {run_dir} (config {plan.config_name}), site {site.name} ({site.source}),",
        f"# submission {submission}; rendered by pimm {pimm.__version__}.",
        f"# One pimm per node; its torchrun starts {plan.nproc_per_node} process(es) per node: world size "
        f"{plan.world_size}, global batch {plan.batches.global_batch_size}.",
        *job_prologue(site, run_dir.name, str(log_pattern(run_dir)), workdir),
        "# resume, or end the chain when the run finished or the previous job made no progress",
        pimm_job("begin", "--run-dir", str(run_dir), "--submission", submission),
        "status=$?",
        'if [ "$status" -eq 0 ]; then',
        "    # the rendezvous: the first node of the job, port from the job id (pimm.launch.slurm)",
        "    " + shlex.join(srun) + " " + pimm_job("node", "--run-dir", str(run_dir)),
        "    status=$?",
        "    " + pimm_job("end", "--run-dir", str(run_dir), "--submission", submission, "--status") + ' "$status"',
        f'elif [ "$status" -eq {NOTHING_TO_DO} ]; then',
        "    status=0",
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def job_prologue(site, job_name: str, output: str, workdir: Path, time_limit_signal: bool = True) -> list[str]:
    """What every pimm batch script starts with: the site's #SBATCH lines (without the time-limit
    signal if asked), its setup lines and exports, and the submitting directory. Every value that
    goes into the script is checked here first: one line each, no control character."""
    for what, value in (("the job name", job_name), ("the log path", output),
                        ("the working directory", str(workdir.absolute())),
                        *((f"site {site.name!r}: {key}", text) for key, text in site.script_values())):
        check_one_line(value, what)
    directives = site.sbatch_directives(job_name=job_name, output=output)
    if not time_limit_signal:
        directives = [d for d in directives if not d.startswith("#SBATCH --signal=")]
    return [*directives, "", *site.preamble(), "set -u", f"cd {shlex.quote(str(workdir.absolute()))}",
            "export PYTHONUNBUFFERED=1", ""]


def chain_commands(script: Path, jobs: int) -> list[str]:
    """The sbatch calls a chain of `jobs` makes (for display: the ids are known only when queued)."""
    commands = [f"sbatch --parsable --hold {shlex.quote(str(script))}"]
    commands += [f"sbatch --parsable --hold --dependency=afterany:<job {k}> {shlex.quote(str(script))}"
                 for k in range(1, jobs)]
    return [*commands, "scontrol release <job ids>"]


def submit_chain(script: Path, jobs: int, on_queued) -> list[int]:
    """Queue `jobs` jobs of `script`, each after the previous one ends (afterany). They are held
    until on_queued(ids) has recorded the chain, so the first job never starts before the record
    exists; if anything fails, the jobs already queued are cancelled."""
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch is not on PATH: pimm submit needs a Slurm login node (or --dry-run to see "
                          "the script, --output PATH to write it)")
    ids: list[int] = []
    try:
        for _ in range(jobs):
            dependency = [f"--dependency=afterany:{ids[-1]}"] if ids else []
            ids.append(_sbatch(["sbatch", "--parsable", "--hold", *dependency, str(script)]))
        on_queued(ids)
        _run(["scontrol", "release", ",".join(map(str, ids))])
    except BaseException:
        if ids:
            subprocess.run(["scancel", *map(str, ids)], check=False, capture_output=True)
        raise
    return ids


def queue(script: Path) -> int:
    """sbatch one script now; its job id."""
    return _sbatch(["sbatch", "--parsable", str(script)])


def _sbatch(argv: list[str]) -> int:
    out = _run(argv)
    match = re.match(r"\s*(\d+)", out)  # --parsable: "<id>" or "<id>;<cluster>"
    if not match:
        raise LaunchError(f"`{shlex.join(argv)}` printed no job id: {out.strip()!r}")
    return int(match.group(1))


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise LaunchError(f"`{shlex.join(argv)}` failed (exit status {done.returncode}): "
                          f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout
