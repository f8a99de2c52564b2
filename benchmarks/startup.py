"""CPU seconds of a process's start-up imports, with Python's cyclic collector on and paused (pimm.startup).

Each measured run is a fresh interpreter that imports what one process of a run imports before
it works, then exits; its CPU (user + system, from the kernel's accounting of the child) is the
number. Two start-ups are measured:

* `rank`: a training rank, `pimm.engine.worker`'s imports (torch, DCP with DTensor, the trainer),
  then torch._dynamo, which DDP and FSDP2 import when they wrap the model;
* `torchrun`: pimm's torchrun, torch.distributed.run and its elastic agent.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/startup.py [--repeats 7] [--wait-quiet 120]

`collector on` imports as Python does by default; `paused` imports as pimm's processes do: the
worker's and torchrun's imports inside pimm.startup.paused_gc, torch._dynamo after it.
The two alternate (ABBA); each cell is the median of the repeats with their spread
[lowest..highest], and the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from _timing import QuietGate, Spread, abba, add_arguments, own_cpu_s

# start-up -> (what pimm imports under paused_gc, what it imports after, with the collector back on)
IMPORTS = {
    "rank": ("from pimm.distributed.env import init_distributed\nfrom pimm.engine.trainer import Trainer",
             "import torch._dynamo"),
    "torchrun": ("from torch.distributed.run import run\n"
                 "from torch.distributed.elastic.multiprocessing.api import SignalException", ""),
}
MODES = ("collector on", "paused")


def program(name: str, mode: str) -> str:
    paused, after = IMPORTS[name]
    if mode == "paused":
        body = "\n".join("    " + line for line in paused.splitlines())
        return f"from pimm.startup import paused_gc\nwith paused_gc():\n{body}\n{after}\n"
    return f"{paused}\n{after}\n"


def child_cpu_s(code: str) -> float:
    """CPU seconds of `python -c code` (user + system, the kernel's accounting of the finished child; this
    process's own milliseconds of starting and waiting for it included)."""
    start = own_cpu_s()
    subprocess.run([sys.executable, "-c", code], check=True)
    return own_cpu_s() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-up", nargs="+", choices=sorted(IMPORTS), default=sorted(IMPORTS),
                        help="which start-ups to measure (default: both)")
    add_arguments(parser, repeats=7, what="start-ups of each mode")
    args = parser.parse_args()
    gate = QuietGate.from_args(args)
    print(f"CPU seconds of one start-up's imports, median of {args.repeats} [lowest..highest]")
    print(f"{'start-up':9} | {MODES[0]:>22} | {MODES[1]:>22} | ratio")
    for name in args.start_up:
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        for rep, mode in abba(MODES, args.repeats):
            gate.before(f"{name} repeat {rep + 1}/{args.repeats} {mode}")
            cpu[mode].append(child_cpu_s(program(name, mode)))
        on, paused = (Spread.of(cpu[mode]) for mode in MODES)
        print(f"{name:9} | {on.format('.2f'):>22} | {paused.format('.2f'):>22} | {on.median / paused.median:.2f}x")
    gate.report()


if __name__ == "__main__":
    main()
