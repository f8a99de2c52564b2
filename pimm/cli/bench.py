"""`pimm bench memory`: memory per rank and step time of DDP against FSDP2 at several world sizes.

The input is checked here, before any process starts; the runs, the table and the chart are in
benchmarks/memory.py of pimm's source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
from pimm.config.paths import REPO_ROOT, config_roots
from pimm.config.validate import check_config
from pimm.distributed.batch import plan_batches
from pimm.errors import ConfigError, LaunchError
from pimm.names import NOT_IMPLEMENTED_STRATEGIES, PARALLEL_STRATEGIES

BENCHMARKS = REPO_ROOT / "benchmarks"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (memory per rank: DDP vs FSDP2)",
                       description="Measure pimm. Everything after a bare `--` is a key=value config override.")
    verbs = p.add_subparsers(dest="bench_command", metavar="<benchmark>", required=True)
    memory = verbs.add_parser(
        "memory",
        help="bytes of parameters, gradients and optimizer state per rank, peak memory and step time",
        description="For each world size and strategy, train a few steps on generated PILArNet-M-like events with "
        "pimm's model, strategy and optimizer, then report per rank the bytes of parameters, gradients and optimizer "
        "state held (local shards), the peak memory (CUDA max_memory_allocated, or peak RSS on CPU, which "
        "includes the runtime) and the median step time, against the ideal 1/N of DDP's. Writes memory.json, "
        "memory.md and memory.png to --out.",
        usage="pimm bench memory --train.config NAME_OR_PATH [--ranks 1,2,4] [--strategies ddp,fsdp2] "
        "[--steps K] [--out DIR] [-- key=value ...]",
    )
    memory.add_argument("--train.config", dest="config", required=True, metavar="NAME_OR_PATH",
                        help="config name under configs/ (e.g. bench/memory_large) or a path to a .py config")
    memory.add_argument("--ranks", default="1,2,4", metavar="N,N,...",
                        help="comma-separated world sizes (default 1,2,4)")
    memory.add_argument("--strategies", default="ddp,fsdp2", metavar="NAME,...",
                        help="comma-separated parallel.strategy values run at every world size > 1 (default "
                        "ddp,fsdp2; world size 1 is one plain-model run)")
    memory.add_argument("--steps", default="5", metavar="K", help="measured optimizer steps per run (default 5)")
    memory.add_argument("--warmup", default="2", metavar="W", help="optimizer steps before measuring (default 2)")
    memory.add_argument("--points-per-event", dest="points_per_event", default="128", metavar="P",
                        help="points of each random event (default 128); the global batch is the config's "
                        "batch_size")
    memory.add_argument("--out", type=Path, default=Path("bench_results/memory"), metavar="DIR",
                        help="folder for memory.json, memory.md, memory.png and the runs' logs "
                        "(default bench_results/memory)")
    memory.add_argument("--timeout", default="900", metavar="SECONDS",
                        help="seconds before one run is killed (default 900)")
    memory.set_defaults(run=run_memory)


def _count(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise LaunchError(f"{flag} must be an integer >= {minimum}, got {text!r}")
    return value


def parse_ranks(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, without repeats); anything but positive integers is refused."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise LaunchError(f"--ranks must be comma-separated positive integers (world sizes), e.g. 1,2,4; got {text!r}")
    return sorted({int(part) for part in parts})


def parse_strategies(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name in NOT_IMPLEMENTED_STRATEGIES:
            raise LaunchError(f"--strategies names {name!r}: not implemented in pimm; valid strategies: "
                              f"{', '.join(PARALLEL_STRATEGIES)}")
        if name not in PARALLEL_STRATEGIES:
            raise LaunchError(f"--strategies names unknown strategy {name!r}; valid strategies: "
                              f"{', '.join(PARALLEL_STRATEGIES)} (comma-separated)")
    if not names:
        raise LaunchError(f"--strategies needs at least one of {', '.join(PARALLEL_STRATEGIES)}, got {text!r}")
    return list(dict.fromkeys(names))


def resolve(config: str, overrides: list[str], ranks: list[int], strategies: list[str]) -> dict:
    """The resolved config, checked against every world size (batch split) and, for FSDP2, the model."""
    cfg = apply_overrides(load_config(resolve_config_path(config, config_roots())), parse_overrides(overrides))
    check_config(cfg)
    for world in ranks:
        plan_batches(cfg, world)
    if "fsdp2" in strategies:
        from pimm.distributed.strategy import check_strategy_fits  # deferred: imports torch; FSDP2 only

        check_strategy_fits({**cfg, "parallel": {**(cfg.get("parallel") or {}), "strategy": "fsdp2"}})
    return cfg


def load_benchmark(name: str):
    """benchmarks/<name>.py of the source checkout, imported as a module."""
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise LaunchError(f"`pimm bench {name}` needs pimm's source checkout: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"pimm_benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_memory(args: argparse.Namespace) -> int:
    ranks = parse_ranks(args.ranks)
    strategies = parse_strategies(args.strategies)
    steps = _count("--steps", args.steps, 1)
    warmup = _count("--warmup", args.warmup, 0)
    points = _count("--points-per-event", args.points_per_event, 1)
    timeout = _count("--timeout", args.timeout, 1)
    cfg = resolve(args.config, args.overrides, ranks, strategies)
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a folder; name a folder for the results")
    return load_benchmark("memory").run(
        cfg, args.config.removesuffix(".py"), args.overrides, ranks, strategies, steps, warmup, points,
        args.out.absolute(), timeout,
    )
