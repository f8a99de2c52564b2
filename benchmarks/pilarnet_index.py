"""How long the PILArNet-M event index costs: the first build, one more point cut, a start that
reads the cache, and random event reads, on a generated shard (page cache warm).

    .venv/bin/python benchmarks/pilarnet_index.py [--events 3000] [--threshold 0.13] [--points-per-event 4000]

Prints seconds and events/s of each, and the cached start as a fraction of the build."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from pimm.data import pilarnet_file
from pimm.data.dataset import PILArNetDataset
from pimm.data.synth import write_pilarnet


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--threshold", type=float, default=0.13, help="energy_threshold of the second cut (MeV)")
    parser.add_argument("--reads", type=int, default=2000, help="random __getitem__ calls")
    parser.add_argument("--points-per-event", type=int, default=None,
                        help="about this many points per generated event (PILArNet-M: ~4,000; default: ~600)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (shard,) = write_pilarnet(Path(tmp) / "bench.h5", args.events, seed=1, points_per_event=args.points_per_event)
        size_mb = shard.stat().st_size / 1e6
        build, ds = _timed(lambda: PILArNetDataset(shard))
        cut, _ = _timed(lambda: PILArNetDataset(shard, energy_threshold=args.threshold, min_points=1))
        pilarnet_file._memory_index.clear()
        cached, _ = _timed(lambda: PILArNetDataset(shard, energy_threshold=args.threshold, min_points=1))
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(ds), args.reads)
        ds[(0, 0)]  # open the handle outside the timing
        reads, _ = _timed(lambda: [ds[(0, int(i))] for i in picks])
        points = int(pilarnet_file.shard_index(shard, "v2")["num_points"].mean())
    print(f"shard: {args.events} events, {size_mb:.1f} MB, {points} points per event on average")
    print(f"index build (first start):        {build:7.3f} s  {args.events / build:9.0f} events/s")
    print(f"one more cut (energy > {args.threshold}):  {cut:7.3f} s  {args.events / cut:9.0f} events/s")
    print(f"start from the cached index:      {cached * 1e3:7.1f} ms ({cached / build:.3f} of the build)")
    print(f"random __getitem__ (one process): {args.reads / reads:9.0f} events/s")


if __name__ == "__main__":
    main()
