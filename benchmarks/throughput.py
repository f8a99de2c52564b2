"""Training throughput of pimm against a hand-written DDP loop, and the data path's headroom.

For each world size (CPU, gloo, torchrun) this runs `repeats` times each, alternating in ABBA
order (pimm, hand, hand, pimm, ...), and reports the medians:

* pimm:  `python -m pimm launch --train.config CONFIG --resources.nproc-per-node N -- max_steps=S
  log_every=L data.val=null data.train.path=DATA ...` (no evaluation);
* hand:  `python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/handwritten_ddp.py`
  with the same config, data, steps and warm-up;

and once the data path alone (`benchmarks/loader_throughput.py`, one process per rank at the
same time). Both trainers are measured over the same steps: the wall clock from the end of step
`warmup` to the end of step `steps`, events = global batch x (steps - warmup). For pimm that
clock comes from the timestamps of rank 0's progress lines (logs/rank0.log), which are written
at the end of steps warmup, warmup + L, ..., steps; the rate pimm itself records in
metrics.jsonl (its log windows, which leave out the time spent logging) is reported beside it.
Each run also reports how many cores other processes used meanwhile (from /proc/stat): on a
shared machine that is the first thing to look at when pimm and the hand-written loop disagree.

    .venv/bin/python benchmarks/throughput.py [--steps 120 --warmup 20 --repeats 2 --world-sizes 1,2]
                                              [--out results.json]

`--layout pilarnet --points-per-event 4000` measures the same at the size of real PILArNet-M events:
synthetic PILArNet-layout shards of about 4,000 integer-voxel points per event (generated once
under data/bench/), read by PILArNetDataset on both sides.

Both trainers (and the loader) get the same OMP_NUM_THREADS: by default the machine's cores
divided by the world size (2 cores: 2 threads at N=1, 1 at N=2), which is what torch does by
itself at N=1 and torchrun at N>1 (1 thread); `--threads K` sets K for every run. At N=1 one
thread would leave a core idle (the loader workers need a few percent of one) and cost ~30%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
from _timing import OtherLoad, QuietGate, Spread, abba, add_arguments

from pimm.errors import PimmError

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DEFAULT_DATA = REPO / "data" / "demo" / "train.h5"
TARGET_RATIO = {"pimm": 0.95, "pilarnet": 0.97}  # pimm / hand-written, by --layout
# a progress line of rank 0: "2026-01-01 12:00:00,123 [rank 0] INFO epoch 1 step 20/120 loss ..."
_PROGRESS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] INFO epoch \d+ step (\d+)/\d+ ")


class BenchError(RuntimeError):
    """A benchmark run failed or produced no usable measurement."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo/semseg", help="pimm config name or path (default demo/semseg)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help=f"training event file (default {DEFAULT_DATA.relative_to(REPO)}; generated if missing)")
    p.add_argument("--layout", choices=("pimm", "pilarnet"), default="pimm",
                   help="pimm: a pimm event file (LArTPCDataset, ~600 points per event); pilarnet: PILArNet-M "
                   "layout shards (PILArNetDataset) of --points-per-event points")
    p.add_argument("--points-per-event", dest="points_per_event", type=int, default=4000, metavar="N",
                   help="with --layout pilarnet: about N points per generated event (default 4000, as PILArNet-M)")
    p.add_argument("--synth-events", type=int, default=2400, help="events generated when --data is missing")
    p.add_argument("--synth-seed", type=int, default=1, help="generator seed when --data is missing")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per training run (default 120)")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the measurement (default 20)")
    p.add_argument("--log-every", type=int, default=10,
                   help="pimm's log_every; --warmup and --steps must be multiples of it (default 10)")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument("--threads", default="auto",
                   help="OMP_NUM_THREADS of every run: a number, or auto = cores // world size (default auto)")
    p.add_argument("--loader-batches", type=int, default=100, help="batches per rank of the loader run (default 100)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to both trainers and the loader (repeatable), "
                   "e.g. --set model.channels=16")
    p.add_argument("--timeout", type=float, default=900, help="seconds before one run is killed (default 900)")
    p.add_argument("--out", type=Path, help="also write the results as JSON to this file")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed) instead of deleting them")
    add_arguments(p, repeats=2, what="runs of each trainer per world size")
    args = p.parse_args(argv)
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        p.error(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error("--world-sizes needs at least one world size >= 1")
    if args.log_every < 1 or args.warmup % args.log_every or args.steps % args.log_every:
        p.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be multiples of --log-every "
                f"({args.log_every}): pimm's progress lines mark the measured interval")
    if not 0 < args.warmup < args.steps:
        p.error(f"need 0 < --warmup < --steps, got warmup={args.warmup} steps={args.steps}")
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) >= 1):
        p.error(f"--threads must be a positive integer or auto, got {args.threads!r}")
    for token in args.overrides:
        if "=" not in token:
            p.error(f"--set takes KEY=VALUE, got {token!r}")
    if args.layout == "pilarnet" and args.data == DEFAULT_DATA:
        args.data = REPO / "data" / "bench" / f"pilarnet-{args.points_per_event}-{args.synth_events}"
    args.data = args.data.absolute()
    return args


# ----------------------------------------------------------------------------- setup


def ensure_data(args: argparse.Namespace) -> None:
    path, events, seed = args.data, args.synth_events, args.synth_seed
    if path.exists():
        return
    from pimm.data.synth import write_dataset, write_pilarnet

    print(f"generating {path} ({events} events, seed {seed}) ...", flush=True)
    start = time.perf_counter()
    if args.layout == "pilarnet":
        write_pilarnet(path, events, seed, shards=4, points_per_event=args.points_per_event)
    else:
        write_dataset(path, events, seed)
    print(f"  done in {time.perf_counter() - start:.1f}s", flush=True)


def resolved_config(args: argparse.Namespace) -> dict:
    """The config as both trainers see it (with the data path and --set overrides)."""
    from pimm.config import apply_overrides, load_config, parse_overrides, resolve_config_path
    from pimm.config.paths import config_roots

    cfg = load_config(resolve_config_path(args.config, config_roots()))
    return apply_overrides(cfg, parse_overrides(common_overrides(args)))


def common_overrides(args: argparse.Namespace) -> list[str]:
    layout = ["data.train.type=PILArNetDataset"] if args.layout == "pilarnet" else []
    return [*layout, f"data.train.path={args.data}", *args.overrides]


def threads_for(args: argparse.Namespace, world: int) -> int:
    if args.threads == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // world)
    return int(args.threads)


def run_env(args: argparse.Namespace, world: int) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS=str(threads_for(args, world)), PYTHONUNBUFFERED="1")


def run(argv: list[str], env: dict[str, str], log_path: Path, timeout: float) -> str:
    """Run a command in its own process group, output to `log_path`; returns stdout+stderr."""
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # no stray loader workers may outlive a run
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if code != 0:
        tail = "\n".join(text.splitlines()[-30:])
        raise BenchError(f"exit status {code}: {shlex.join(argv)}\n--- last lines of {log_path} ---\n{tail}")
    return text


def last_json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise BenchError("the run printed no JSON result line")


# ----------------------------------------------------------------------------- the runs


def run_pimm(args: argparse.Namespace, world: int, rep: int, tmp: Path, epochs: int) -> dict:
    name = f"bench-pimm-w{world}-r{rep}"
    argv = [
        sys.executable, "-m", "pimm", "launch", "--train.config", args.config,
        "--resources.nproc-per-node", str(world), "--run.name", name, "--run.no-timestamp",
        "--paths.exp-root", str(tmp / "exp"), "--",
        f"max_steps={args.steps}", f"epochs={epochs}", f"log_every={args.log_every}", "data.val=null",
        *common_overrides(args),
    ]
    run(argv, run_env(args, world), tmp / f"{name}.out", args.timeout)
    run_dirs = list((tmp / "exp").glob(f"*/{name}"))
    if len(run_dirs) != 1:
        raise BenchError(f"cannot find the run directory of {name} under {tmp / 'exp'}")
    run_dir = run_dirs[0]
    config = json.loads((run_dir / "launch.json").read_text())
    batch = int(config["batches"]["global_batch_size"])
    result = {"impl": "pimm", "world_size": world, "run_dir": str(run_dir), "global_batch": batch,
              "omp_num_threads": threads_for(args, world),
              "per_rank_batch": int(config["batches"]["events_per_rank"]),
              "workers_per_rank": int(config["batches"]["workers_per_rank"])}

    # pimm's own windows (metrics.jsonl): each covers log_every steps, timed without the logging itself
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = {r["step"]: r for r in records if r.get("kind") == "train" and args.warmup < r["step"] <= args.steps}
    expected = range(args.warmup + args.log_every, args.steps + 1, args.log_every)
    missing = [s for s in expected if s not in windows]
    if missing:
        raise BenchError(f"{run_dir / 'metrics.jsonl'} has no train record for steps {missing}")
    window_s = sum(args.log_every * batch / windows[s]["events_per_s"] for s in expected)
    events = batch * (args.steps - args.warmup)
    result["events_per_s_windows"] = events / window_s
    result["window_seconds"] = window_s

    # the wall clock between rank 0's progress lines at the end of step warmup and of step steps
    stamps: dict[int, datetime] = {}
    log_file = run_dir / "logs" / "rank0.log"
    for line in log_file.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _PROGRESS.match(line)
        if m:
            stamps[int(m.group(2))] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    if args.warmup in stamps and args.steps in stamps:
        seconds = (stamps[args.steps] - stamps[args.warmup]).total_seconds()
        result.update(seconds=seconds, events_per_s=events / seconds, clock="rank0.log progress lines")
    else:  # progress lines missing or reformatted: fall back to pimm's own windows
        print(f"  note: no progress lines for steps {args.warmup} and {args.steps} in {log_file}; "
              "using metrics.jsonl windows", flush=True)
        result.update(seconds=window_s, events_per_s=result["events_per_s_windows"], clock="metrics.jsonl windows")
    return result


def run_hand(args: argparse.Namespace, world: int, rep: int, tmp: Path) -> dict:
    name = f"bench-hand-w{world}-r{rep}"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        str(HERE / "handwritten_ddp.py"), "--config", args.config, "--steps", str(args.steps),
        "--warmup", str(args.warmup), *common_overrides(args),
    ]
    result = last_json_line(run(argv, run_env(args, world), tmp / f"{name}.out", args.timeout))
    result["clock"] = "perf_counter in the loop"
    return result


def run_loader(args: argparse.Namespace, world: int, tmp: Path) -> dict:
    """One loader process per rank, all at once; per-rank rate = the slowest rank's."""
    procs = []
    for rank in range(world):
        argv = [
            sys.executable, str(HERE / "loader_throughput.py"), "--config", args.config,
            "--world-size", str(world), "--rank", str(rank), "--batches", str(args.loader_batches),
            *common_overrides(args),
        ]
        log_path = tmp / f"bench-loader-w{world}-rank{rank}.out"
        procs.append((argv, log_path, open(log_path, "w", encoding="utf-8")))
    running = [subprocess.Popen(a, cwd=REPO, env=run_env(args, world), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True) for a, _, f in procs]
    results = []
    try:
        for proc, (argv, log_path, f) in zip(running, procs):
            code = proc.wait(timeout=args.timeout)
            f.close()
            text = log_path.read_text(encoding="utf-8", errors="replace")
            if code != 0:
                raise BenchError(f"exit status {code}: {shlex.join(argv)}\n{text[-3000:]}")
            results.append(last_json_line(text))
    finally:
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for _, _, f in procs:
            f.close()
    rates = [r["events_per_s"] for r in results]
    return {"world_size": world, "events_per_s_per_rank": min(rates), "per_rank": results}


# ----------------------------------------------------------------------------- event sizes


def measured_points(cfg: dict, world: int, steps: int, warmup: int) -> dict[str, float]:
    """Mean stored points per event of the events each trainer consumes in steps warmup+1..steps.

    The two trainers visit the data in different orders (pimm's global permutation, the
    DistributedSampler's), and the cost of a step grows with its points, so events/s is only
    comparable when the measured events are of the same size on average.
    """
    from torch.utils.data import DistributedSampler

    from pimm.data.dataset import build_dataset
    from pimm.data.sampler import GlobalBatchSampler
    from pimm.distributed.batch import plan_batches

    plan = plan_batches(cfg, world)
    dataset = build_dataset(cfg["data"]["train"], seed=int(cfg["seed"]))
    sizes = event_sizes(dataset)
    n, seed, batch = len(dataset), int(cfg["seed"]), plan.global_batch_size

    sampler = GlobalBatchSampler(n, batch, world, 0, seed)
    pimm_events = []
    for step in range(warmup, steps):
        epoch, k = divmod(step, sampler.steps_per_epoch)
        sampler.set_cursor(epoch)
        pimm_events.extend(sampler.global_batch(k).tolist())

    per_rank, hand_events = plan.events_per_rank, []
    orders = {}
    steps_per_epoch = (n // world) // per_rank
    for step in range(warmup, steps):
        epoch, k = divmod(step, steps_per_epoch)
        if epoch not in orders:
            orders[epoch] = []
            for rank in range(world):
                s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                       drop_last=True)
                s.set_epoch(epoch)
                orders[epoch].append(list(s))
        for rank in range(world):
            hand_events.extend(orders[epoch][rank][k * per_rank : (k + 1) * per_rank])
    return {"pimm": float(sizes[pimm_events].mean()), "hand": float(sizes[hand_events].mean())}


def event_sizes(dataset) -> np.ndarray:
    """Points of every event of `dataset` as the model gets them (after any PILArNet point cut)."""
    if not hasattr(dataset, "event_row"):  # a pimm event file: its offsets
        return np.diff(dataset.offsets)
    from pimm.data.pilarnet_file import shard_index

    kept = [shard_index(Path(shard), dataset.revision, dataset.cut)["num_kept"] for shard in dataset.shards]
    return np.array([kept[s][r] for s, r in zip(dataset.event_shard.tolist(), dataset.event_row.tolist())])


# ----------------------------------------------------------------------------- report


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(rows: list[dict]) -> str:
    header = ["world size", "pimm events/s", "hand-written events/s", "ratio pimm/hand", "ratio (per point)",
              "pimm (own windows)", "loader events/s per rank", "consumption events/s per rank", "loader headroom"]
    lines = []
    for r in rows:
        pimm_rate, hand_rate, pairs = (Spread.of(r[k]) for k in ("pimm_runs_events_per_s", "hand_runs_events_per_s",
                                                                  "pair_ratios"))
        ratio_spread = "" if pairs.n == 1 else f" [{pairs.low:.3f}..{pairs.high:.3f}]"
        lines.append([
            str(r["world_size"]), pimm_rate.format(), hand_rate.format(), fmt(r["ratio"], 3) + ratio_spread,
            fmt(r["ratio_per_point"], 3), fmt(r["pimm_events_per_s_windows"]), fmt(r["loader_events_per_s_per_rank"]),
            fmt(r["consumption_events_per_s_per_rank"]), fmt(r["loader_headroom"], 1) + "x",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = [" | ".join(h.rjust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def _terminate(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run(), which kills the run in progress


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.perf_counter()
    ensure_data(args)
    cfg = resolved_config(args)
    from pimm.data.event_file import validate_data
    from pimm.distributed.batch import plan_batches

    info = validate_data(cfg["data"]["train"])
    max_len = cfg["data"]["train"].get("max_len")
    num_events = min(info["num_events"], max_len) if max_len else info["num_events"]
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [__file__, *argv])])
    print(f"pimm throughput benchmark: config {args.config}, data {args.data} ({num_events} events), "
          f"steps {args.steps} (warm-up {args.warmup}, measured {args.steps - args.warmup}), "
          f"repeats {args.repeats}, world sizes {args.world_sizes}, OMP_NUM_THREADS "
          f"{', '.join(f'{threads_for(args, w)} at N={w}' for w in args.world_sizes)}", flush=True)

    try:
        for world in args.world_sizes:  # a bad world size fails here, before any run starts
            plan_batches(cfg, world)
    except PimmError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="pimm-bench-"))
    rows: list[dict] = []
    gate = QuietGate.from_args(args, say=lambda line: print(line, flush=True))
    try:
        for world in args.world_sizes:
            plan = plan_batches(cfg, world)
            steps_per_epoch = num_events // plan.global_batch_size
            if steps_per_epoch < 1:
                raise BenchError(f"{num_events} events cannot fill one global batch of {plan.global_batch_size}")
            epochs = -(-args.steps // steps_per_epoch)
            if epochs > 1:
                print(f"  note: {args.steps} steps span {epochs} epochs of {steps_per_epoch} steps; "
                      "epoch boundaries fall inside the measurement", flush=True)
            pimm_runs, hand_runs = [], []
            for rep, impl in abba(("pimm", "hand"), args.repeats):
                label = f"world {world} repeat {rep + 1}/{args.repeats} {impl:>4}"
                gate.before(label)
                t = time.perf_counter()
                with OtherLoad() as other:
                    res = run_pimm(args, world, rep, tmp, epochs) if impl == "pimm" else run_hand(args, world, rep, tmp)
                res["other_load_cores"] = other.cores
                res["run_seconds"] = time.perf_counter() - t
                (pimm_runs if impl == "pimm" else hand_runs).append(res)
                print(f"  {label}: {res['events_per_s']:7.1f} events/s over {res['seconds']:.2f}s "
                      f"(run took {res['run_seconds']:.1f}s; other processes used "
                      f"{fmt(other.cores, 2)} cores)", flush=True)
            gate.before(f"world {world} loader")
            loader = run_loader(args, world, tmp)
            print(f"  world {world} loader: {loader['events_per_s_per_rank']:.1f} events/s per rank "
                  f"({plan.workers_per_rank} workers/rank)", flush=True)
            points = measured_points(cfg, world, args.steps, args.warmup)
            pimm_rate = statistics.median(r["events_per_s"] for r in pimm_runs)
            hand_rate = statistics.median(r["events_per_s"] for r in hand_runs)
            consumption = pimm_rate / world
            ratio = pimm_rate / hand_rate
            # each repeat's pair ran back to back: its own ratio shows how far one pair can be trusted
            pair_ratios = [p["events_per_s"] / h["events_per_s"] for p, h in zip(pimm_runs, hand_runs)]
            rows.append({
                "world_size": world,
                "global_batch": plan.global_batch_size,
                "per_rank_batch": plan.events_per_rank,
                "workers_per_rank": plan.workers_per_rank,
                "pimm_events_per_s": pimm_rate,
                "hand_events_per_s": hand_rate,
                "ratio": ratio,
                "ratio_per_point": ratio * points["pimm"] / points["hand"],
                "mean_points_per_event": points,
                "pimm_events_per_s_windows": statistics.median(r["events_per_s_windows"] for r in pimm_runs),
                "loader_events_per_s_per_rank": loader["events_per_s_per_rank"],
                "consumption_events_per_s_per_rank": consumption,
                "loader_headroom": loader["events_per_s_per_rank"] / consumption,
                "meets_target": ratio >= TARGET_RATIO[args.layout],
                "pimm_runs_events_per_s": [r["events_per_s"] for r in pimm_runs],
                "hand_runs_events_per_s": [r["events_per_s"] for r in hand_runs],
                "pimm_events_per_s_spread": Spread.of([r["events_per_s"] for r in pimm_runs]).as_dict(),
                "hand_events_per_s_spread": Spread.of([r["events_per_s"] for r in hand_runs]).as_dict(),
                "pair_ratios": pair_ratios,
                "pair_ratio_spread": Spread.of(pair_ratios).as_dict(),
                "max_other_load_cores": max((r["other_load_cores"] or 0.0) for r in pimm_runs + hand_runs),
                "runs": {"pimm": pimm_runs, "hand": hand_runs, "loader": loader},
            })
    except (BenchError, PimmError) as exc:
        print(f"benchmark failed: {exc}\n(logs kept in {tmp})", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started

    print()
    print(table(rows))
    print()
    for r in rows:
        status = "met" if r["meets_target"] else "NOT met"
        pts = r["mean_points_per_event"]
        print(f"world {r['world_size']}: ratio {r['ratio']:.3f} (target >= {TARGET_RATIO[args.layout]}: {status}); "
              f"runs pimm [{', '.join(fmt(v) for v in r['pimm_runs_events_per_s'])}] "
              f"hand [{', '.join(fmt(v) for v in r['hand_runs_events_per_s'])}]; "
              f"mean points/event measured: pimm {pts['pimm']:.0f}, hand {pts['hand']:.0f}; "
              f"loader headroom {r['loader_headroom']:.1f}x" + ("" if r["loader_headroom"] > 1 else " (BOTTLENECK)"))
        if r["max_other_load_cores"] > 0.25:
            print(f"  warning: other processes used up to {r['max_other_load_cores']:.2f} cores during these runs; "
                  "the machine was shared and the numbers are noisy (rerun with --wait-quiet 120, or raise --repeats)")
    print("pimm events/s: wall clock between rank 0's progress lines at steps "
          f"{args.warmup} and {args.steps}; 'own windows': pimm's metrics.jsonl rate (logging time left out). "
          f"Medians over {args.repeats} repeats, [lowest..highest] beside them; the ratio is the ratio of the "
          "medians, its [..] the lowest and highest ratio of one repeat's pair.")
    gate.report()
    print(f"total time {elapsed:.0f}s")

    result = {
        "command": command,
        "settings": {
            "config": args.config, "data": str(args.data), "num_events": num_events, "steps": args.steps,
            "warmup": args.warmup, "log_every": args.log_every, "repeats": args.repeats,
            "world_sizes": args.world_sizes, "overrides": args.overrides,
            "omp_num_threads": {str(w): threads_for(args, w) for w in args.world_sizes},
            "loader_batches": args.loader_batches, "target_ratio": TARGET_RATIO[args.layout],
            "layout": args.layout, "points_per_event": args.points_per_event if args.layout == "pilarnet" else None,
            "wait_quiet_s": args.wait_quiet, "quiet_cores": args.quiet_cores,
        },
        "results": rows,
        "elapsed_s": elapsed,
        "quiet_waits_s": [w.seconds for w in gate.waits],
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.out}")
    if args.keep:
        print(f"run directories and logs kept in {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
