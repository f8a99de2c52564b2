"""Baseline for the throughput benchmark: a minimal hand-written DDP training loop.

This is the loop a competent person writes in one screen (nanoGPT style), using pimm only for
the pieces both sides must share: the config file, the model, the dataset class and the collate
function. Everything else is plain PyTorch: DistributedSampler, DataLoader, DDP, F.cross_entropy
over all points of the batch, the config's optimizer/lr/schedule (torch's fused optimizer unless the
config names an implementation, as pimm's) and gradient clipping.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/handwritten_ddp.py \
        --config demo/semseg --steps 120 --warmup 20 [key=value ...]

Rank 0 prints one JSON line: steady-state events/s, measured on the wall clock from the end of
step `warmup` to the end of step `steps` (events = global batch x (steps - warmup)).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
from pimm.config.paths import config_roots
from pimm.data.collate import collate_events
from pimm.data.dataset import build_dataset
from pimm.models import build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo/semseg", help="pimm config name or path (default demo/semseg)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps in total (default 120)")
    p.add_argument("--warmup", type=int, default=20, help="steps excluded from the measurement (default 20)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for `pimm launch`")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"need 0 <= --warmup < --steps, got warmup={args.warmup} steps={args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = apply_overrides(load_config(resolve_config_path(args.config, config_roots())),
                          parse_overrides(args.overrides))

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    master = rank == 0
    seed = int(cfg["seed"])
    batch = int(cfg["batch_size"]) // world  # the config's batch is global
    workers = int(cfg.get("num_worker", 0)) // world  # and so are its loader workers

    train = dict(cfg["data"]["train"])
    dataset = build_dataset(train, seed=seed)  # the config's reader (pimm file or PILArNet-M), as pimm builds it
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, collate_fn=collate_events,
                        drop_last=True, persistent_workers=workers > 0)

    torch.manual_seed(seed)
    model = build_model(cfg["model"])
    if world > 1:
        model = DistributedDataParallel(model)
    opt_cfg = dict(cfg["optimizer"])
    if "fused" not in opt_cfg and "foreach" not in opt_cfg:
        opt_cfg["fused"] = True  # torch's fused update kernel, as nanoGPT asks for it and as pimm builds it
    optimizer = getattr(torch.optim, opt_cfg.pop("type"))(model.parameters(), **opt_cfg)
    sched_cfg = dict(cfg.get("scheduler") or {})
    scheduler = None
    if sched_cfg.get("type") == "OneCycleLR":
        sched_cfg.pop("type")
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, total_steps=args.steps, **sched_cfg)
    elif sched_cfg:
        raise SystemExit(f"handwritten_ddp.py: scheduler {sched_cfg['type']} is not supported here")
    clip = cfg.get("clip_grad")

    step, epoch, t0, loss = 0, 0, time.perf_counter(), torch.zeros(())
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for b in loader:
            logits = model(b["coord"], b["feat"], b["offset"])
            loss = F.cross_entropy(logits, b["segment"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            step += 1
            if step == args.warmup:
                t0 = time.perf_counter()
            if step >= args.steps:
                break
        epoch += 1
    seconds = time.perf_counter() - t0
    final_loss = loss.item()

    if master:
        events = (args.steps - args.warmup) * batch * world
        print(json.dumps({
            "impl": "handwritten", "world_size": world, "global_batch": batch * world, "per_rank_batch": batch,
            "workers_per_rank": workers, "torch_threads": torch.get_num_threads(), "steps": args.steps,
            "warmup": args.warmup, "seconds": seconds, "events_per_s": events / seconds if seconds > 0 else math.nan,
            "final_loss": final_loss,
        }), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
