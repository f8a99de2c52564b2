"""`pimm data synth` and `pimm data describe`: generate and inspect HDF5 event files (pimm's own
layout, or PILArNet-M's)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pimm.errors import DataError
from pimm.names import PILARNET_REVISIONS as REVISIONS


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="generate or inspect event files", description="Event data sets.")
    verbs = p.add_subparsers(dest="data_command", metavar="<verb>", required=True)
    synth = verbs.add_parser(
        "synth",
        help="generate synthetic LArTPC events",
        description="Generate physics-inspired LArTPC events (5 PILArNet classes) into a chunked HDF5 file "
        "(--layout pimm), or into PILArNet-M shards with variable-length point/cluster rows (--layout pilarnet). "
        "Deterministic per (seed, event index). An existing file is never replaced unless --overwrite is given, "
        "and then only one that pimm data synth wrote.",
    )
    synth.add_argument("--out", type=Path, required=True,
                       help="output .h5 file; with --layout pilarnet also a directory (shards in OUT/SPLIT/)")
    synth.add_argument("--events", type=int, required=True, help="number of events")
    synth.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    synth.add_argument("--overwrite", action="store_true",
                       help="replace --out (or its shards) when they exist and pimm data synth wrote them; any other "
                       "existing file is still refused")
    synth.add_argument("--layout", choices=("pimm", "pilarnet"), default="pimm",
                       help="pimm: pimm's event file (type='LArTPCDataset'); pilarnet: PILArNet-M's layout "
                       "(type='PILArNetDataset'). Default pimm")
    synth.add_argument("--revision", choices=REVISIONS, default="v2",
                       help="PILArNet cluster columns: v1 (5, no pid) or v2/v3 (6, with pid; cluster_extra 5 or 6 "
                       "per cluster); default v2")
    synth.add_argument("--points-per-event", dest="points_per_event", type=int, default=None, metavar="N",
                       help="PILArNet: about N points per event (real PILArNet-M: ~4,000), each generated point "
                       "spread over neighbouring voxels; default: one voxel per generated point (~600)")
    synth.add_argument("--shards", type=int, default=1, help="PILArNet shards to split the events into (default 1)")
    synth.add_argument("--split", default="train", help="PILArNet split directory name under --out (default train)")
    synth.set_defaults(run=run_synth)
    describe = verbs.add_parser("describe", help="print the identity and contents of an event file or PILArNet shards")
    describe.add_argument("path", type=Path, help="a pimm event file, or a PILArNet shard or directory of shards")
    describe.add_argument("--split", default="train", help="PILArNet: shards <path>/*SPLIT/*.h5 (default train)")
    describe.add_argument("--revision", choices=REVISIONS, default=None,
                          help="PILArNet: the files' revision (default: detected: v1 without cluster_extra, v3 "
                          "with 6 cluster_extra values per cluster, else v2)")
    describe.set_defaults(run=run_describe)


def run_synth(args: argparse.Namespace) -> int:
    # deferred: the data modules load numpy and h5py, which `pimm --help` does not need
    from pimm.data.event_format import describe
    from pimm.data.pilarnet_file import describe_pilarnet
    from pimm.data.synth import ENOUGH_POINTS, MAX_COPIES, write_dataset, write_pilarnet

    start = time.perf_counter()
    if args.points_per_event is not None and args.layout != "pilarnet":
        raise DataError(f"--points-per-event {args.points_per_event} applies to --layout pilarnet; pimm's own "
                        "event files are written at the generator's density: add --layout pilarnet or leave it out")
    if args.layout == "pilarnet":
        shards = write_pilarnet(args.out, args.events, args.seed, args.revision, args.shards, args.split,
                                args.points_per_event, overwrite=args.overwrite)
        path = args.out
        info = describe_pilarnet(path, args.split, args.revision)
        where = f"{len(shards)} {args.revision} shard(s) under {path}"
    else:
        path = write_dataset(args.out, args.events, args.seed, overwrite=args.overwrite)
        info = describe(path)
        where = str(path)
    print(
        f"wrote {info['num_events']} events ({info['num_points']} points) to {where} "
        f"in {time.perf_counter() - start:.1f}s; content hash {info['content_hash'][:16]}"
    )
    mean_points = info["num_points"] / max(info["num_events"], 1)
    if args.points_per_event is not None and mean_points < ENOUGH_POINTS * args.points_per_event:
        print(f"pimm data synth: the events have {mean_points:,.0f} points on average, fewer than --points-per-event "
              f"{args.points_per_event}: the generator spreads each of its points over at most {MAX_COPIES} voxels, "
              "so an event has at most that many times its own points; ask for fewer points per event to get what "
              "you ask for", file=sys.stderr)
    return 0


def run_describe(args: argparse.Namespace) -> int:
    # deferred: the data modules load numpy and h5py, which `pimm --help` does not need
    from pimm.data.event_format import describe
    from pimm.data.pilarnet_file import describe_pilarnet, is_pilarnet

    info = describe_pilarnet(args.path, args.split, args.revision) if is_pilarnet(args.path) else describe(args.path)
    print(json.dumps(info, indent=2, default=str))
    return 0
