"""`pimm show`: an event display of one event of a prediction file or a data file."""

from __future__ import annotations

import argparse
from pathlib import Path

# the --color-by choices, as pimm.display.COLOR_BY (not imported: numpy and matplotlib stay out of `pimm --help`)
COLOR_BY = ("class", "instance", "interaction", "pid", "error")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "show",
        help="draw one event: truth, prediction and misclassified points",
        description="Draw one event as a PNG (3D and xy/xz/yz projections) or an interactive 3D HTML page. "
        "From a prediction file (`pimm test`/`pimm predict`): truth and prediction side by side with the "
        "misclassified points in red and the event's accuracy. From a data file (a pimm event file, or "
        "PILArNet-M shards): the truth. --color-by picks what colours the points.",
    )
    p.add_argument("path", type=Path,
                   help="a prediction file, a pimm event file, or a PILArNet-M shard or directory of shards")
    p.add_argument("--event", type=int, required=True, metavar="ID",
                   help="event id: the dataset index pimm logs (for a data file: with the reader's default "
                   "selection, every event with a point)")
    p.add_argument("--out", type=Path, default=None,
                   help="file to write (default: display/<name>-event_<ID>.png, or .html with --html, in the folder "
                   "of the file drawn; display/<split>-event_<ID>.png inside a directory of PILArNet-M shards; "
                   "-<color-by> and -side_by_side added before the suffix for those views)")
    p.add_argument("--html", action="store_true",
                   help="write an interactive 3D HTML page (self-contained) instead of the PNG; needs plotly: "
                   "pip install -e '.[display]'")
    p.add_argument("--split", default="train", help="PILArNet directory: shards <path>/*SPLIT/*.h5 (default train)")
    p.add_argument("--color-by", choices=COLOR_BY, default="class",
                   help="class (default): truth, prediction and the misclassified points; instance: a prediction "
                   "file's predicted instances (needs a Panoptic model's predictions), or a PILArNet-M file's true "
                   "particles; interaction, pid: a PILArNet-M file's true interactions, particle types; error: "
                   "points of the wrong class (red) or the wrong instance (blue) of a labelled prediction file")
    p.add_argument("--side-by-side", action="store_true",
                   help="truth and prediction in two panels (instances: a predicted instance matched to a true "
                   "one takes its colour); with --color-by error, before the errors. Needs a labelled prediction "
                   "file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # deferred: numpy, h5py and matplotlib behind it, kept out of `pimm --help`
    from pimm.display import default_output, draw_png, load_event, make_output_folder, require_plotly, write_html

    if args.html:
        require_plotly()  # before reading anything
    out = args.out or default_output(args.path, args.event, args.split, args.html, args.color_by,
                                     args.side_by_side)
    view = load_event(args.path, args.event, args.split, args.color_by, args.side_by_side)
    if args.out is None:
        make_output_folder(out)  # after the event was found: a refused input leaves no folder behind
    written = write_html(view, out) if args.html else draw_png(view, out)
    print(written)
    return 0
