"""What the benchmark scripts share so that their numbers hold on a machine other people use.

A timing on a shared machine measures the other work too: one run of a pair can land while
someone's test suite runs and the other while the machine is idle, and a ratio of 2.89 and one of
0.91 then come out of the same command. Every benchmark therefore offers

* `--wait-quiet SECONDS`: before each measured run, wait (at most SECONDS) until the processes that
  are not the benchmark's own use fewer than `--quiet-cores` cores, and say how long it waited;
* `--repeats N`: the measured pair (or set) N times, interleaved in ABBA order (A B, B A, A B, ...)
  so that a drift in the machine's speed favours neither side, reported as the median and the
  spread of the N: `194.6 [190.1..199.3]` is a median of 194.6, the lowest 190.1, the highest 199.3.

Run the scripts as files (`python benchmarks/throughput.py`): their folder is then on sys.path and
`import _timing` finds this module.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

QUIET_CORES = 0.25  # default --quiet-cores: a shell, an editor, a monitoring agent stay below it
PROBE_S = 2.0  # one look at the machine's load lasts this long


def add_arguments(parser: argparse.ArgumentParser, repeats: int, what: str) -> None:
    """--repeats N (default `repeats`; `what` says what is repeated), --wait-quiet and --quiet-cores."""
    parser.add_argument("--repeats", type=_positive_int, default=repeats, metavar="N",
                        help=f"{what}, interleaved; the median and the spread [lowest..highest] of the N are "
                        f"printed (default {repeats})")
    parser.add_argument("--wait-quiet", type=_non_negative, default=0.0, metavar="SECONDS",
                        help="before each measured run, wait up to SECONDS until other processes use fewer than "
                        "--quiet-cores cores, and print how long it waited (default 0: measure at once)")
    parser.add_argument("--quiet-cores", type=_non_negative, default=QUIET_CORES, metavar="CORES",
                        help=f"what --wait-quiet calls quiet: other processes' use in cores (default {QUIET_CORES})")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"needs a whole number >= 1, got {text!r}")
    return int(text)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"needs a number >= 0, got {text!r}")
    return value


# ----------------------------------------------------------------------------- the machine's load


def machine_busy_s() -> float | None:
    """CPU seconds all processes on the machine have used since boot (Linux /proc/stat), else None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = sum(fields[:3]) + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its finished descendants (runs, their ranks, loader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """Cores used on average by processes other than the benchmark's own while the block lasts
    (`.cores`, None where /proc/stat cannot be read). Anything well above 0 means the measurement
    competed with someone else's work for the CPUs."""

    def __enter__(self) -> OtherLoad:
        self.cores: float | None = None
        self._start = (time.perf_counter(), machine_busy_s(), own_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        t0, busy0, own0 = self._start
        busy1, own1, wall = machine_busy_s(), own_cpu_s(), time.perf_counter() - t0
        if busy0 is not None and busy1 is not None and wall > 0:
            self.cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall

    @staticmethod
    def text(cores: float | None) -> str:
        """An `other cores` table cell: the cores, or 'unknown'."""
        return "unknown" if cores is None else f"{cores:.2f}"


@dataclass
class Wait:
    """One wait for a quiet machine: how long it took, the other processes' cores at its last look,
    and whether the machine was quiet then (False: the limit ran out, or the load is unknown)."""

    seconds: float
    cores: float | None
    quiet: bool


def wait_until_quiet(limit_s: float, threshold: float = QUIET_CORES, probe_s: float = PROBE_S) -> Wait:
    """Look at the machine `probe_s` at a time until other processes use fewer than `threshold` cores,
    for at most `limit_s` (the last look may end up to `probe_s` later)."""
    start = time.perf_counter()
    while True:
        with OtherLoad() as other:
            time.sleep(probe_s)
        waited = time.perf_counter() - start
        if other.cores is None:
            return Wait(waited, None, False)
        if other.cores < threshold or waited >= limit_s:
            return Wait(waited, other.cores, other.cores < threshold)


class QuietGate:
    """`--wait-quiet` of a benchmark: `before(label)` waits for a quiet machine (nothing when the limit
    is 0) and prints one line saying how long it waited; `summary()` totals the waits."""

    def __init__(self, limit_s: float, threshold: float = QUIET_CORES, probe_s: float = PROBE_S,
                 say: Callable[[str], None] = print) -> None:
        self.limit_s, self.threshold, self.probe_s, self.say = limit_s, threshold, probe_s, say
        self.waits: list[Wait] = []

    @classmethod
    def from_args(cls, args: argparse.Namespace, say: Callable[[str], None] = print) -> QuietGate:
        return cls(args.wait_quiet, args.quiet_cores, say=say)

    def before(self, label: str) -> Wait | None:
        if self.limit_s <= 0:
            return None
        # a limit shorter than a probe is a probe's length: no look lasts longer than the wait allowed
        wait = wait_until_quiet(self.limit_s, self.threshold, min(self.probe_s, self.limit_s))
        self.waits.append(wait)
        if wait.cores is None:
            self.say(f"  {label}: the machine's load is unknown (no /proc/stat); measuring after {wait.seconds:.0f}s")
        elif wait.quiet:
            self.say(f"  {label}: waited {wait.seconds:.0f}s for a quiet machine "
                     f"(other processes {wait.cores:.2f} cores)")
        else:
            self.say(f"  {label}: still busy after {wait.seconds:.0f}s (other processes {wait.cores:.2f} cores, "
                     f"quiet is < {self.threshold:g}); measuring anyway")
        return wait

    def report(self) -> None:
        """Say summary() where the gate waited at all."""
        if self.waits:
            self.say(self.summary())

    def summary(self) -> str:
        """'waited 95s in all for a quiet machine (6 waits, 1 of them still busy at the limit)', or ''."""
        if not self.waits:
            return ""
        busy = sum(not w.quiet for w in self.waits)
        return (f"waited {sum(w.seconds for w in self.waits):.0f}s in all for a quiet machine "
                f"({len(self.waits)} waits, {busy} of them still busy at the limit)")


# ----------------------------------------------------------------------------- repeats and spread


def abba(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, name) in the order to run them: the names in order, then reversed, and so on."""
    return [(rep, name) for rep in range(repeats) for name in (names if rep % 2 == 0 else names[::-1])]


@dataclass
class Spread:
    """The median of repeated measurements, with the lowest and highest of them."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no measurements to summarise")
        return cls(float(statistics.median(values)), float(min(values)), float(max(values)), len(values))

    def format(self, spec: str = ".1f") -> str:
        """'194.6 [190.1..199.3]': the median and the spread; the median alone for one measurement."""
        if self.n == 1:
            return format(self.median, spec)
        return f"{format(self.median, spec)} [{format(self.low, spec)}..{format(self.high, spec)}]"

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n}


def write_results(out: Path | None, args: argparse.Namespace, results: list[dict]) -> None:
    """--out FILE: the settings (every argument but --out) and the results as JSON (nothing without --out)."""
    if out is None:
        return
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
