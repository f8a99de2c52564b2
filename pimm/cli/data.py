"""`pimm data synth` and `pimm data describe`: generate and inspect HDF5 event files."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="generate or inspect event files", description="Event data sets.")
    verbs = p.add_subparsers(dest="data_command", metavar="<verb>", required=True)
    synth = verbs.add_parser(
        "synth",
        help="generate synthetic LArTPC events",
        description="Generate physics-inspired LArTPC events (5 PILArNet classes) into a chunked HDF5 file. "
        "Deterministic per (seed, event index).",
    )
    synth.add_argument("--out", type=Path, required=True, help="output .h5 file")
    synth.add_argument("--events", type=int, required=True, help="number of events")
    synth.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    synth.set_defaults(run=run_synth)
    describe = verbs.add_parser("describe", help="print the identity and contents of an event file")
    describe.add_argument("path", type=Path)
    describe.set_defaults(run=run_describe)


def run_synth(args: argparse.Namespace) -> int:
    from pimm.data.synth import describe, write_dataset

    start = time.perf_counter()
    path = write_dataset(args.out, args.events, args.seed)
    info = describe(path)
    print(
        f"wrote {info['num_events']} events ({info['num_points']} points) to {path} "
        f"in {time.perf_counter() - start:.1f}s; content hash {info['content_hash'][:16]}"
    )
    return 0


def run_describe(args: argparse.Namespace) -> int:
    from pimm.data.dataset import validate_event_file
    from pimm.data.synth import describe

    validate_event_file(args.path)
    print(json.dumps(describe(args.path), indent=2, default=str))
    return 0
