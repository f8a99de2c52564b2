"""Label efficiency of Sonata-style pretraining at laptop scale: does a self-distilled encoder, pretrained within a
time budget on unlabelled generated events, segment held-out events better than training from scratch when only
100 or 1,000 labelled events exist?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/label_efficiency.py [--pretrain-seconds 300] [--labelled 100,1000]
        [--finetune-steps 100] [--val-events 200] [--seeds 1] [--points-per-event N] [--work DIR]
        [--out label_efficiency.json] [--plot FILE.png]

On a shared machine keep OMP_NUM_THREADS=1: with 2 threads on 2 busy cores a pretraining step took 50-100 times
longer (threads waiting for each other), and the budget would buy almost no steps.

1. Events: `pimm.data.synth.write_pilarnet` (PILArNet-M v1 layout, motif labels), three disjoint generator seeds:
   unlabelled pretraining events, max(--labelled) labelled events (each smaller set is the first events of the
   largest one), and --val-events held-out events.
2. Pretraining: configs/bench/label_efficiency_pretrain.py (the tiny Sonata-v1m1 of configs/tests/tiny_pretrain.py
   on the published features). A 6-step run measures the step time first (wall clock: on a loaded machine the
   budget buys fewer steps; the JSON records the steps and events, which are what a rerun can repeat with
   --pretrain-seconds adjusted); the budget then sets the number of steps,
   and exactly steps x batch_size fresh unlabelled events are generated and read once (one epoch), so every schedule
   (lr, teacher momentum, temperatures, masks) runs to its end. The labels in the files are never read by the task.
3. `pimm export --layout published` of the last checkpoint: {"state_dict": {"module.student.backbone.*", ...}}.
4. Fine-tuning, configs/bench/label_efficiency_finetune.py, the same --finetune-steps optimizer steps of the same
   events for every row: scratch (random encoder, every weight trained), lin (the pretrained encoder frozen, a linear
   head on its up-cast features) and fft (the pretrained encoder, every weight trained, the optimizer of scratch).
   The val mIoU of the last weights on the held-out events is what the table shows, the mean over --seeds
   fine-tuning seeds (the pretrained encoder is the same for all) with the lowest and highest in brackets.

Every run is pimm's own Trainer in this process (one process, one torch import), configured as `pimm launch` would
be (config file, `key=value` overrides, check_config) and writing a normal run directory under --work. Prints the
table (markdown), writes the JSON to --out and the plot to --plot (default: --out with .png).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pimm.cli import main as pimm_cli
from pimm.config import apply_overrides, dump_config, load_config, parse_overrides, resolve_config_path
from pimm.config.paths import config_roots
from pimm.config.validate import check_config
from pimm.data.synth import write_pilarnet
from pimm.distributed.env import init_distributed
from pimm.engine.plot import pyplot, save_png
from pimm.engine.trainer import Trainer

PRETRAIN_CONFIG = "bench/label_efficiency_pretrain"
FINETUNE_CONFIG = "bench/label_efficiency_finetune"
MODES = ("scratch", "lin", "fft")
CALIBRATION_STEPS = 6  # steps of the timing run; the first two (allocator, caches) are left out
MIN_PRETRAIN_STEPS = 4  # a smoke test's budget may buy fewer
SEEDS = {"unlabelled": 10, "labelled": 11, "val": 12, "calibration": 13}  # generator seeds: disjoint event sets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrain-seconds", type=float, default=300.0,
                   help="wall-clock seconds of pretraining steps on this machine (default 300): a timing run turns "
                        "them into a number of steps")
    p.add_argument("--labelled", default="100,1000",
                   help="labelled training events, comma-separated (default 100,1000)")
    p.add_argument("--finetune-steps", type=int, default=100,
                   help="optimizer steps of every fine-tuning run (default 100); x the batch size must be a "
                        "multiple of each --labelled count (whole epochs)")
    p.add_argument("--val-events", type=int, default=200, help="held-out events scored (default 200)")
    p.add_argument("--seeds", type=int, default=1, help="fine-tuning seeds per row (default 1)")
    p.add_argument("--points-per-event", type=int, default=None,
                   help="about N points per event (default: the generator's ~600)")
    p.add_argument("--work", type=Path, help="where events and runs go (default: a temporary folder, removed)")
    p.add_argument("--out", type=Path, default=Path("label_efficiency.json"), help="the JSON written")
    p.add_argument("--plot", type=Path, help="the plot written (default: --out with .png)")
    args = p.parse_args(argv)
    args.labelled = sorted({int(n) for n in args.labelled.split(",")})
    batch = _batch_size(FINETUNE_CONFIG)
    for n in args.labelled:
        if n < 1 or (args.finetune_steps * batch) % n:
            p.error(f"--finetune-steps {args.finetune_steps} x batch_size {batch} = {args.finetune_steps * batch} "
                    f"events is not a whole number of epochs of {n} labelled events; pick steps so that it is")
    if args.seeds < 1 or args.val_events < 1 or args.pretrain_seconds <= 0:
        p.error("--seeds, --val-events and --pretrain-seconds must be positive")
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


def _batch_size(name: str) -> int:
    return int(load_config(resolve_config_path(name, config_roots()))["batch_size"])


def _config(name: str, overrides: list[str]) -> dict:
    """A config as `pimm launch --train.config NAME -- OVERRIDES` resolves and checks it."""
    cfg = apply_overrides(load_config(resolve_config_path(name, config_roots())), parse_overrides(overrides))
    check_config(cfg)
    return cfg


def warmup(steps: int) -> str:
    """The override of OneCycleLR's warm-up share: the configs' 5%, at least 2 steps (torch's OneCycleLR divides by
    zero with fewer), which only the short runs of a smoke test need."""
    return f"scheduler.pct_start={max(0.05, 2.0 / steps):.6g}"


def train(name: str, overrides: list[str], run_dir: Path) -> dict:
    """Train config `name` with `overrides` in a fresh run directory; returns the final validation metrics
    ({} without validation)."""
    cfg = _config(name, overrides)
    run_dir.mkdir(parents=True)
    dump_config(cfg, run_dir / "config.py")
    return Trainer(cfg, run_dir, init_distributed()).fit() or {}


def step_seconds(run_dir: Path) -> float:
    """The median seconds per training step of a run logged at every step, its first two steps left out."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train" and r["step"] > 2]
    if not steps:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no training step after the second: cannot time pretraining")
    batch = _batch_size(PRETRAIN_CONFIG)
    return statistics.median(batch / r["events_per_s"] for r in steps)


def pretrain(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """Time the pretraining step, pretrain within the budget, export; returns the export and its facts."""
    batch = _batch_size(PRETRAIN_CONFIG)
    timing_events = work / "timing"
    write_pilarnet(timing_events, batch * CALIBRATION_STEPS, seed=SEEDS["calibration"], revision="v1",
                   points_per_event=args.points_per_event)
    train(PRETRAIN_CONFIG, [f"data.train.path={timing_events}", "epochs=1", "log_every=1",
                            "scheduler=null"], work / "runs" / "pretrain_timing")
    per_step = step_seconds(work / "runs" / "pretrain_timing")
    steps = max(MIN_PRETRAIN_STEPS, int(args.pretrain_seconds / per_step))
    unlabelled = work / "unlabelled"
    write_pilarnet(unlabelled, steps * batch, seed=SEEDS["unlabelled"], revision="v1",
                   points_per_event=args.points_per_event)
    run_dir = work / "runs" / "pretrain"
    start = time.perf_counter()
    train(PRETRAIN_CONFIG, [f"data.train.path={unlabelled}", "epochs=1", warmup(steps)], run_dir)
    seconds = time.perf_counter() - start
    export = work / "pretrained"
    if pimm_cli(["export", "--run-dir", str(run_dir), "--layout", "published", str(export)]) != 0:
        raise RuntimeError(f"pimm export of {run_dir} failed (its message is above)")
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "train"]
    taken = json.loads((run_dir / "summary.json").read_text())["steps"]  # events under min_points are left out
    facts = {"steps": taken, "events_generated": steps * batch, "batch_size": batch, "timed_step_s": per_step,
             "seconds": seconds, "first_loss": losses[0], "last_loss": losses[-1]}
    return export / "model.pth", facts


def pretrained_entries(run_dir: Path) -> int:
    """How many weights the run loaded from pretrained.path (its provenance.json; 0 without pretrained weights)."""
    attempt = json.loads((run_dir / "provenance.json").read_text())["attempts"][-1]
    return int((attempt.get("pretrained") or {}).get("loaded", 0))


def finetune(args: argparse.Namespace, work: Path, weights: Path, labelled: Path, val: Path) -> list[dict]:
    """Every (mode, labelled count, seed) run; one row per run."""
    batch = _batch_size(FINETUNE_CONFIG)
    rows = []
    for n in args.labelled:
        epochs = args.finetune_steps * batch // n
        for mode in MODES:
            for seed in range(args.seeds):
                overrides = [f"data.train.path={labelled}", f"data.train.max_len={n}", f"data.val.path={val}",
                             f"epochs={epochs}", f"eval_every_epochs={epochs}", f"seed={seed}",
                             warmup(args.finetune_steps)]
                if mode != "scratch":
                    overrides.append(f"pretrained.path={weights}")
                if mode == "lin":
                    overrides.append("model.freeze_backbone=true")
                run_dir = work / "runs" / f"{mode}_{n}_seed{seed}"
                start = time.perf_counter()
                final = train(FINETUNE_CONFIG, overrides, run_dir)
                loaded = pretrained_entries(run_dir)
                if mode != "scratch" and not loaded:
                    raise RuntimeError(f"{run_dir}: no pretrained weight was loaded from {weights}; see its "
                                       "provenance.json (pretrained.summary)")
                rows.append({"mode": mode, "labelled": n, "seed": seed, "steps": args.finetune_steps,
                             "epochs": epochs, "seconds": time.perf_counter() - start, "pretrained_loaded": loaded,
                             "miou": final["miou"], "iou": final["iou"], "accuracy": final["accuracy"]})
                print(f"{mode:8s} {n:5d} labelled, seed {seed}: val mIoU {final['miou']:.3f} "
                      f"({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def summarise(rows: list[dict], labelled: list[int]) -> dict[str, dict[str, dict]]:
    """mode -> labelled count -> mean, lowest and highest val mIoU over the seeds."""
    table: dict[str, dict[str, dict]] = {}
    for mode in MODES:
        for n in labelled:
            values = [r["miou"] for r in rows if r["mode"] == mode and r["labelled"] == n]
            table.setdefault(mode, {})[str(n)] = {"mean": statistics.fmean(values), "low": min(values),
                                                  "high": max(values), "seeds": len(values)}
    return table


def markdown(table: dict[str, dict[str, dict]], labelled: list[int]) -> str:
    def cell(s: dict) -> str:
        return f"{s['mean']:.3f}" + (f" [{s['low']:.3f}, {s['high']:.3f}]" if s["seeds"] > 1 else "")

    lines = ["| fine-tuning | " + " | ".join(f"val mIoU, {n} labelled" for n in labelled) + " |",
             "|---|" + "---:|" * len(labelled)]
    lines += [f"| {mode} | " + " | ".join(cell(table[mode][str(n)]) for n in labelled) + " |" for mode in MODES]
    return "\n".join(lines)


def plot(table: dict[str, dict[str, dict]], labelled: list[int], path: Path, title: str) -> None:
    """val mIoU against labelled events, one line per mode, the seeds' lowest and highest as error bars."""
    fig, ax = pyplot().subplots(figsize=(5.5, 4))
    for mode, marker in zip(MODES, "osD"):
        stats = [table[mode][str(n)] for n in labelled]
        mean = [s["mean"] for s in stats]
        spread = [[m - s["low"] for m, s in zip(mean, stats)], [s["high"] - m for m, s in zip(mean, stats)]]
        ax.errorbar(labelled, mean, yerr=spread, marker=marker, capsize=3, label=mode)
    ax.set_xscale("log")
    ax.set_xticks(labelled, [str(n) for n in labelled])
    ax.minorticks_off()
    ax.set_xlabel("labelled training events")
    ax.set_ylabel("val mIoU (held-out events)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="pimm_label_efficiency_"))
    try:
        labelled, val = work / "labelled", work / "val"
        write_pilarnet(labelled, max(args.labelled), seed=SEEDS["labelled"], revision="v1",
                       points_per_event=args.points_per_event)
        write_pilarnet(val, args.val_events, seed=SEEDS["val"], split="val", revision="v1",
                       points_per_event=args.points_per_event)
        weights, pretraining = pretrain(args, work)
        print(f"pretraining: {pretraining['steps']} steps of {pretraining['batch_size']} unlabelled events "
              f"(of {pretraining['events_generated']} generated, each read once) in {pretraining['seconds']:.0f} s; "
              f"loss {pretraining['first_loss']:.3f} -> {pretraining['last_loss']:.3f}", flush=True)
        rows = finetune(args, work, weights, labelled, val)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    table = summarise(rows, args.labelled)
    print(markdown(table, args.labelled))
    title = (f"pretraining {pretraining['steps']} steps ({pretraining['seconds']:.0f} s); "
             f"fine-tuning {args.finetune_steps} steps; {args.val_events} held-out events")
    plot(table, args.labelled, args.plot, title)
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "threads": os.environ.get("OMP_NUM_THREADS"), "pretraining": pretraining, "table": table, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} and {args.plot}")
    return 0 if all(math.isfinite(r["miou"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
