"""Real `pimm launch` runs for validate-scaling, and readers of what a run wrote.

Every run is `python -m pimm launch ...` in a session of its own (its process group is the
whole job: launcher, torchrun, ranks, loader workers), with its output in `<out>/logs/`; the
group is SIGKILLed when the run is over or the driver stops, so nothing outlives the validation.
Ports come from torchrun's `--standalone` rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pimm.launch.plan import run_directory

POLL_S = 0.02  # how often an interrupted run's metrics are read


@dataclass
class Run:
    """One launch: what it was, where it wrote, how it ended (once finished)."""

    name: str
    world_size: int
    run_dir: Path
    stdout: Path
    stderr: Path
    returncode: int | None = None
    seconds: float = 0.0
    signal_step: int | None = None  # for an interrupted run: the logged step when the signal was sent
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)

    def error(self) -> str:
        """The run's own error (the failing ranks' messages), or the tail of its stderr."""
        errors = sorted((self.run_dir / "errors").glob("rank*.txt"))
        if errors:
            return errors[0].read_text().strip()
        lines = [ln for ln in _text(self.stderr).splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit status {self.returncode}, no output"

    def log_text(self) -> str:
        """Everything the run said: its stderr and every rank's log."""
        logs = sorted((self.run_dir / "logs").glob("rank*.log"))
        return _text(self.stderr) + "".join(_text(p) for p in logs)


class Launcher:
    """Starts the runs of one validation: `pimm launch` of `config` under `<out>/runs`."""

    def __init__(self, config: str, out: Path, timeout_s: float, echo: Callable[[str], None] = print) -> None:
        self.config = config
        self.exp_root = out / "runs"
        self.logs = out / "logs"
        self.timeout_s = timeout_s
        self.echo = echo

    def run_dir(self, name: str) -> Path:
        return run_directory(self.exp_root, self.config.removesuffix(".py"), name, False)

    def train(self, name: str, world_size: int, overrides: list[str], weight: Path | None = None) -> Run:
        """A new run of the config at `world_size` ranks (warm-started from `weight` if given)."""
        return self._finish(self._start(name, world_size, self._new_run(name, world_size, overrides, weight)))

    def resume(self, name: str, run_dir: Path, world_size: int) -> Run:
        """`pimm launch --train.resume run_dir` at `world_size` ranks."""
        argv = ["--train.resume", str(run_dir), "--resources.nproc-per-node", str(world_size)]
        return self._finish(self._start(name, world_size, argv, run_dir))

    def interrupt(self, name: str, world_size: int, overrides: list[str], at_step: int, sig: int) -> Run:
        """A new run, sent `sig` on its whole process group (as Slurm signals a job) once its
        metrics show a train step >= at_step; returns when it has exited."""
        run = self._start(name, world_size, self._new_run(name, world_size, overrides, None))
        deadline = time.monotonic() + self.timeout_s
        try:
            while run._proc.poll() is None and time.monotonic() < deadline:
                step = last_train_step(run.run_dir)
                if step is not None and step >= at_step:
                    run.signal_step = step
                    os.killpg(run._proc.pid, sig)
                    break
                time.sleep(POLL_S)
        except BaseException:
            _kill_group(run._proc)
            raise
        return self._finish(run)

    # -- processes -------------------------------------------------------------------------

    def _new_run(self, name: str, world_size: int, overrides: list[str], weight: Path | None) -> list[str]:
        argv = ["--train.config", self.config, "--resources.nproc-per-node", str(world_size),
                "--run.name", name, "--run.no-timestamp", "--paths.exp-root", str(self.exp_root)]
        if weight is not None:
            argv += ["--train.weight", str(weight)]
        return [*argv, "--", *overrides]

    def _start(self, name: str, world_size: int, argv: list[str], run_dir: Path | None = None) -> Run:
        self.logs.mkdir(parents=True, exist_ok=True)
        stdout, stderr = self.logs / f"{name}.out", self.logs / f"{name}.err"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "pimm", "launch", *argv]
        with open(stdout, "w") as out, open(stderr, "w") as err:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.echo(f"validate-scaling: {name}: {world_size} rank(s) ...")
        return Run(name, world_size, run_dir or self.run_dir(name), stdout, stderr, _proc=proc,
                   _started=time.monotonic())

    def _finish(self, run: Run) -> Run:
        try:
            run.returncode = run._proc.wait(timeout=max(1.0, self.timeout_s - (time.monotonic() - run._started)))
        except subprocess.TimeoutExpired:
            run.returncode = -signal.SIGKILL
            with open(run.stderr, "a") as err:
                err.write(f"\nvalidate-scaling: killed after {self.timeout_s:.0f} s (--timeout)\n")
        finally:
            _kill_group(run._proc)  # nothing of the run may outlive it: loader workers, a stuck rank
        run.seconds = time.monotonic() - run._started
        self.echo(f"validate-scaling: {run.name}: exit {run.returncode} after {run.seconds:.1f} s ({run.run_dir})")
        return run


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# -- what a run wrote ------------------------------------------------------------------------

def records(run_dir: Path, kind: str) -> list[dict]:
    """metrics.jsonl records of one kind ("train", "val"); a line being written is skipped."""
    out = []
    for line in _text(run_dir / "metrics.jsonl").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("kind") == kind:
                out.append(record)
    return out


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> the logged train loss (the mean over the global batch)."""
    # a non-finite loss is recorded as null (pimm.json_io)
    return {r["step"]: float("nan") if r["loss"] is None else float(r["loss"]) for r in records(run_dir, "train")}


def last_train_step(run_dir: Path) -> int | None:
    steps = [r["step"] for r in records(run_dir, "train")]
    return max(steps) if steps else None


def step_event_ids(run_dir: Path) -> dict[int, list[int]]:
    """step -> the global batch's event ids (the ranks' shares concatenated in rank order)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in (run_dir / "logs").glob("event_ids_rank*.jsonl"):
        for line in _text(path).splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                by_step.setdefault(rec["step"], {})[rec["rank"]] = rec["event_ids"]
    return {s: [i for r in sorted(ranks) for i in ranks[r]] for s, ranks in sorted(by_step.items())}


def final_weights(run_dir: Path) -> dict:
    """model/last/weights.pth as tensors (no pickle)."""
    import torch  # deferred: seconds to import; refusing bad input (exit 2) does without

    return torch.load(run_dir / "model" / "last" / "weights.pth", weights_only=True, map_location="cpu")


def max_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest |a - b| / |b| over the steps of `b` (inf when a step is missing or a value non-finite)."""
    worst = 0.0
    for step, ref in b.items():
        value = a.get(step)
        if value is None or not (math.isfinite(value) and math.isfinite(ref)):
            return math.inf
        worst = max(worst, abs(value - ref) / max(abs(ref), 1e-30))
    return worst
