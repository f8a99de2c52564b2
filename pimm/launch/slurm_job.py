"""What a `pimm submit` batch script runs: `python -m pimm.launch.slurm_job begin|node|end`.

- `begin` (batch host, before the training step): decides whether this job of the chain runs.
  It does not when the run already finished (exit 3: the job ends with 0 and writes nothing in
  the run directory but Slurm's own log) or when the previous job of the same submission made no
  checkpoint progress (exit 78, and the rest of the chain is cancelled): a run that crashes before
  its first checkpoint is not requeued forever.
- `node` (one per node, under srun): node 0 takes the run lock, decides resume (a complete
  checkpoint exists) and announces the launch; every node then runs torchrun with the
  rendezvous of this job (pimm.launch.slurm) and exits with pimm's status (0, 75, 76, 1, 2).
- `end` (batch host): records how the job ended and says what happens next.

The chain's record is `<run>/slurm/chain.json`; only the batch host of the one running job of a
chain writes it (the jobs of a chain never overlap: afterany).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pimm.config import read_run_config
from pimm.errors import EXIT_BAD_INPUT, EXIT_CHAIN_STOPPED, EXIT_CHECKPOINTED, PimmError
from pimm.files import write_atomic
from pimm.launch import node as agent
from pimm.launch.plan import plan_from_run
from pimm.launch.resume import completed_run, newest_step
from pimm.launch.run_lock import RunLock
from pimm.launch.sbatch import NOTHING_TO_DO
from pimm.launch.slurm import SlurmStep

CHAIN_FILE = "slurm/chain.json"


# -- the chain record --------------------------------------------------------------------------

def load_chain(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / CHAIN_FILE).read_text())
    except (OSError, ValueError):
        return {"submissions": {}}


def store_chain(run_dir: Path, chain: dict) -> None:
    path = run_dir / CHAIN_FILE
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, json.dumps(chain, indent=2))


def record_submission(run_dir: Path, submission: str, jobs: list[int], **facts) -> None:
    chain = load_chain(run_dir)
    chain["submissions"][submission] = {"jobs": jobs, "links": [], **facts}
    store_chain(run_dir, chain)


def queued_jobs(run_dir: Path) -> list[int]:
    """Jobs of earlier submissions of this run that Slurm still has pending or running."""
    known = [j for sub in load_chain(run_dir)["submissions"].values() for j in sub.get("jobs", [])]
    if not known:
        return []
    done = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(map(str, known))], check=False,
                          capture_output=True, text=True, timeout=60)
    return sorted(int(x) for x in done.stdout.split() if x.isdigit())


def _completed(run_dir: Path) -> bool:
    """The run already trained every step of its config.py (the rules of `--train.resume`)."""
    try:
        return completed_run(run_dir, read_run_config(run_dir / "config.py")) is not None
    except PimmError:
        return False


def _cancel_rest(submission: dict, job_id: int) -> list[int]:
    jobs = submission.get("jobs", [])
    rest = jobs[jobs.index(job_id) + 1:] if job_id in jobs else []
    if rest:
        subprocess.run(["scancel", *map(str, rest)], check=False, capture_output=True, timeout=60)
    return rest


def begin(run_dir: Path, submission_id: str) -> int:
    job_id = int(os.environ.get("SLURM_JOB_ID", 0))
    chain = load_chain(run_dir)
    submission = chain["submissions"].setdefault(submission_id, {"jobs": [], "links": []})
    links = submission["links"]
    step = newest_step(run_dir)
    where = f"step {step}" if step is not None else "no checkpoint yet"
    link = {"job_id": job_id, "start_step": step, "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "nodes": os.environ.get("SLURM_JOB_NODELIST")}
    number = f"job {len(links) + 1} of {len(submission['jobs']) or '?'}"
    if _completed(run_dir):  # also for the first job of a submission: nothing in the run is written
        rest = _cancel_rest(submission, job_id)
        print(f"pimm: chain {number}: the run {run_dir} has finished ({where}); nothing to do, nothing changed"
              + (f"; cancelled the rest of the chain: {' '.join(map(str, rest))}" if rest else ""), flush=True)
        return NOTHING_TO_DO
    if links and links[-1]["start_step"] == step:
        rest = _cancel_rest(submission, job_id)
        links.append({**link, "refused": "no checkpoint progress"})
        store_chain(run_dir, chain)
        print(f"pimm: chain {number}: job {links[-2]['job_id']} made no checkpoint progress (the newest complete "
              f"checkpoint is still at {where}); ending the chain instead of repeating it"
              + (f" (cancelled {' '.join(map(str, rest))})" if rest else "")
              + f". Read {run_dir / 'slurm_logs'} and {run_dir / 'logs'}, fix the cause, then "
              f"`pimm submit --train.resume {run_dir} ...`", flush=True)
        return EXIT_CHAIN_STOPPED
    links.append(link)
    store_chain(run_dir, chain)
    print(f"pimm: chain {number}: Slurm job {job_id} on {link['nodes']}: "
          + (f"resumes {run_dir} from {where}" if step is not None else f"starts {run_dir}"), flush=True)
    return 0


def end(run_dir: Path, submission_id: str, status: int) -> int:
    chain = load_chain(run_dir)
    submission = chain["submissions"].get(submission_id, {"jobs": [], "links": []})
    job_id = int(os.environ.get("SLURM_JOB_ID", 0))
    step = newest_step(run_dir)
    for link in submission["links"]:
        if link["job_id"] == job_id:
            link.update(end_step=step, status=status, end_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    store_chain(run_dir, chain)
    jobs = submission["jobs"]
    later = jobs[jobs.index(job_id) + 1:] if job_id in jobs else []
    if status == 0:
        what = "training finished"
    elif status == EXIT_CHECKPOINTED:
        what = (f"checkpointed at step {step} on a stop signal; " + (
            f"job {later[0]} resumes it" if later else
            f"no job left in the chain: continue with `pimm submit --train.resume {run_dir} ...`"))
    elif status == EXIT_BAD_INPUT:
        what = "refused before training (bad input or the run is in use)"
    else:
        what = f"failed; see {run_dir / 'errors'} and {run_dir / 'logs'}"
    print(f"pimm: Slurm job {job_id} ended with exit status {status}: {what}", flush=True)
    return status


# -- one node of the training step -------------------------------------------------------------

def node(run_dir: Path) -> int:
    step = SlurmStep.from_env()
    if step is None or step.step_id is None:
        raise PimmError("pimm.launch.slurm_job node runs inside `srun` of a job that `pimm submit` queued")
    launch = json.loads((run_dir / "launch.json").read_text())
    step.check_one_task_per_node(int(launch["nnodes"]))
    endpoint = step.rendezvous_endpoint()
    if step.node_id > 0:
        facts = agent.wait_for_announcement(run_dir, step.tag)
        plan = plan_from_run(run_dir, endpoint, step.tag, resume=bool(facts["resume"]))
        return agent.train_on_this_node(plan, None, step.node_id)
    try:
        lock = RunLock(run_dir).acquire()
    except PimmError as exc:
        agent.announce_refusal(run_dir, step.tag, str(exc))
        raise
    try:
        resume = newest_step(run_dir) is not None
        plan = plan_from_run(run_dir, endpoint, step.tag, resume=resume)
    except PimmError as exc:
        agent.announce_refusal(run_dir, step.tag, str(exc))
        lock.release()
        raise
    try:
        print(plan.describe(), flush=True)
        agent.announce(run_dir, step.tag, resume=resume)
        return agent.train_on_this_node(plan, lock.fd)
    finally:
        lock.release()
        agent.withdraw(run_dir, step.tag)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pimm.launch.slurm_job")
    parser.add_argument("phase", choices=("begin", "node", "end"))
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--submission", default="")
    parser.add_argument("--status", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.phase == "begin":
            return begin(args.run_dir, args.submission)
        if args.phase == "end":
            return end(args.run_dir, args.submission, args.status)
        return node(args.run_dir)
    except PimmError as exc:
        print(f"pimm: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
