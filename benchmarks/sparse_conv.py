"""pimm's submanifold convolution (plain PyTorch) against spconv 2.3.8's CPU forward, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sparse_conv.py [--points 4000 30000] [--channels 48 192]
        [--events 2] [--kernel-size 3] [--threads 1] [--calls 5] [--repeats 5 --wait-quiet 60] [--out FILE]
    .venv/bin/python benchmarks/sparse_conv.py --quick      # tiny sizes, a few seconds: proves it runs

The sites are PILArNet-M-like events from pimm's generator (`pimm.data.synth.pilarnet_event`, integer
voxels in a 768 cube): events are drawn, and overlaid where one drawing has fewer voxels than asked,
until each has `--points` distinct voxels. A batch holds `--events` such events. Every convolution
has as many input as output channels (as PT-v3's CPE has) and no bias, on both sides.

Two forwards are timed for every (points, channels), each as the median of `--calls` calls after
one warm-up:

* new sites: the first convolution at sites: pimm builds its neighbour map and spconv its indice
  pairs inside the timed call;
* map reused: a convolution at sites whose pairs exist (pimm: the same `VoxelSites`; spconv: the
  same `indice_key` on the tensor that a first convolution returned), as every convolution after
  the first at one level of a network is.

The ratio is spconv's time over pimm's: above 1.0 pimm is faster. `--threads` sets torch's threads
for both (default 1: spconv's CPU path is the tests' single-threaded reference). `--repeats N`
measures both sides N times in ABBA order and prints medians with their spread [lowest..highest];
`--wait-quiet` waits for a quiet machine first (see `_timing`). Both sides' outputs are compared
before anything is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _timing import OtherLoad, QuietGate, Spread, abba, add_arguments, write_results

from pimm.data.synth import distinct_voxels
from pimm.models.sparse_conv import SubMConv3d, VoxelSites

SIDES = ("pimm", "spconv")
QUICK = {"points": [300], "channels": [8], "events": 2, "calls": 2, "repeats": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=int, nargs="+", default=[4000, 30000],
                   help="voxels per event (default 4000 30000)")
    p.add_argument("--channels", type=int, nargs="+", default=[48, 192],
                   help="input = output channels (default 48 192)")
    p.add_argument("--events", type=int, default=2, help="events per batch (default 2)")
    p.add_argument("--kernel-size", type=int, default=3, choices=(3, 5), help="kernel size (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both sides (default 1)")
    p.add_argument("--calls", type=int, default=5, help="timed calls per measurement, after one warm-up (default 5)")
    p.add_argument("--seed", type=int, default=0, help="generator seed of the events (default 0)")
    p.add_argument("--quick", action="store_true", help=f"a smoke run at tiny sizes ({QUICK})")
    p.add_argument("--out", type=Path, help="also write the results as JSON to this file")
    add_arguments(p, repeats=3, what="measurements of each side")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if min(*args.points, *args.channels, args.events, args.threads, args.calls) < 1:
        p.error("--points, --channels, --events, --threads and --calls must be >= 1")
    return args


def batch_sites(points: int, events: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """grid_coord [events * points, 3] and batch_index of a batch of generated events."""
    coords = [torch.from_numpy(distinct_voxels(points, seed, e)) for e in range(events)]
    batch = torch.repeat_interleave(torch.arange(events), points)
    return torch.cat(coords), batch


def median_ms(fn: Callable[[], object], calls: int) -> float:
    """The median wall time of `calls` calls of `fn` (after one warm-up), in milliseconds."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def forwards(coord: torch.Tensor, batch: torch.Tensor, channels: int, kernel_size: int) -> dict:
    """The four timed forwards ({side: {"new": fn, "reused": fn}}) and the largest output difference."""
    # deferred: spconv's import loads its compiled library; `--help` should not need it
    import spconv.pytorch as spconv

    torch.manual_seed(0)
    features = torch.randn(len(coord), channels)
    ours = SubMConv3d(channels, channels, kernel_size, bias=False)
    reference = spconv.SubMConv3d(channels, channels, kernel_size, bias=False, indice_key="subm").eval()
    reference.load_state_dict(ours.state_dict())  # the same weight, in the layout both store
    # spconv's indices are [N, 4] int32 (event, then the three coordinate columns in pimm's order)
    indices = torch.cat([batch.unsqueeze(1), coord], 1).int()
    shape = (coord.max(0).values + 1).tolist()

    def spconv_new():
        return reference(spconv.SparseConvTensor(features, indices, shape, int(batch.max()) + 1))

    sites = VoxelSites(coord, batch)
    with torch.no_grad():
        first = spconv_new()  # carries its indice pairs under "subm"; its features time as well as any
        difference = float((ours(features, sites) - first.features).abs().max())
    return {"pimm": {"new": lambda: ours(features, VoxelSites(coord, batch)), "reused": lambda: ours(features, sites)},
            "spconv": {"new": spconv_new, "reused": lambda: reference(first)},
            "max_abs_difference": difference, "pairs_per_site": sum(sites.neighbour_map(kernel_size).pair_counts())
            / len(coord)}


def measure(args: argparse.Namespace, points: int, channels: int, coord, batch, gate: QuietGate) -> dict:
    runs = forwards(coord, batch, channels, args.kernel_size)
    samples: dict[str, dict[str, list[float]]] = {side: {"new": [], "reused": []} for side in SIDES}
    with torch.no_grad(), OtherLoad() as other:
        for rep, side in abba(SIDES, args.repeats):
            gate.before(f"{points} points, {channels} channels, repeat {rep + 1}/{args.repeats} {side}")
            for kind in ("new", "reused"):
                samples[side][kind].append(median_ms(runs[side][kind], args.calls))
    ms = {side: {kind: Spread.of(values) for kind, values in kinds.items()} for side, kinds in samples.items()}
    return {"points_per_event": points, "sites": len(coord), "channels": channels,
            "pairs_per_site": runs["pairs_per_site"], "max_abs_difference": runs["max_abs_difference"],
            "ms": ms, "ratio_new": ms["spconv"]["new"].median / ms["pimm"]["new"].median,
            "ratio_reused": ms["spconv"]["reused"].median / ms["pimm"]["reused"].median,
            "other_cores": other.cores}


def table(rows: list[dict]) -> str:
    head = (f"{'points/event':>12} {'channels':>8} {'pairs/site':>10} | {'pimm ms':>20} {'spconv ms':>20} "
            f"{'ratio':>6} | {'pimm ms reused':>20} {'spconv ms reused':>20} {'ratio':>6} | {'other cores':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = r["ms"]
        lines.append(f"{r['points_per_event']:>12} {r['channels']:>8} {r['pairs_per_site']:>10.2f} | "
                     f"{ms['pimm']['new'].format('.2f'):>20} {ms['spconv']['new'].format('.2f'):>20} "
                     f"{r['ratio_new']:>6.2f} | {ms['pimm']['reused'].format('.2f'):>20} "
                     f"{ms['spconv']['reused'].format('.2f'):>20} {r['ratio_reused']:>6.2f} | "
                     f"{OtherLoad.text(r['other_cores']):>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"sparse conv benchmark: kernel {args.kernel_size}, {args.events} events per batch, "
          f"{torch.get_num_threads()} torch threads, {args.calls} calls per measurement, "
          f"{args.repeats} repeats; ratio = spconv ms / pimm ms (> 1: pimm faster)", flush=True)
    gate = QuietGate.from_args(args, say=lambda line: print(line, flush=True))
    rows = []
    for points in args.points:
        coord, batch = batch_sites(points, args.events, args.seed)
        for channels in args.channels:
            rows.append(measure(args, points, channels, coord, batch, gate))
            r = rows[-1]
            print(f"  {points} points, {channels} channels: ratio {r['ratio_new']:.2f} new sites, "
                  f"{r['ratio_reused']:.2f} map reused (outputs differ by at most {r['max_abs_difference']:.1e})",
                  flush=True)
            if r["max_abs_difference"] > 1e-3:
                print(f"  WARNING: the two outputs differ by {r['max_abs_difference']:.2g}: one side computes "
                      "something else (spconv's CPU path is the tests' reference only single-threaded)", flush=True)
    print(table(rows))
    gate.report()
    write_results(args.out, args, [
        {**r, "ms": {s: {k: v.as_dict() for k, v in kinds.items()} for s, kinds in r["ms"].items()}} for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
