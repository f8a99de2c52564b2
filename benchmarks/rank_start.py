"""CPU seconds and wall time of a whole `pimm launch`, its ranks forked from torchrun against started as
new interpreters (pimm.launch.forked_rank).

Each measured run is `pimm launch` of the tiny test config (tests/tiny_semseg: 24 steps of a small
network, 2 validations, 2 checkpoints, the end-of-run plot) on generated events, at `--nproc` ranks;
its number is the CPU of the launcher, torchrun and every rank (the kernel's accounting of the finished
process tree) and its wall time. `new interpreters` sets PIMM_RANK_START=exec (each rank imports torch
and the trainer itself, as under plain torchrun); `forked` is pimm's default (torchrun imports them once
and forks the ranks). The two alternate (ABBA); each cell is the median of the repeats with their
spread [lowest..highest], and the ratio is of the medians.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rank_start.py [--nproc 2] [--repeats 5] [--wait-quiet 120]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import QuietGate, Spread, abba, add_arguments, own_cpu_s

REPO = Path(__file__).resolve().parents[1]
MODES = {"new interpreters": "exec", "forked": "fork"}


def launch_cpu_and_wall(nproc: int, mode: str, data: dict[str, Path], exp: Path, name: str) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PIMM_RANK_START=MODES[mode])
    command = [sys.executable, "-m", "pimm", "launch", "--train.config", "tests/tiny_semseg",
               "--resources.nproc-per-node", str(nproc), "--run.name", name, "--run.no-timestamp",
               "--paths.exp-root", str(exp), "--", f"data.train.path={data['train']}",
               f"data.val.path={data['val']}"]
    start_cpu, start_wall = own_cpu_s(), time.perf_counter()
    res = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - start_wall, own_cpu_s() - start_cpu
    if res.returncode != 0:
        sys.exit(f"rank_start.py: the launch ({mode}) failed with exit status {res.returncode}:\n{res.stderr}")
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, choices=range(1, 9), default=2, metavar="N",
                        help="ranks of each launch, 1 to 8 (default 2)")
    add_arguments(parser, repeats=5, what="launches of each mode")
    args = parser.parse_args()
    gate = QuietGate.from_args(args)
    from pimm.data.synth import write_dataset  # deferred: argparse's errors come before pimm's import

    with tempfile.TemporaryDirectory(prefix="pimm-bench-rank-start-") as tmp:
        root = Path(tmp)
        data = {"train": write_dataset(root / "train.h5", 48, seed=11),
                "val": write_dataset(root / "val.h5", 12, seed=12)}
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        wall: dict[str, list[float]] = {mode: [] for mode in MODES}
        for rep, mode in abba(list(MODES), args.repeats):
            gate.before(f"repeat {rep + 1}/{args.repeats} {mode}")
            c, w = launch_cpu_and_wall(args.nproc, mode, data, root / "exp", f"r{rep}-{MODES[mode]}")
            cpu[mode].append(c)
            wall[mode].append(w)
    print(f"pimm launch of tests/tiny_semseg at {args.nproc} rank(s), median of {args.repeats} [lowest..highest]")
    print(f"{'':8} | {'new interpreters':>22} | {'forked':>22} | ratio")
    for label, values in (("CPU s", cpu), ("wall s", wall)):
        new, forked = (Spread.of(values[mode]) for mode in MODES)
        print(f"{label:8} | {new.format('.2f'):>22} | {forked.format('.2f'):>22} | {new.median / forked.median:.2f}x")
    gate.report()


if __name__ == "__main__":
    main()
