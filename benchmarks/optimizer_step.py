"""pimm's optimizer (build_optimizer: torch's fused implementation unless the config names one) against the
same config built with torch's default implementation, on the parameters of real configs, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_step.py [--config bench/panoptic_detector
        bench/panoptic_semseg] [--steps 20] [--threads 1] [--repeats 5 --wait-quiet 60] [--out FILE]

For each config: its model is built on the CPU (the config's seed), every trainable parameter gets a
gradient drawn from a fixed generator, and two optimizers are built from the config's `optimizer`: pimm's
(`pimm.engine.optim.build_optimizer`) and torch's default (the same dict with `fused` and `foreach` left to
torch: a Python loop over the parameters on CPU). Each side takes `--steps` steps from the same start, timed
per step after one warm-up step; `--repeats` alternates the sides in ABBA order. The ratio is torch's
default over pimm's median step (above 1: pimm faster). Before anything is timed, both sides take three
steps from the same parameters and gradients and their parameters are compared (the largest difference is
printed: the same update, computed in another order).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _timing import OtherLoad, QuietGate, Spread, abba, add_arguments, write_results

from pimm.config import load_config, resolve_config_path
from pimm.config.paths import config_roots
from pimm.engine.optim import OPTIMIZERS, build_optimizer
from pimm.models import build_model

SIDES = ("pimm", "torch default")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", default=["bench/panoptic_detector", "bench/panoptic_semseg"],
                   help="configs whose model and optimizer are measured (default: the panoptic benchmark's two)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per measurement (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    add_arguments(p, repeats=3, what="measure both sides N times")
    args = p.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        p.error(f"--steps and --threads need whole numbers >= 1, got {args.steps} and {args.threads}")
    return args


def parameters_with_gradients(cfg: dict) -> list[torch.nn.Parameter]:
    """The config's model's trainable parameters, each with a gradient from a generator seeded by the config."""
    torch.manual_seed(int(cfg.get("seed", 0)))
    params = [p for p in build_model(cfg["model"]).parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(int(cfg.get("seed", 0)))
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    return params


def optimizers(cfg: dict, params: list[torch.nn.Parameter]) -> dict[str, torch.optim.Optimizer]:
    """Each side's optimizer over its own copy of `params` (same values, same gradients)."""
    torch_default = {k: v for k, v in cfg["optimizer"].items() if k not in ("fused", "foreach")}
    sides = {}
    for side in SIDES:
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for copy, p in zip(copies, params):
            copy.grad = p.grad.clone()
        sides[side] = (build_optimizer(cfg["optimizer"], copies) if side == "pimm"
                       else OPTIMIZERS.build(torch_default, copies))
    return sides


def largest_difference(sides: dict[str, torch.optim.Optimizer]) -> float:
    pimm_params, torch_params = ([p for g in sides[s].param_groups for p in g["params"]] for s in SIDES)
    return max(float((a - b).detach().abs().max()) for a, b in zip(pimm_params, torch_params))


def median_step_ms(optimizer: torch.optim.Optimizer, steps: int) -> float:
    optimizer.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(args: argparse.Namespace, config: str, gate: QuietGate) -> dict:
    cfg = load_config(resolve_config_path(config, config_roots()))
    params = parameters_with_gradients(cfg)
    check = optimizers(cfg, params)
    for _ in range(3):
        for optimizer in check.values():
            optimizer.step()
    difference = largest_difference(check)
    sides = optimizers(cfg, params)
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    with OtherLoad() as other:
        for rep, side in abba(SIDES, args.repeats):
            gate.before(f"{config}, repeat {rep + 1}/{args.repeats} {side}")
            samples[side].append(median_step_ms(sides[side], args.steps))
    ms = {side: Spread.of(values) for side, values in samples.items()}
    implementation = {side: {k: sides[side].defaults.get(k) for k in ("fused", "foreach")} for side in SIDES}
    return {"config": config, "optimizer": cfg["optimizer"]["type"], "tensors": len(params),
            "elements": sum(p.numel() for p in params), "implementation": implementation, "ms": ms,
            "ratio": ms["torch default"].median / ms["pimm"].median, "max_abs_difference": difference,
            "other_cores": other.cores}


def table(rows: list[dict]) -> str:
    head = (f"{'config':>28} {'optimizer':>9} {'tensors':>7} {'elements':>9} | {'pimm ms':>20} "
            f"{'torch default ms':>20} {'ratio':>6} | {'max difference':>14} {'other cores':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:>28} {r['optimizer']:>9} {r['tensors']:>7} {r['elements']:>9} | "
                     f"{r['ms']['pimm'].format('.2f'):>20} {r['ms']['torch default'].format('.2f'):>20} "
                     f"{r['ratio']:>6.2f} | {r['max_abs_difference']:>14.1e} {OtherLoad.text(r['other_cores']):>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"optimizer step benchmark: {args.steps} steps per measurement, {torch.get_num_threads()} torch threads, "
          f"{args.repeats} repeats; ratio = torch default ms / pimm ms (> 1: pimm faster)", flush=True)
    gate = QuietGate.from_args(args, say=lambda line: print(line, flush=True))
    rows = [measure(args, config, gate) for config in args.config]
    print(table(rows))
    gate.report()
    write_results(args.out, args, [{**r, "ms": {s: v.as_dict() for s, v in r["ms"].items()}} for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
