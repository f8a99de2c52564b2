"""One pimm per node: run torchrun for this node and report how the run ended.

In a multi-node run node 0 is the run's one writer: it creates or reopens the run directory,
takes the run lock, writes config.py and launch.json (or, under `pimm submit`, finds them
written on the submitting host) and then announces the launch in `<run>/.nodes/<tag>.json`. The
other nodes write nothing: they wait for that announcement (or for node 0's refusal) before
their torchrun starts, so no rank reads a config.py that is being rewritten. The tag names one
launch: the Slurm job step, or the rendezvous endpoint outside Slurm.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pimm.checkpoint.layout import LAST, STAGING_PREFIX, Checkpoint, newest_resumable
from pimm.errors import EXIT_CHECKPOINTED, EXIT_SECOND_SIGNAL, LaunchError
from pimm.files import write_atomic
from pimm.launch.plan import TEST_PHASE, LaunchPlan
from pimm.launch.process import run_torchrun
from pimm.launch.resume import attempts, continue_command
from pimm.signals import StopForwarder

NODES_DIR = ".nodes"


# -- node 0 tells the others the run directory is ready ---------------------------------------

def _announcement(run_dir: Path, tag: str) -> Path:
    return run_dir / NODES_DIR / f"{tag}.json"


def announce(run_dir: Path, tag: str, **facts) -> None:
    """Node 0: the run directory is ready for this launch (atomic: written, then renamed)."""
    path = _announcement(run_dir, tag)
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, json.dumps({"ready": True, **facts}), durable=False)


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

def train_on_this_node(plan: LaunchPlan, lock_fd: int | None, node_rank: int = 0) -> int:
    """Run this node's torchrun and turn how the run ended into pimm's exit status (the same on
    every node, so `srun` and the Slurm job report it): 0 finished, 75 stopped by a signal with a
    complete checkpoint to continue from, 76 stopped at once by a second signal, 1 failed. Node 0
    prints the full report and, when the plan names the test phase, ends with it."""
    run_dir = plan.run_dir
    attempts_before = len(attempts(run_dir))
    try:
        report_dir = Path(tempfile.mkdtemp(prefix="pimm-report-"))
    except OSError:  # no local scratch space: the run directory's errors/ still reports
        report_dir = None
    try:
        returncode, stops = run_torchrun(plan.torchrun_argv(), lock_fd, report_dir)
        # rank 0 (maybe on another node) records the outcome just before it exits: give it a moment
        outcome = _outcome(run_dir, attempts_before, wait_s=60.0 if node_rank else (0.5 if stops.killed else 5.0))
        failures, errors = _reports(run_dir, report_dir)
    finally:
        if report_dir is not None:
            shutil.rmtree(report_dir, ignore_errors=True)
    checkpoint = _newest_checkpoint(run_dir)
    status, stopped = ending(outcome, returncode, stops, errors, checkpoint is not None)
    if node_rank:
        print(f"pimm: node {node_rank}: {outcome or 'no outcome recorded'} (exit status {status})", file=sys.stderr)
    elif stopped:
        _report_stopped(plan, stops.signal_name, outcome, checkpoint, status)
    elif status != 0:
        _report_failure(plan, status, failures, errors, checkpoint)
    else:
        _report_success(run_dir)
        if TEST_PHASE in plan.phases and stops.signal_name:
            print(f"pimm: a stop signal ({stops.signal_name}) came as the run finished, so the test after training "
                  f"was not started; test it with: pimm test --run-dir {run_dir}", file=sys.stderr)
        elif TEST_PHASE in plan.phases:
            # deferred: the test phase imports torch, which the launcher does without until the training ended
            from pimm.launch.evaluate import test_after_training

            status = test_after_training(run_dir, plan.nproc_per_node)
    return status


def ending(outcome: str, returncode: int, stops: StopForwarder, errors: dict[int, str],
           has_checkpoint: bool) -> tuple[int, bool]:
    """(pimm's exit status, whether a stop signal ended the run) from the outcome this attempt
    recorded (provenance.json), torchrun's exit status, the signals pimm was sent, the ranks' errors
    and whether a complete checkpoint exists. The two always agree with the record:
      - "completed": the run trained its last step and wrote its final checkpoint; a stop signal
        that came after the ranks last agreed on stopping changes nothing: 0;
      - "interrupted ...": the ranks stopped together with a checkpoint (also at the last step): 75;
      - else a second signal that killed torchrun: 76; a signal with no rank error and a
        checkpoint to continue from: 75; otherwise torchrun's status (1: a rank failed)."""
    if outcome == "completed" and not errors:
        return 0, False
    status = EXIT_CHECKPOINTED if outcome.startswith("interrupted") else returncode
    stopped = stops.killed or status == EXIT_CHECKPOINTED or bool(stops.signal_name and status != 0 and not errors)
    if stops.killed:
        status = EXIT_SECOND_SIGNAL
    elif stopped and has_checkpoint:
        status = EXIT_CHECKPOINTED
    return status, stopped


def _outcome(run_dir: Path, attempts_before: int, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        new = attempts(run_dir)[attempts_before:]
        outcome = new[-1].get("outcome", "") if new else ""
        if outcome and outcome != "running" or time.monotonic() > deadline:
            return outcome
        time.sleep(0.5)


def _newest_checkpoint(run_dir: Path) -> Checkpoint | None:
    try:
        return newest_resumable(run_dir / "model")
    except OSError:
        return None


def _reports(run_dir: Path, report_dir: Path | None) -> tuple[list[dict], dict[int, str]]:
    """(torchrun's record of the failed ranks on this node, rank -> its error): the errors from the
    run directory (every node's ranks) and from this node's report folder (kept when the run
    directory's disk was full)."""
    failures: list[dict] = []
    errors: dict[int, str] = {}
    for folder in (run_dir / "errors", report_dir):
        if folder is None:
            continue
        for path in folder.glob("rank*.txt"):
            with contextlib.suppress(OSError, ValueError):
                text = path.read_text().strip()
                if text:
                    errors[int(path.stem[4:])] = text
    if report_dir is not None:
        with contextlib.suppress(OSError, ValueError):
            failures = json.loads((report_dir / "torchrun.json").read_text())
    return failures, errors


def first_causes(failures: list[dict], errors: dict[int, str]) -> list[dict]:
    """The failed ranks, the one that failed first first: a rank killed by a signal torchrun did not
    send (the others then fail because it vanished), then a rank that exited with an error of its
    own, then one that lost its connection (to a rank that died), then those torchrun stopped.
    Each failure: rank, local_rank, pid, host, exitcode, signal, stopped_by_torchrun (torchrun.py)."""
    def order(item: tuple[int, dict]) -> tuple[int, int]:
        i, failure = item
        if failure.get("stopped_by_torchrun"):
            return 3, i
        if failure["exitcode"] < 0:
            return 0, i
        return (2 if lost_connection(errors.get(failure["rank"], "")) else 1), i

    return [f for _, f in sorted(enumerate(failures), key=order)]


def lost_connection(error: str) -> bool:
    """The error of a rank whose peer went away (gloo/NCCL/TCPStore), not a failure of its own."""
    return re.search(r"connection (reset|closed|refused|lost)|broken pipe|closed by peer|peer .*(died|exited)",
                     error, re.IGNORECASE) is not None


def failure_summary(failures: list[dict], errors: dict[int, str], run_dir: Path) -> tuple[int | None, str]:
    """(the rank that failed first, one line: what happened to it and what that did to the others)."""
    ordered = first_causes(failures, errors)
    if not ordered:  # torchrun recorded nothing (e.g. the failure was on another node): the errors alone
        ranks = sorted(errors, key=lambda r: (lost_connection(errors[r]), r))
        if not ranks:
            return None, f"no rank reported an error; see the logs in {run_dir / 'logs'}"
        ordered = [{"rank": r, "exitcode": 1} for r in ranks]
    first = ordered[0]
    rank = first["rank"]
    who = f"rank {rank}" + (f" (pid {first['pid']}, local rank {first['local_rank']} on {first['host']})"
                            if "pid" in first else "")
    if first["exitcode"] < 0:
        line = f"{who} was killed by signal {-first['exitcode']} ({first['signal']})"
    elif errors.get(rank):
        line = f"rank {rank} failed: {' '.join(errors[rank].split())}"
    else:
        line = (f"{who} exited with status {first['exitcode']} without reporting an error; see "
                f"{run_dir / 'logs' / f'rank{rank}.log'}")
    same = [r for r, text in errors.items() if r != rank and text == errors.get(rank)]  # said once: "the same way"
    after = [f["rank"] for f in ordered[1:] if not f.get("stopped_by_torchrun") and f["rank"] not in same]
    lost = [r for r in after if lost_connection(errors.get(r, ""))]
    other = [r for r in after if r not in lost]
    if lost:
        line += f"; {_ranks(lost)} then lost {'its' if len(lost) == 1 else 'their'} connection"
    if other:
        line += f"; {_ranks(other)} then failed too"
    return rank, line


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _continue_lines(plan, checkpoint, full_disk: bool = False) -> list[str]:
    if checkpoint is None:
        return ["no checkpoint was written"]
    command = continue_command(plan.run_dir, plan.nproc_per_node, plan.nnodes, plan.max_restarts)
    first = "; free space on its disk first" if full_disk else ""
    where = str(checkpoint.path)
    if checkpoint.path.name.startswith(STAGING_PREFIX):  # written in full, stopped before its rename
        where += f": written in full, the resume renames it {LAST} first"
    return [f"the last complete checkpoint is step {checkpoint.step} ({where}){first}",
            f"continue with: {command}"]


def _report_stopped(plan, signal_name: str | None, outcome: str, checkpoint, status: int) -> None:
    """A stop signal ended the run: which one, the checkpoint it left, how to continue."""
    name = signal_name or outcome.removeprefix("interrupted by ") or "a signal"
    lines = _continue_lines(plan, checkpoint)
    if status == EXIT_SECOND_SIGNAL:
        what = f"stopped at once by a second {name}"
    elif outcome.startswith("interrupted") and checkpoint is not None:
        what = f"{outcome}: wrote the checkpoint of step {checkpoint.step} ({checkpoint.path})"
        lines = lines[1:]
    else:
        what = f"stopped by {name} before this attempt wrote a checkpoint"
    print(f"\npimm: {what} (exit status {status})", file=sys.stderr)
    for line in lines:
        print(f"pimm: {line}", file=sys.stderr)


def _report_failure(plan, status: int, failures: list[dict], errors: dict[int, str], checkpoint) -> None:
    """The ranks' own errors, the checkpoint to continue from, and last one line: the rank that
    failed first and what that did to the others."""
    run_dir = plan.run_dir
    first, summary = failure_summary(failures, errors, run_dir)
    print(f"\npimm: training failed (exit status {status})", file=sys.stderr)
    for rank in sorted(errors):
        if rank != first:
            same = first in errors and errors[rank] == errors[first]
            print(f"pimm: rank {rank} failed" + (" the same way" if same else f": {errors[rank]}"), file=sys.stderr)
    full = any("no space left on device" in text or "quota exceeded" in text for text in errors.values())
    for line in _continue_lines(plan, checkpoint, full):
        print(f"pimm: {line}", file=sys.stderr)
    print(f"pimm: {summary}", file=sys.stderr)


def _report_success(run_dir: Path) -> None:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    final = summary.get("final_val") or {}
    validate_only = bool(summary.get("validate_only"))

    def num(value) -> str:  # pimm.json_io writes a non-finite metric as null
        return "null (not finite)" if value is None else f"{value:.4f}"

    print("\npimm: validation finished" if validate_only else "\npimm: training finished")
    if final:
        metric = summary.get("best_metric") or "miou"
        label = "mIoU" if metric == "miou" else metric
        print(f"  validation {label:<5} {num(final.get(metric))} (loss {num(final.get('loss'))}, "
              f"{int(final['events'])} events)")
    print(f"  run directory    {run_dir}")
    print(f"  config           {run_dir / 'config.py'}")
    print(f"  logs             {run_dir / 'logs'}/rank*.log")
    print(f"  metrics          {run_dir / 'metrics.jsonl'}")
    if (run_dir / "plot.png").exists():
        print(f"  plot             {run_dir / 'plot.png'}")
    if (run_dir / "model" / "last").exists():  # validate_only writes no checkpoint
        print(f"  checkpoint       {run_dir / 'model' / 'last'}")
