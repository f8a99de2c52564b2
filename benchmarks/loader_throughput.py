"""Data path alone: events/s of HDF5 -> DataLoader for one rank, with no model.

The loader is pimm's own: the training data set of the config, `GlobalBatchSampler` for this
rank, `collate_events`, and the DataLoader settings of `Trainer._loader` (per-rank workers,
persistent workers, prefetch) through the batch plan of the world size. `throughput.py` starts
one of these per rank at the same time, so ranks compete for the CPUs as they do in training.

    python benchmarks/loader_throughput.py --config demo/semseg --world-size 2 --rank 0 [key=value ...]

Prints one JSON line: events/s per rank after `--warmup-batches` (which drain the prefetch queue).
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
from pimm.config.paths import config_roots
from pimm.data.dataset import build_dataset
from pimm.data.sampler import GlobalBatchSampler
from pimm.distributed.batch import plan_batches
from pimm.engine.trainer import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo/semseg", help="pimm config name or path (default demo/semseg)")
    p.add_argument("--world-size", type=int, default=1, help="world size the batch plan is made for")
    p.add_argument("--rank", type=int, default=0, help="the rank whose share of each global batch is loaded")
    p.add_argument("--batches", type=int, default=100, help="batches loaded in total (default 100)")
    p.add_argument("--warmup-batches", type=int, default=None,
                   help="batches not timed (default: 2 x the prefetched batches + 2)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for `pimm launch`")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = apply_overrides(load_config(resolve_config_path(args.config, config_roots())),
                          parse_overrides(args.overrides))
    plan = plan_batches(cfg, args.world_size)
    seed = int(cfg["seed"])
    dataset = build_dataset(cfg["data"]["train"], seed=seed)
    sampler = GlobalBatchSampler(len(dataset), plan.global_batch_size, args.world_size, args.rank, seed)
    # pimm's loader factory needs only the batch plan and the device from the trainer
    stand_in = SimpleNamespace(plan=plan, env=SimpleNamespace(device=torch.device("cpu")))
    loader = Trainer._loader(stand_in, dataset, sampler)
    prefetched = (loader.prefetch_factor or 0) * loader.num_workers
    warmup = args.warmup_batches if args.warmup_batches is not None else 2 * prefetched + 2
    if not 0 <= warmup < args.batches:
        raise SystemExit(f"loader_throughput.py: need 0 <= warmup batches ({warmup}) < --batches ({args.batches})")

    loaded, events, epoch = 0, 0, 0
    start = time.perf_counter()
    t0 = start
    while loaded < args.batches:
        sampler.set_cursor(epoch)
        for batch in loader:
            loaded += 1
            if loaded == warmup:
                t0 = time.perf_counter()
            elif loaded > warmup:
                events += len(batch["offset"])
            if loaded >= args.batches:
                break
        epoch += 1
    seconds = time.perf_counter() - t0
    print(json.dumps({
        "world_size": args.world_size, "rank": args.rank, "per_rank_batch": plan.events_per_rank,
        "workers_per_rank": loader.num_workers, "prefetch_factor": loader.prefetch_factor,
        "batches": args.batches, "warmup_batches": warmup, "events": events, "seconds": seconds,
        "events_per_s": events / seconds if seconds > 0 else float("nan"),
        "startup_s": t0 - start,
    }), flush=True)


if __name__ == "__main__":
    main()
