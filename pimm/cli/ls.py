"""`pimm ls [dir]`: list the configs that `--train.config` accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

from pimm.config import list_configs
from pimm.config.paths import config_roots
from pimm.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("ls", help="list configs", description="List configs usable with `pimm launch --train.config`.")
    p.add_argument("dir", nargs="?", type=Path, help="a config folder (default: ./configs and pimm's configs/)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    roots = [args.dir] if args.dir else config_roots()
    for root in roots:
        if not root.is_dir():
            raise ConfigError(f"config folder {root} does not exist")
        print(f"{root}:")
        for name in list_configs(root):
            print(f"  {name}")
    return 0
