"""Blocking time of an asynchronous checkpoint save vs a synchronous save of the same state.

Measures what the training loop waits for: the CPU copy of model + optimizer state (async), or
the whole write (sync: DCP trainer state + weights.pth + manifest + rename). Single process,
through the trainer's own checkpoint components and staging (pimm.checkpoint.state.capture).

    .venv/bin/python benchmarks/checkpoint_save.py [--channels 256] [--repeats 5] [--wait-quiet 120]

The two modes alternate (async, sync, sync, async, ...), and each line gives the median of the
repeats with their spread [lowest..highest].
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _timing import QuietGate, Spread, abba, add_arguments

from pimm.checkpoint.manager import CheckpointManager
from pimm.checkpoint.state import ModelState, OptimizerState, Packed, capture
from pimm.distributed.strategy import SingleProcess
from pimm.models import build_model


def one_save(manager: CheckpointManager, components: dict, step: int, blocking: bool) -> tuple[float, float]:
    """(seconds the caller was blocked, seconds until the checkpoint was complete)."""
    manager.wait()  # the previous write is not part of this save's blocking time
    start = time.perf_counter()
    model_state, dcp_state = capture(components, True, manager.stage)
    manager.save(step, model_state, dcp_state, blocking=blocking)
    blocked = time.perf_counter() - start
    manager.wait()
    return blocked, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=256, help="model width (256 -> about 3.2M parameters)")
    add_arguments(parser, repeats=5, what="saves of each mode")
    args = parser.parse_args()
    gate = QuietGate.from_args(args)
    torch.manual_seed(0)
    model = build_model(dict(type="PointSegNet", channels=args.channels, grid_sizes=[2, 4, 8, 16, 8, 4]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.rand(100, 3) * 256, torch.rand(100, 4), torch.tensor([100])).sum().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    components = {
        "model": ModelState(SingleProcess(), model),
        "optimizer": OptimizerState(model, optimizer),
        "trainer": Packed("the trainer state", lambda: {"step": 1}, lambda _: None),
    }
    with tempfile.TemporaryDirectory() as tmp:
        managers = {mode: CheckpointManager(Path(tmp) / mode, rank=0, world_size=1, keep_last=1,
                                            async_save=mode == "async") for mode in ("async", "sync")}
        runs: dict[str, list[tuple[float, float]]] = {"async": [], "sync": []}
        for rep, mode in abba(("async", "sync"), args.repeats):
            gate.before(f"repeat {rep + 1}/{args.repeats} {mode}")
            runs[mode].append(one_save(managers[mode], components, rep + 1, blocking=False))
        size = sum(p.stat().st_size for p in (Path(tmp) / "sync").rglob("*") if p.is_file())
    print(f"model {params / 1e6:.2f}M parameters, checkpoint {size / 2**20:.1f} MiB, "
          f"median of {args.repeats} [lowest..highest]")
    print(f"{'mode':6} | {'training blocked (ms)':>26} | {'until complete (ms)':>26}")
    for mode, saves in runs.items():
        blocked, total = (Spread.of([1e3 * save[k] for save in saves]) for k in (0, 1))
        print(f"{mode:6} | {blocked.format():>26} | {total.format():>26}")
    # the stall of each repeat: its async save's blocking time over its sync save's
    stall = Spread.of([a[0] / max(s[0], 1e-9) for a, s in zip(runs["async"], runs["sync"])])
    print(f"the async stall is {stall.format('.1%')} of a synchronous save's blocking time (goal <= 10%)")
    gate.report()


if __name__ == "__main__":
    main()
