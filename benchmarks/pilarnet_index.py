"""How long the PILArNet-M event index costs: the first build, one more point cut, a start that
reads the cache, and random event reads, on a generated shard (page cache warm).

    .venv/bin/python benchmarks/pilarnet_index.py [--events 3000] [--threshold 0.13] [--points-per-event 4000]
                                                  [--repeats 5 --wait-quiet 120]

Prints seconds and events/s of each, and the cached start as a fraction of the build; with
--repeats, the median of the passes and their spread [lowest..highest]."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from _timing import QuietGate, Spread, add_arguments

from pimm.data import index_cache, pilarnet_file
from pimm.data.dataset import PILArNetDataset
from pimm.data.synth import write_pilarnet


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def one_pass(shard: Path, threshold: float, reads: int) -> dict[str, float]:
    """Seconds of a build (no cache on disk or in memory), one more cut, a start from the cache, and
    `reads` random reads."""
    index_cache.index_path(shard).unlink(missing_ok=True)
    index_cache.clear_memory()
    build, ds = _timed(lambda: PILArNetDataset(shard))
    cut, _ = _timed(lambda: PILArNetDataset(shard, energy_threshold=threshold, min_points=1))
    index_cache.clear_memory()
    cached, _ = _timed(lambda: PILArNetDataset(shard, energy_threshold=threshold, min_points=1))
    picks = np.random.default_rng(0).integers(0, len(ds), reads)
    ds[(0, 0)]  # open the handle outside the timing
    read, _ = _timed(lambda: [ds[(0, int(i))] for i in picks])
    ds.close()
    return {"build": build, "cut": cut, "cached": cached, "reads": read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--threshold", type=float, default=0.13, help="energy_threshold of the second cut (MeV)")
    parser.add_argument("--reads", type=int, default=2000, help="random __getitem__ calls")
    parser.add_argument("--points-per-event", type=int, default=None,
                        help="about this many points per generated event (PILArNet-M: ~4,000; default: ~600)")
    add_arguments(parser, repeats=1, what="passes of the four measurements (each from a removed cache)")
    args = parser.parse_args()
    gate = QuietGate.from_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        (shard,) = write_pilarnet(Path(tmp) / "bench.h5", args.events, seed=1, points_per_event=args.points_per_event)
        size_mb = shard.stat().st_size / 1e6
        passes = []
        for rep in range(args.repeats):
            gate.before(f"pass {rep + 1}/{args.repeats}")
            passes.append(one_pass(shard, args.threshold, args.reads))
        points = int(pilarnet_file.shard_index(shard, "v2")["num_points"].mean())

    def spread(key: str, scale: float = 1.0) -> Spread:
        return Spread.of([scale * p[key] for p in passes])

    def rate(key: str, count: int) -> Spread:
        return Spread.of([count / p[key] for p in passes])

    print(f"shard: {args.events} events, {size_mb:.1f} MB, {points} points per event on average; "
          f"median of {args.repeats} [lowest..highest]")
    print(f"index build (first start):        {spread('build').format('.3f')} s  "
          f"{rate('build', args.events).format('.0f')} events/s")
    print(f"one more cut (energy > {args.threshold}):  {spread('cut').format('.3f')} s  "
          f"{rate('cut', args.events).format('.0f')} events/s")
    fraction = Spread.of([p["cached"] / p["build"] for p in passes])
    print(f"start from the cached index:      {spread('cached', 1e3).format('.1f')} ms "
          f"({fraction.format('.3f')} of the build)")
    print(f"random __getitem__ (one process): {rate('reads', args.reads).format('.0f')} events/s")
    gate.report()


if __name__ == "__main__":
    main()
