"""Test-time throughput: pimm's evaluation loop against a hand-written `torch.no_grad` loop over the
same events in the same run, and the cost of writing predictions.

    python benchmarks/evaluate.py [--config demo/semseg] [--events 400] [--ranks 1,2] [--repeats 3]
                                  [--wait-quiet 120]

For each rank count, torchrun starts that many gloo processes; each builds the config's model
(fresh weights: speed does not depend on them), its task and strategy, and evaluates the same
synthetic file three ways, interleaved `--repeats` times in ABBA order (the median time of each
counts, printed with the spread [lowest..highest] of the repeats):

    pimm         pimm.engine.evaluation.evaluate_events: the loop `pimm test` and validation run
    hand         model(coord, feat, offset), cross-entropy, argmax and a bincount confusion, then one
                 all_reduce: the least an evaluation can do
    predictions  evaluate_events writing every point's prediction to this rank's part, plus rank 0's
                 merge into one file (what `pimm test --save-predictions` adds)

Prints events/s per column and the ratios pimm / hand (goal >= 0.95) and the predictions' added
time as a fraction of the evaluation's (goal <= 0.15), both as the median of one repeat's ratio.
The slowest rank's time counts. With `--wait-quiet`, rank 0 waits for a quiet machine before each
loop while the other ranks wait for it.
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

from _timing import QuietGate, Spread, abba, add_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo/semseg", help="pimm config name or path (default demo/semseg)")
    p.add_argument("--events", type=int, default=400, help="synthetic events evaluated (default 400)")
    p.add_argument("--batch", type=int, default=8, help="events per rank and batch (default 8)")
    p.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (default 1,2)")
    add_arguments(p, repeats=3, what="runs of each of the three loops per rank count")
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

    from pimm.config import load_config, resolve_config_path
    from pimm.config.paths import config_roots
    from pimm.config.validate import model_classes
    from pimm.data.collate import collate_events
    from pimm.data.dataset import build_dataset
    from pimm.data.predictions import merge_predictions
    from pimm.data.sampler import ShardedEvalSampler
    from pimm.distributed.env import all_reduce_max, all_reduce_sum, barrier, destroy_distributed, init_distributed
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
        writer, on_batch = prediction_writer(part, dataset, model_classes(cfg), "test", False,
                                             {"rank": env.rank, "world_size": env.world_size})
        evaluate_events(module, strategy, task, dataset, loader, sampler, env.device, on_batch=on_batch)
        writer.close()
        barrier()
        if env.is_main:
            merged = parts / "merged.h5"
            merged.unlink(missing_ok=True)
            merge_predictions([parts / f"part{r}.h5" for r in range(env.world_size)], merged)
        barrier()

    loops = {"pimm": pimm_loop, "hand": hand_loop, "predictions": predictions_loop}
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    gate = QuietGate.from_args(args, say=lambda line: print(line, flush=True))
    hand_loop()  # warm-up: first-touch allocations and the HDF5 page cache
    for rep, name in abba(list(loops), args.repeats):
        if env.is_main:
            gate.before(f"{env.world_size} rank(s) repeat {rep + 1}/{args.repeats} {name}")
        barrier()
        start = time.perf_counter()
        loops[name]()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        seconds[name].append(float(all_reduce_max(elapsed)))  # the slowest rank's time
    if env.is_main:
        result = {"world_size": env.world_size, "events": len(dataset), "seconds": seconds,
                  "quiet_waits_s": [w.seconds for w in gate.waits]}
        args.out.write_text(json.dumps(result) + "\n")
    destroy_distributed()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        rank_main(args)
        # leave as pimm's ranks do (pimm.engine.failure): without C++ static destructors, where gloo's
        # threads of the DDP module still alive abort a rank at interpreter exit ("terminate called without
        # an active exception", twice in CI under load) after its result was written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
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
                    "--batch", str(args.batch), "--repeats", str(args.repeats), "--wait-quiet", str(args.wait_quiet),
                    "--quiet-cores", str(args.quiet_cores)]
            subprocess.run(argv, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            rows.append(json.loads(out.read_text()))
    waited = sum(sum(r["quiet_waits_s"]) for r in rows)
    print(f"median of {args.repeats} repeats [lowest..highest]; pimm/hand and predictions added: each repeat's "
          "own ratio" + (f"; waited {waited:.0f}s in all for a quiet machine" if args.wait_quiet > 0 else ""))
    w = 22 if args.repeats > 1 else 10
    print(f"{'ranks':>5} {'events':>6} {'pimm ev/s':>{w}} {'hand ev/s':>{w}} {'pred ev/s':>{w}} "
          f"{'pimm/hand':>{w}} {'predictions added':>{w + 4}}")
    for r in rows:
        t = r["seconds"]
        rate = {k: Spread.of([r["events"] / s for s in t[k]]) for k in ("pimm", "hand", "predictions")}
        ratio = Spread.of([h / p for p, h in zip(t["pimm"], t["hand"])])  # rates: pimm/hand = hand time / pimm time
        added = Spread.of([(pr - p) / p for p, pr in zip(t["pimm"], t["predictions"])])
        print(f"{r['world_size']:>5} {r['events']:>6} {rate['pimm'].format():>{w}} {rate['hand'].format():>{w}} "
              f"{rate['predictions'].format():>{w}} {ratio.format('.3f'):>{w}} {added.format('.1%'):>{w + 4}}")


if __name__ == "__main__":
    main()
