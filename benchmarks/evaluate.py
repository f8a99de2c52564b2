"""Test-time throughput: pimm's evaluation loop against a hand-written `torch.no_grad` loop over the
same events in the same run, and the cost of writing predictions.

    python benchmarks/evaluate.py [--config demo/semseg] [--events 400] [--ranks 1,2] [--repeats 3]

For each rank count, torchrun starts that many gloo processes; each builds the config's model
(fresh weights: speed does not depend on them), its task and strategy, and evaluates the same
synthetic file three ways, interleaved `--repeats` times (the best time of each counts):

    pimm         pimm.engine.evaluation.evaluate_events: the loop `pimm test` and validation run
    hand         model(coord, feat, offset), cross-entropy, argmax and a bincount confusion, then one
                 all_reduce: the least an evaluation can do
    predictions  evaluate_events writing every point's prediction to this rank's part, plus rank 0's
                 merge into one file (what `pimm test --save-predictions` adds)

Prints events/s per column and the ratios pimm / hand (goal >= 0.95) and the predictions' added
time as a fraction of the evaluation's (goal <= 0.15). The slowest rank's time counts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo/semseg", help="pimm config name or path (default demo/semseg)")
    p.add_argument("--events", type=int, default=400, help="synthetic events evaluated (default 400)")
    p.add_argument("--batch", type=int, default=8, help="events per rank and batch (default 8)")
    p.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (default 1,2)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the three loops (default 3)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a rank: the data file
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # a rank: where rank 0 writes its JSON line
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from pimm.cli.paths import config_roots
    from pimm.config import load_config, resolve_config_path
    from pimm.data.collate import collate_events
    from pimm.data.dataset import build_dataset
    from pimm.data.predictions import merge_predictions
    from pimm.data.sampler import ShardedEvalSampler
    from pimm.distributed.env import all_reduce_max, all_reduce_sum, barrier, init_distributed
    from pimm.distributed.strategy import build_strategy
    from pimm.engine.evaluation import evaluate_events, prediction_writer
    from pimm.models import build_model
    from pimm.tasks import build_task

    torch.set_num_threads(1)
    env = init_distributed()
    cfg = load_config(resolve_config_path(args.config, config_roots()))
    cfg["data"]["test"] = {"type": "LArTPCDataset", "path": str(args.worker)}
    dataset = build_dataset({**cfg["data"]["test"], "augment": False}, seed=0)
    sampler = ShardedEvalSampler(len(dataset), args.batch, env.world_size, env.rank)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0, collate_fn=collate_events)
    torch.manual_seed(0)
    task, strategy = build_task(cfg), build_strategy(cfg, env)
    module = strategy.wrap(build_model(cfg["model"]), env)
    num_classes = int(cfg["data"]["num_classes"])
    parts = Path(args.out).parent

    def pimm_loop() -> None:
        evaluate_events(module, strategy, task, dataset, loader, sampler, env.device)

    @torch.no_grad()
    def hand_loop() -> None:
        model = strategy.eval_module(module)
        model.eval()
        confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64)
        for batch in loader:
            logits = model(batch["coord"], batch["feat"], batch["offset"])
            F.cross_entropy(logits, batch["segment"], ignore_index=-1)
            valid = batch["segment"] >= 0
            cell = batch["segment"][valid] * num_classes + logits.argmax(1)[valid]
            confusion += torch.bincount(cell, minlength=num_classes * num_classes)
        all_reduce_sum(confusion)

    def predictions_loop() -> None:
        part = parts / f"part{env.rank}.h5"
        writer, on_batch = prediction_writer(part, dataset, cfg, "test", False,
                                             {"rank": env.rank, "world_size": env.world_size})
        evaluate_events(module, strategy, task, dataset, loader, sampler, env.device, on_batch=on_batch)
        writer.close()
        barrier()
        if env.is_main:
            merged = parts / "merged.h5"
            merged.unlink(missing_ok=True)
            merge_predictions([parts / f"part{r}.h5" for r in range(env.world_size)], merged)
        barrier()

    best = {"pimm": float("inf"), "hand": float("inf"), "predictions": float("inf")}
    loops = {"pimm": pimm_loop, "hand": hand_loop, "predictions": predictions_loop}
    hand_loop()  # warm-up: first-touch allocations and the HDF5 page cache
    for _ in range(args.repeats):
        for name, loop in loops.items():
            barrier()
            start = time.perf_counter()
            loop()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            best[name] = min(best[name], float(all_reduce_max(elapsed)))  # the slowest rank's time
    if env.is_main:
        args.out.write_text(json.dumps({"world_size": env.world_size, "events": len(dataset), **best}) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        rank_main(args)
        return
    from pimm.data.synth import write_dataset

    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pimm-bench-eval-") as tmp:
        data = write_dataset(Path(tmp) / "test.h5", args.events, seed=5)
        for world_size in ranks:
            out = Path(tmp) / f"w{world_size}" / "result.json"
            out.parent.mkdir()
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                    str(world_size), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                    str(Path(__file__).resolve()), "--worker", str(data), "--out", str(out), "--config", args.config,
                    "--batch", str(args.batch), "--repeats", str(args.repeats)]
            subprocess.run(argv, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            rows.append(json.loads(out.read_text()))
    print(f"{'ranks':>5} {'events':>6} {'pimm ev/s':>10} {'hand ev/s':>10} {'pred ev/s':>10} "
          f"{'pimm/hand':>9} {'predictions added':>17}")
    for r in rows:
        rate = {k: r["events"] / r[k] for k in ("pimm", "hand", "predictions")}
        print(f"{r['world_size']:>5} {r['events']:>6} {rate['pimm']:>10.1f} {rate['hand']:>10.1f} "
              f"{rate['predictions']:>10.1f} {rate['pimm'] / rate['hand']:>9.3f} "
              f"{(r['predictions'] - r['pimm']) / r['pimm']:>16.1%}")


if __name__ == "__main__":
    main()
