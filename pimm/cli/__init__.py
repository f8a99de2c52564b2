"""`pimm` command line: one module per verb, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import sys

from pimm import __version__
from pimm.cli import bench, data, evaluate, export, launch, ls, predict, show, submit, validate_scaling
from pimm.errors import EXIT_BAD_INPUT, PimmError
from pimm.launch.forked_rank import check_rank_start


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pimm",
        description="Distributed training for 3D point clouds from particle-imaging detectors.",
        epilog="Run `pimm <command> --help` for the flags of each command.",
    )
    parser.add_argument("--version", action="version", version=f"pimm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for module in (launch, submit, ls, data, bench, validate_scaling, export, show, evaluate, predict):
        module.add_parser(sub)
    return parser


STARTS_RANKS = ("launch", "submit", "test", "predict", "validate-scaling", "bench")  # through torchrun


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after a bare `--` is config overrides, kept away from argparse
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    args.overrides = overrides
    if overrides and args.command not in ("launch", "submit", "bench", "validate-scaling", "test"):
        print(f"pimm: error: `pimm {args.command}` takes no `-- key=value` overrides", file=sys.stderr)
        return 2
    try:
        if args.command in STARTS_RANKS:
            check_rank_start()
        return int(args.run(args) or 0)
    except PimmError as exc:
        print(f"pimm: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("pimm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
