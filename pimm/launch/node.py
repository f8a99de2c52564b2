"""One pimm per node: run torchrun for this node and report how the run ended.

In a multi-node run node 0 is the run's one writer: it creates or reopens the run directory,
takes the run lock, writes config.py and launch.json (or, under `pimm submit`, finds them
written on the submitting host) and then announces the launch in `<run>/.nodes/<tag>.json`. The
other nodes write nothing: they wait for that announcement (or for node 0's refusal) before
their torchrun starts, so no rank reads a config.py that is being rewritten. The tag names one
launch: the Slurm job step, or the rendezvous endpoint outside Slurm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pimm.errors import EXIT_CHECKPOINTED, LaunchError

NODES_DIR = ".nodes"


# -- node 0 tells the others the run directory is ready ---------------------------------------

def _announcement(run_dir: Path, tag: str) -> Path:
    return run_dir / NODES_DIR / f"{tag}.json"


def announce(run_dir: Path, tag: str, **facts) -> None:
    """Node 0: the run directory is ready for this launch (atomic: written, then renamed)."""
    path = _announcement(run_dir, tag)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"ready": True, **facts}))
    os.replace(tmp, path)


def announce_refusal(run_dir: Path, tag: str, message: str) -> None:
    """Node 0 could not prepare the run: the other nodes exit with the same message."""
    if run_dir.is_dir():
        announce(run_dir, tag, ready=False, error=message)


def withdraw(run_dir: Path, tag: str) -> None:
    _announcement(run_dir, tag).unlink(missing_ok=True)


def wait_for_announcement(run_dir: Path, tag: str, timeout_s: float = 600.0) -> dict:
    """The other nodes: wait (polling, which also sees files that a network filesystem shows
    late) until node 0 announced this launch; LaunchError on its refusal or after timeout_s."""
    path = _announcement(run_dir, tag)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            facts = json.loads(path.read_text())
        except (OSError, ValueError):
            facts = None
        if facts is not None:
            if not facts.get("ready"):
                raise LaunchError(f"node 0 did not start the run: {facts.get('error')}")
            return facts
        if time.monotonic() > deadline:
            raise LaunchError(
                f"node 0 did not prepare {run_dir} within {timeout_s:.0f} s (no {path}); is the run directory "
                "on a filesystem every node shares? See node 0's output"
            )
        time.sleep(0.5)


# -- torchrun on this node ---------------------------------------------------------------------

def attempts(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "provenance.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


def run_torchrun(argv: list[str], lock_fd: int | None) -> int:
    """Run torchrun (see pimm.signals for who handles which signal): it dies with this process,
    holds the run lock (when this node has it) as long as it lives, and gets SIGTERM for a
    SIGTERM or SIGUSR1 sent here."""
    from pimm.signals import die_with_parent, forward_stop_signals

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    pass_fds = (lock_fd,) if lock_fd is not None else ()
    # preexec_fn is safe here: pimm runs no threads at this point
    proc = subprocess.Popen(argv, env=env, pass_fds=pass_fds, preexec_fn=die_with_parent)  # noqa: PLW1509
    previous = forward_stop_signals(proc)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to the whole group; let torchrun finish
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train_on_this_node(plan, lock_fd: int | None, node_rank: int = 0) -> int:
    """Run this node's torchrun and turn how the run ended into pimm's exit status (the same on
    every node, so `srun` and the Slurm job report it): 0 finished, 75 checkpointed on a stop
    signal, 76 stopped by a second signal, 1 failed. Node 0 prints the full report."""
    run_dir = plan.run_dir
    attempts_before = len(attempts(run_dir))
    returncode = run_torchrun(plan.torchrun_argv(), lock_fd)
    # rank 0 (maybe on another node) records the outcome just before it exits: give it a moment
    outcome = _outcome(run_dir, attempts_before, wait_s=60.0 if node_rank else 5.0)
    status = exit_status(outcome, returncode)
    if node_rank:
        print(f"pimm: node {node_rank}: {outcome or 'no outcome recorded'} (exit status {status})", file=sys.stderr)
    elif status == EXIT_CHECKPOINTED:
        _report_interrupted(plan, outcome)
    elif status != 0:
        _report_failure(run_dir, returncode)
    else:
        _report_success(run_dir)
    return status


def _outcome(run_dir: Path, attempts_before: int, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        new = attempts(run_dir)[attempts_before:]
        outcome = new[-1].get("outcome", "") if new else ""
        if outcome and outcome != "running" or time.monotonic() > deadline:
            return outcome
        time.sleep(0.5)


def exit_status(outcome: str, returncode: int) -> int:
    """pimm's exit status: 75 when the run recorded a checkpointed stop (torchrun itself is then
    stopped by a signal), otherwise torchrun's own status."""
    return EXIT_CHECKPOINTED if outcome.startswith("interrupted") else returncode


def _report_interrupted(plan, outcome: str) -> None:
    from pimm.launch.resume import continue_command

    command = continue_command(plan.run_dir, plan.nproc_per_node, plan.nnodes, plan.max_restarts)
    print(f"\npimm: {outcome}; a complete checkpoint is in {plan.run_dir / 'model' / 'last'}", file=sys.stderr)
    print(f"pimm: continue with: {command}", file=sys.stderr)


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
    if (run_dir / "plot.png").exists():
        print(f"  plot             {run_dir / 'plot.png'}")
    if (run_dir / "model" / "last").exists():  # validate_only writes no checkpoint
        print(f"  checkpoint       {run_dir / 'model' / 'last'}")
