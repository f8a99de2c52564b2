"""PointSegNet against the PointTransformer backbone at equal wall-clock training time.

Each model trains in this process, on the CPU, for the same `--seconds`, then both are evaluated
on the same validation events with the task's meter (pimm's SegmentationMeter):

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/backbones.py [--seconds 120] [--data DIR]
                                                               [--events 2400 --val-events 400]
                                                               [--repeats 3 --wait-quiet 120]

What is held equal: the training events (pimm's LArTPCDataset with the demo's augmentation, in
the same seeded order, packed by `collate_events`), the batch size (the first config's), the
optimizer family (each config's own, AdamW in both demo configs) and the loss (pimm's task).
What each model keeps of its own config: learning rate, weight decay, gradient clipping and the
shape of its OneCycleLR, which is laid over the time budget instead of a step count (the number
of steps a model reaches in the budget is what is being measured, so it cannot be known first).
The clock runs over data loading, forward, backward and the optimizer step; the first
`--warmup-steps` steps are trained but left out of the events/s (allocator and thread-pool
warm-up). Without `--data`, train and validation files are generated as `make demo` does
(seeds 1 and 2) in a temporary directory. The steps a model reaches in its budget depend on the
machine's load, and so does its mIoU: `--repeats N` trains both models N times (ABBA order) and
prints medians with their spread [lowest..highest].
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from _timing import QuietGate, Spread, abba, add_arguments

from pimm.config import load_config, resolve_config_path
from pimm.config.paths import config_roots
from pimm.data.collate import collate_events
from pimm.data.dataset import build_dataset
from pimm.engine.optim import build_optimizer
from pimm.models import build_model
from pimm.tasks import build_task

CONFIGS = ("demo/semseg", "demo/semseg_ptv3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="training wall-clock budget per model (default 120)")
    p.add_argument("--data", type=Path, help="directory with train.h5 and val.h5 (default: generate them)")
    p.add_argument("--events", type=int, default=2400, help="training events to generate without --data")
    p.add_argument("--val-events", type=int, default=400, help="validation events to generate without --data")
    p.add_argument("--configs", nargs=2, default=list(CONFIGS), metavar=("BASELINE", "CANDIDATE"),
                   help=f"the two configs (default {' '.join(CONFIGS)})")
    p.add_argument("--batch-size", type=int, help="training events per step (default: the baseline config's)")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of train events/s (default 3)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and event order seed (default 0)")
    add_arguments(p, repeats=1, what="trainings of each model")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.events < 1 or args.val_events < 1:
        p.error("--seconds, --events and --val-events must be positive")
    return args


def one_cycle(fraction: float, pct_start: float, div_factor: float = 25.0, final_div_factor: float = 1e4) -> float:
    """torch's OneCycleLR factor (of max_lr, cosine shape) at `fraction` of the schedule."""
    low, final = 1.0 / div_factor, 1.0 / (div_factor * final_div_factor)

    def cos(start: float, end: float, t: float) -> float:
        return end + (start - end) * (1.0 + math.cos(math.pi * min(max(t, 0.0), 1.0))) / 2.0

    if fraction < pct_start:
        return cos(low, 1.0, fraction / pct_start)
    return cos(1.0, final, (fraction - pct_start) / max(1.0 - pct_start, 1e-12))


def batches(dataset, batch_size: int, seed: int):
    """Endless training batches: each epoch a seeded permutation, events keyed by (epoch, index)
    so that the dataset's augmentation differs per epoch, as in pimm's trainer."""
    generator = torch.Generator().manual_seed(seed)
    epoch = 0
    while True:
        order = torch.randperm(len(dataset), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collate_events([dataset[(epoch, i)] for i in order[start:start + batch_size]])
        epoch += 1


def train_for(cfg: dict, train_set, batch_size: int, seconds: float, seed: int, warmup_steps: int) -> dict:
    """Train a fresh model of `cfg` for `seconds` of wall clock; returns it with its counts."""
    torch.manual_seed(seed)
    model = build_model(cfg["model"])
    task = build_task(cfg)
    optimizer = build_optimizer(cfg["optimizer"], model.parameters())
    scheduler = cfg.get("scheduler") or {}
    max_lrs = [group["lr"] for group in optimizer.param_groups]
    if scheduler.get("type") == "OneCycleLR" and scheduler.get("max_lr") is not None:
        max_lrs = [float(scheduler["max_lr"])] * len(max_lrs)
    pct_start = float(scheduler.get("pct_start", 0.3)) if scheduler.get("type") == "OneCycleLR" else None
    clip = cfg.get("clip_grad")
    model.train()
    steps = events = points = 0
    measured_events, measured_from = 0, None
    start = time.perf_counter()
    for batch in batches(train_set, batch_size, seed):
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        if pct_start is not None:
            for group, max_lr in zip(optimizer.param_groups, max_lrs):
                group["lr"] = max_lr * one_cycle(elapsed / seconds, pct_start)
        loss = task.forward_loss(model, batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
        optimizer.step()
        steps += 1
        events += len(batch["offset"])
        points += len(batch["coord"])
        if steps == warmup_steps:
            measured_from = time.perf_counter()
        elif steps > warmup_steps:
            measured_events += len(batch["offset"])
    wall = time.perf_counter() - start
    measured_s = time.perf_counter() - measured_from if measured_from else float("nan")
    return {
        "model": model, "task": task, "steps": steps, "train_events": events, "train_points": points, "train_s": wall,
        "train_events_per_s": measured_events / measured_s if measured_events else events / wall,
        "params": sum(p.numel() for p in model.parameters()),
    }


@torch.no_grad()
def evaluate(model, task, val_set, batch_size: int) -> dict:
    """Validation metrics (the task's meter, as in the trainer) and the evaluation rate."""
    model.eval()
    meter = task.make_meter(torch.device("cpu"))
    start = time.perf_counter()
    for first in range(0, len(val_set), batch_size):
        batch = collate_events([val_set[i] for i in range(first, min(first + batch_size, len(val_set)))])
        meter.update(task.forward_loss(model, batch), batch)
    seconds = time.perf_counter() - start
    return {**meter.compute(), "eval_events_per_s": len(val_set) / seconds}  # compute: no process group, no reduce


def ensure_data(args: argparse.Namespace, tmp: Path) -> Path:
    if args.data is not None:
        return args.data
    from pimm.data.synth import write_dataset

    start = time.perf_counter()
    write_dataset(tmp / "train.h5", args.events, seed=1)
    write_dataset(tmp / "val.h5", args.val_events, seed=2)
    print(f"generated {args.events} train / {args.val_events} val events in {time.perf_counter() - start:.0f}s")
    return tmp


SUMMARISED = ("train_events_per_s", "steps", "train_events", "eval_events_per_s", "loss", "miou")


def summarise(runs: list[dict]) -> dict:
    """One model's repeated runs: a Spread of every measured number, the per-class IoU's medians."""
    first = runs[0]
    return {"type": first["type"], "params": first["params"], "names": first["names"],
            **{key: Spread.of([r[key] for r in runs]) for key in SUMMARISED},
            "iou": [Spread.of([r["iou"][k] for r in runs]).median for k in range(len(first["iou"]))]}


def table(rows: list[dict]) -> str:
    """The two summarised models side by side: medians, and their spread [lowest..highest] with repeats."""
    columns = (("train ev/s", "train_events_per_s", ".1f"), ("steps", "steps", ".0f"),
               ("train events", "train_events", ".0f"), ("eval ev/s", "eval_events_per_s", ".1f"),
               ("val loss", "loss", ".4f"), ("val mIoU", "miou", ".4f"))
    cells = [[r[key].format(spec) for _, key, spec in columns] for r in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _, _) in enumerate(columns)]
    head = f"{'model':<18} {'params':>10} " + " ".join(f"{t:>{w}}" for (t, _, _), w in zip(columns, widths))
    lines = [head, "-" * len(head)]
    for r, c in zip(rows, cells):
        lines.append(f"{r['type']:<18} {r['params']:>10,} " + " ".join(f"{v:>{w}}" for v, w in zip(c, widths)))
    base, cand = rows
    lines.append(f"ratio {cand['type']}/{base['type']}: val mIoU "
                 f"{cand['miou'].median / base['miou'].median:.3f}, train events/s "
                 f"{cand['train_events_per_s'].median / base['train_events_per_s'].median:.3f}, "
                 f"eval events/s {cand['eval_events_per_s'].median / base['eval_events_per_s'].median:.3f} "
                 "(of the medians)")
    lines.append("per-class val IoU (" + ", ".join(rows[0]["names"]) + "), medians:")
    for r in rows:
        lines.append(f"  {r['type']:<16} " + " ".join(f"{v:.3f}" for v in r["iou"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [load_config(resolve_config_path(name, config_roots())) for name in args.configs]
    batch_size = args.batch_size or int(configs[0]["batch_size"])
    print(f"backbones benchmark: {args.seconds:g}s of training each, batch {batch_size}, "
          f"{torch.get_num_threads()} torch threads, configs {' vs '.join(args.configs)}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    gate = QuietGate.from_args(args, say=lambda line: print(line, flush=True))
    with tempfile.TemporaryDirectory(prefix="pimm-backbones-") as tmp:
        data = ensure_data(args, Path(tmp))
        for rep, name in abba(args.configs, args.repeats):
            cfg = configs[args.configs.index(name)]
            gate.before(f"repeat {rep + 1}/{args.repeats} {name}")
            train_cfg = {**cfg["data"]["train"], "path": str(data / "train.h5")}
            val_cfg = {**(cfg["data"].get("val") or {"type": "LArTPCDataset"}), "path": str(data / "val.h5")}
            train_set, val_set = build_dataset(train_cfg, seed=args.seed), build_dataset(val_cfg, seed=args.seed)
            run = train_for(cfg, train_set, batch_size, args.seconds, args.seed, args.warmup_steps)
            metrics = evaluate(run["model"], run["task"], val_set, int(cfg.get("batch_size_val") or batch_size))
            row = {"config": name, "type": cfg["model"]["type"], "names": cfg["data"]["names"],
                   **{k: v for k, v in run.items() if k not in ("model", "task")}, **metrics}
            print(f"  {name}: {row['steps']} steps in {row['train_s']:.0f}s, val mIoU {row['miou']:.4f}", flush=True)
            runs[name].append(row)
    print(table([summarise(runs[name]) for name in args.configs]))
    gate.report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
