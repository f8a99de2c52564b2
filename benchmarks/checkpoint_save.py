"""Blocking time of an asynchronous checkpoint save vs a synchronous save of the same state.

Measures what the training loop waits for: the CPU copy of model + optimizer state (async), or
the whole write (sync: DCP trainer state + weights.pth + manifest + rename). Single process,
through the trainer's own checkpoint components and staging (pimm.checkpoint.state.capture).

    .venv/bin/python benchmarks/checkpoint_save.py [--channels 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

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
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
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
        results = {}
        for mode, is_async in (("async", True), ("sync", False)):
            manager = CheckpointManager(Path(tmp) / mode, rank=0, world_size=1, keep_last=1, async_save=is_async)
            runs = [one_save(manager, components, step, blocking=False) for step in range(1, args.repeats + 1)]
            results[mode] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        size = sum(p.stat().st_size for p in (Path(tmp) / "sync").rglob("*") if p.is_file())
    print(f"model {params / 1e6:.2f}M parameters, checkpoint {size / 2**20:.1f} MiB, median of {args.repeats}")
    print(f"{'mode':6} | {'training blocked (ms)':>22} | {'until complete (ms)':>20}")
    for mode, (blocked, total) in results.items():
        print(f"{mode:6} | {blocked * 1e3:22.1f} | {total * 1e3:20.1f}")
    ratio = results["sync"][0] / max(results["async"][0], 1e-9)
    print(f"async blocks training {ratio:.1f}x less than sync: the stall is {100 / ratio:.1f}% of a synchronous "
          "save (goal <= 10%)")


if __name__ == "__main__":
    main()
