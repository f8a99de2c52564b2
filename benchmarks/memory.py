"""Memory per rank of DDP against FSDP2: the bytes of parameters, gradients and optimizer state
each rank holds, its peak memory and its step time, at several world sizes.

Run it through the CLI, which checks the input first:

    pimm bench memory --train.config bench/memory_large --ranks 1,2,4 --strategies ddp,fsdp2

For every world size N and strategy this starts one torchrun (`python -m torch.distributed.run
--standalone --nproc-per-node N benchmarks/memory.py --worker SPEC`, gloo on CPU, NCCL on
CUDA). Each rank builds the model, strategy and optimizer exactly as pimm's trainer does
(`build_model`, `build_strategy`, `build_optimizer`, `strategy.clip_grad_norm`), trains on one
batch of its share of the global batch (generated PILArNet-M-like events of `points_per_event`
distinct voxels, random features and labels; the same batch at every step), and after `warmup`
steps measures `steps` more:

* held bytes: the local shards of parameters, of their `.grad` and of every tensor in
  `optimizer.state` (for DTensors `to_local()`), split into the parameters inside the
  `parallel.wrap_classes` modules and the unwrapped rest (the stem and head of PointSegNet);
* peak memory: on CUDA `max_memory_allocated`; on CPU the peak resident set size, which also
  holds the Python runtime, torch's libraries and gloo's buffers (reported alone as `runtime`:
  the resident size before the model is built). `peak (run)` covers the whole process, model
  construction included; `peak (steps)` only the measured steps (the kernel's high-water mark
  is reset after warm-up through /proc/self/clear_refs);
* step time: per step the slowest rank's wall clock, then the median over the measured steps.

On CPU the resident size also counts memory that glibc's allocator keeps after torch frees it
(FSDP2 allocates and frees every Block's gathered parameters in each forward and backward). pimm's
FSDP2 ranks on CPU set glibc's mmap threshold to 1 MiB (pimm.distributed.env.return_freed_memory_to_os),
so that large freed tensors go back to the OS, as a pimm run does; `PIMM_HOST_ALLOCATOR=glibc` in
the environment keeps glibc's defaults (the baseline), `MALLOC_MMAP_THRESHOLD_` sets a threshold of
your own. The ranks inherit the environment; `memory.json` records each run's allocator and any
MALLOC_* settings.

At world size 1 pimm runs the plain model whatever `parallel.strategy` says, so N=1 is one run
("single"). The target (issue 8): FSDP2's parameter+gradient+optimizer bytes per rank at most
1.1x DDP's divided by N, plus the full size of what is left unwrapped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TARGET = 1.1  # FSDP2 held bytes per rank <= TARGET x (DDP's / N) + the unwrapped rest
MIB = 2**20


class BenchFailed(RuntimeError):
    """A benchmark run exited with an error or wrote no result."""


# ----------------------------------------------------------------------------- inside a rank


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _full_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor's numel is the global one


def held_bytes(named_params, optimizer, unwrapped: set[str]) -> dict:
    """Bytes this rank holds (local shards) and would hold as a full replica, for the parameters,
    their gradients and their optimizer state; totals and the unwrapped part."""
    out = {f"{part}_{kind}": 0 for part in ("all", "unwrapped") for kind in
           ("param_bytes", "grad_bytes", "optim_bytes", "full_param_bytes", "full_grad_bytes", "full_optim_bytes")}
    out["all_params"] = out["unwrapped_params"] = 0
    for name, p in named_params:
        state = [v for v in optimizer.state.get(p, {}).values() if hasattr(v, "numel")]
        facts = {
            "param_bytes": _local_bytes(p), "full_param_bytes": _full_bytes(p),
            "grad_bytes": _local_bytes(p.grad) if p.grad is not None else 0,
            "full_grad_bytes": _full_bytes(p.grad) if p.grad is not None else 0,
            "optim_bytes": sum(_local_bytes(v) for v in state), "full_optim_bytes": sum(_full_bytes(v) for v in state),
        }
        for part in ("all", "unwrapped") if name in unwrapped else ("all",):
            for key, value in facts.items():
                out[f"{part}_{key}"] += value
            out[f"{part}_params"] += p.numel()
    return out


def unwrapped_names(model, wrap_classes: list[str]) -> set[str]:
    """Names of the parameters that sit in no module of the wrap classes (FSDP2 leaves them to the root)."""
    inside = {f"{prefix}.{name}" for prefix, module in model.named_modules()
              if type(module).__name__ in wrap_classes and module is not model
              for name, _ in module.named_parameters()}
    return {name for name, _ in model.named_parameters() if name not in inside}


def _status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
        return True
    except OSError:
        return False


def random_batch(events: int, points: int, in_channels: int, num_classes: int, seed: int):
    """A packed batch of `events` generated PILArNet-M-like events of `points` distinct voxels each
    (tracks and showers in a 768^3 volume, pimm.data.synth.distinct_voxels: sparse convolutions and
    voxel pooling see realistic neighbourhoods), random features and labels."""
    import torch

    from pimm.data.synth import distinct_voxels

    g = torch.Generator().manual_seed(seed)
    n = events * points
    coords = [torch.from_numpy(distinct_voxels(points, seed, e)).float() + 0.5 for e in range(events)]
    return {
        "coord": torch.cat(coords),
        "feat": torch.randn(n, in_channels, generator=g),
        "segment": torch.randint(0, num_classes, (n,), generator=g),
        "offset": torch.arange(1, events + 1, dtype=torch.int64) * points,
    }


def worker(spec_path: Path) -> None:
    """One rank of one run: train `warmup + steps` steps, write `rank<R>.json` next to the spec."""
    import math

    import torch

    from pimm.distributed.batch import plan_batches
    from pimm.distributed.env import destroy_distributed, init_distributed
    from pimm.distributed.strategy import build_strategy
    from pimm.engine.optim import build_optimizer
    from pimm.models import build_model
    from pimm.signals import die_with_parent
    from pimm.tasks import build_task

    die_with_parent()  # torchrun starts each rank in a session of its own: no rank outlives it
    spec = json.loads(spec_path.read_text())
    cfg = spec["cfg"]
    env = init_distributed()
    cuda = env.device.type == "cuda"
    runtime_kib = _status_kib("VmRSS")
    plan = plan_batches(cfg, env.world_size)

    torch.manual_seed(int(cfg["seed"]))  # as the trainer: identical initial weights on every rank
    model = build_model(cfg["model"])
    task = build_task(cfg)
    wrap_classes = list((cfg.get("parallel") or {}).get("wrap_classes") or ["Block"])
    unwrapped = unwrapped_names(model, wrap_classes)
    strategy = build_strategy(cfg, env)
    module = strategy.wrap(model, env)
    optimizer = build_optimizer(cfg["optimizer"], module.parameters())
    amp = cfg.get("amp") or {}
    autocast = bool(amp.get("enabled", False)) and cuda
    autocast_dtype = getattr(torch, amp.get("dtype", "bfloat16"))
    clip = cfg.get("clip_grad") or math.inf

    model_cfg = cfg["model"]
    in_channels = (model_cfg.get("backbone") or model_cfg).get("in_channels", 4)  # DefaultSegmentorV2: its backbone's
    batch = random_batch(plan.events_per_rank, int(spec["points_per_event"]), int(in_channels),
                         int(cfg["data"]["num_classes"]), seed=int(cfg["seed"]) + 1_000_003 * env.rank)
    batch = {k: v.to(env.device) for k, v in batch.items()}

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast(env.device.type, dtype=autocast_dtype, enabled=autocast):
            loss = task.forward_loss(module, batch).loss  # as the trainer
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        strategy.clip_grad_norm(module, clip)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(env.device)
        return time.perf_counter() - start

    for _ in range(int(spec["warmup"])):
        step()
    if cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    # the reset also lowers ru_maxrss, so the whole run's peak is the larger of before and after
    peak_before_kib = _status_kib("VmHWM")
    steps_peak_reset = cuda or _reset_peak_rss()
    times = [step() for _ in range(int(spec["steps"]))]

    result = {
        "rank": env.rank, "world_size": env.world_size, "strategy": strategy.name, "device": str(env.device),
        "host_allocator": strategy.host_allocator,
        "events_per_rank": plan.events_per_rank, "points_per_rank": plan.events_per_rank * spec["points_per_event"],
        "wrap_classes": wrap_classes, "step_seconds": times,
        **held_bytes(strategy.eval_module(module).named_parameters(), optimizer, unwrapped),
    }
    if cuda:
        result.update(peak_kind="cuda max_memory_allocated", runtime_bytes=0,
                      peak_run_bytes=None, peak_steps_bytes=torch.cuda.max_memory_allocated(env.device))
    else:
        hwm = _status_kib("VmHWM")
        peak_run_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, peak_before_kib or 0, hwm or 0)  # KiB
        result.update(
            peak_kind="peak RSS (runtime included)",
            runtime_bytes=runtime_kib * 1024 if runtime_kib is not None else None,
            peak_run_bytes=peak_run_kib * 1024,
            peak_steps_bytes=hwm * 1024 if steps_peak_reset and hwm is not None else None,
        )
    out = spec_path.parent / f"rank{env.rank}.json"
    out.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
    out.with_suffix(".tmp").replace(out)
    destroy_distributed()


# ----------------------------------------------------------------------------- the driver


def threads_for(world: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world)


def malloc_env() -> dict[str, str]:
    """The glibc allocator settings the ranks inherit (MALLOC_MMAP_THRESHOLD_ and the like)."""
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


def launch(run_dir: Path, world: int, spec: dict, timeout: float) -> list[dict]:
    """One torchrun of `world` ranks in its own process group; returns the ranks' results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            str(HERE), "--worker", str(spec_path)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_for(world)), PYTHONUNBUFFERED="1")
    log_path = run_dir / "torchrun.log"
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        from pimm.signals import die_with_parent

        # torchrun dies with this driver (a killed benchmark leaves no run behind)
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)  # noqa: PLW1509 (the driver runs no threads)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # no rank may outlive its run
            proc.wait()
    results = [run_dir / f"rank{r}.json" for r in range(world)]
    if code != 0 or not all(p.exists() for p in results):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        why = f"timed out after {timeout:.0f}s" if code is None else f"exit status {code}"
        raise BenchFailed(f"{world}-rank run {why}; last lines of {log_path}:\n{tail}")
    return [json.loads(p.read_text()) for p in results]


def summarize(world: int, label: str, ranks: list[dict]) -> dict:
    """One row: the largest value over ranks (the rank that runs out first), the slowest rank per step."""
    def most(key: str):
        values = [r[key] for r in ranks if r.get(key) is not None]
        return max(values) if values else None

    held = [r["all_param_bytes"] + r["all_grad_bytes"] + r["all_optim_bytes"] for r in ranks]
    per_step = [max(steps) for steps in zip(*(r["step_seconds"] for r in ranks))]
    first = ranks[0]
    return {
        "world_size": world, "strategy": label, "device": first["device"], "peak_kind": first["peak_kind"],
        "host_allocator": first.get("host_allocator"),
        "params": first["all_params"], "unwrapped_params": first["unwrapped_params"],
        "param_bytes": most("all_param_bytes"), "grad_bytes": most("all_grad_bytes"),
        "optim_bytes": most("all_optim_bytes"), "held_bytes": max(held),
        "full_replica_bytes": first["all_full_param_bytes"] + first["all_full_grad_bytes"]
        + first["all_full_optim_bytes"],
        "unwrapped_full_bytes": first["unwrapped_full_param_bytes"] + first["unwrapped_full_grad_bytes"]
        + first["unwrapped_full_optim_bytes"],
        "unwrapped_held_bytes": max(r["unwrapped_param_bytes"] + r["unwrapped_grad_bytes"]
                                    + r["unwrapped_optim_bytes"] for r in ranks),
        "peak_run_bytes": most("peak_run_bytes"), "peak_steps_bytes": most("peak_steps_bytes"),
        "runtime_bytes": most("runtime_bytes"),
        "step_seconds_median": statistics.median(per_step), "step_seconds": per_step,
        "events_per_rank": first["events_per_rank"], "points_per_rank": first["points_per_rank"],
        "per_rank": ranks,
    }


def compare(rows: list[dict]) -> None:
    """Add to every row the ideal 1/N (DDP's held bytes at the same N over N; the full-replica size
    when DDP was not run) and, for FSDP2, the ratio to it and the verdict on the target."""
    ddp = {r["world_size"]: r for r in rows if r["strategy"] in ("ddp", "single")}
    for row in rows:
        n = row["world_size"]
        base = ddp.get(n)
        row["ideal_source"] = f"{base['strategy']} at N={n}" if base else "full-replica size from the global shapes"
        row["ideal_bytes"] = (base["held_bytes"] if base else row["full_replica_bytes"]) / n
        row["x_ideal"] = row["held_bytes"] / row["ideal_bytes"]
        row["target_bytes"] = TARGET * row["ideal_bytes"] + row["unwrapped_full_bytes"]
        row["meets_target"] = row["held_bytes"] <= row["target_bytes"] if row["strategy"] == "fsdp2" else None
        if base and base is not row:
            row["step_vs_ddp"] = row["step_seconds_median"] / base["step_seconds_median"]


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}" if value >= 10 * MIB else f"{value / MIB:.3g}"


def table(rows: list[dict]) -> str:
    header = ["ranks", "strategy", "params MiB", "grads MiB", "optim MiB", "p+g+o MiB/rank", "ideal 1/N MiB",
              "x ideal", "unwrapped MiB", f"target <= {TARGET}x + unwrapped", "peak (steps) MiB", "peak (run) MiB",
              "runtime MiB", "step s", "step vs DDP"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    for r in rows:
        verdict = {True: "PASS", False: "FAIL", None: "-"}[r["meets_target"]]
        if r["meets_target"] is not None:
            verdict += f" ({_mib(r['held_bytes'])} <= {_mib(r['target_bytes'])})"
        lines.append("| " + " | ".join([
            str(r["world_size"]), r["strategy"], _mib(r["param_bytes"]), _mib(r["grad_bytes"]), _mib(r["optim_bytes"]),
            _mib(r["held_bytes"]), _mib(r["ideal_bytes"]), f"{r['x_ideal']:.3f}", _mib(r["unwrapped_full_bytes"]),
            verdict, _mib(r["peak_steps_bytes"]), _mib(r["peak_run_bytes"]), _mib(r["runtime_bytes"]),
            f"{r['step_seconds_median']:.3f}", f"{r['step_vs_ddp']:.2f}x" if "step_vs_ddp" in r else "-",
        ]) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path, title: str) -> Path:
    """Three panels per (N, strategy): held bytes per rank (stacked, ideal 1/N marked), peak memory, step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"N={r['world_size']}\n{r['strategy']}" for r in rows]
    x = list(range(len(rows)))
    fig, (ax_held, ax_peak, ax_time) = plt.subplots(1, 3, figsize=(max(12, 2.2 * len(rows) * 3 / 2), 4.5))
    bottom = [0.0] * len(rows)
    for key, name in (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_bytes", "optimizer state")):
        values = [r[key] / MIB for r in rows]
        ax_held.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_held.scatter(x, [r["ideal_bytes"] / MIB for r in rows], marker="_", s=900, color="black", zorder=3,
                    label="ideal 1/N (DDP / N)")
    ax_held.set_ylabel("MiB per rank (largest rank)")
    ax_held.set_title("held: parameters + gradients + optimizer")
    ax_held.legend(fontsize=8, loc="upper right", ncol=2)
    width = 0.4
    peak_steps = [(r["peak_steps_bytes"] or 0) / MIB for r in rows]
    peak_run = [(r["peak_run_bytes"] or 0) / MIB for r in rows]
    ax_peak.bar([i - width / 2 for i in x], peak_steps, width, label="peak during steps")
    if any(peak_run):
        ax_peak.bar([i + width / 2 for i in x], peak_run, width, label="peak whole run")
    runtime = [(r["runtime_bytes"] or 0) / MIB for r in rows]
    if any(runtime):
        ax_peak.scatter(x, runtime, marker="_", s=900, color="black", zorder=3, label="runtime (before the model)")
    ax_peak.set_ylabel("MiB per rank (largest rank)")
    ax_peak.set_title(rows[0]["peak_kind"])
    ax_peak.legend(fontsize=8, loc="upper right", ncol=2)
    ax_time.bar(x, [r["step_seconds_median"] for r in rows], color="tab:gray")
    ax_time.set_ylabel("seconds (median, slowest rank)")
    ax_time.set_title("step time")
    for ax in (ax_held, ax_peak, ax_time):
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(cfg: dict, config_name: str, overrides: list[str], ranks: list[int], strategies: list[str], steps: int,
        warmup: int, points_per_event: int, out: Path, timeout: float) -> int:
    """Run every (N, strategy), print the table, write `memory.json` and `memory.png` to `out`.
    `cfg` is the resolved, checked config; returns the exit status (0, or 1 when a run failed)."""
    started = time.perf_counter()
    command = shlex.join(["pimm", "bench", "memory", "--train.config", config_name,
                          "--ranks", ",".join(map(str, ranks)), "--strategies", ",".join(strategies),
                          "--steps", str(steps), "--warmup", str(warmup), "--points-per-event", str(points_per_event),
                          "--out", str(out), *(["--", *overrides] if overrides else [])])
    runs = [(n, "single") for n in ranks if n == 1] + [(n, s) for n in ranks if n > 1 for s in strategies]
    print(f"pimm bench memory: config {config_name}, {len(runs)} run(s) "
          f"({', '.join(f'N={n} {s}' for n, s in runs)}), {warmup} warm-up + {steps} measured steps, "
          f"{points_per_event} points/event, OMP_NUM_THREADS cores//N", flush=True)
    rows = []
    for n, label in runs:
        run_cfg = dict(cfg, parallel={**(cfg.get("parallel") or {}), "strategy": "ddp" if label == "single" else label})
        spec = {"cfg": run_cfg, "steps": steps, "warmup": warmup, "points_per_event": points_per_event}
        t = time.perf_counter()
        try:
            ranks_out = launch(out / "runs" / f"n{n}-{label}", n, spec, timeout)
        except BenchFailed as exc:
            print(f"pimm bench memory: N={n} {label} failed: {exc}", file=sys.stderr)
            return 1
        row = summarize(n, label, ranks_out)
        rows.append(row)
        print(f"  N={n} {label:>6}: held {_mib(row['held_bytes'])} MiB/rank, peak (steps) "
              f"{_mib(row['peak_steps_bytes'])} MiB, step {row['step_seconds_median']:.3f}s "
              f"(run took {time.perf_counter() - t:.0f}s)", flush=True)
    compare(rows)
    first = rows[0]
    title = (f"{config_name}: {first['params'] / 1e6:.1f}M parameters ({first['unwrapped_params'] / 1e6:.2f}M "
             f"unwrapped), {first['device'].split(':')[0]}, {points_per_event} points/event")
    print()
    print(table(rows))
    print()
    print(f"{title}. Largest rank per column; step = median over {steps} steps of the slowest rank. "
          f"ideal 1/N = DDP's held bytes / N. peak: {first['peak_kind']}"
          + "".join(f"; host allocator of N={r['world_size']} {r['strategy']}: {r['host_allocator']}"
                    for r in rows if r.get("host_allocator"))
          + (f"; allocator settings {malloc_env()}." if malloc_env() else "."))
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command, "config": config_name, "overrides": overrides, "ranks": ranks, "strategies": strategies,
        "steps": steps, "warmup": warmup, "points_per_event": points_per_event, "target": TARGET,
        "omp_num_threads": {str(n): threads_for(n) for n in ranks}, "malloc_env": malloc_env(),
        "elapsed_s": time.perf_counter() - started, "rows": rows,
    }
    (out / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "memory.md").write_text(f"`{command}`\n\n{title}\n\n{table(rows)}\n")
    png = chart(rows, out / "memory.png", title)
    print(f"results: {out / 'memory.json'}, table {out / 'memory.md'}, chart {png}")
    failed = [r for r in rows if r["meets_target"] is False]
    if failed:
        print(f"FSDP2 misses the memory target at N={', '.join(str(r['world_size']) for r in failed)}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of `pimm bench memory` (started by torchrun)")
    parser.add_argument("--worker", type=Path, required=True, help="the run's spec.json, written by the driver")
    worker(parser.parse_args().worker)
    from pimm.engine.failure import exit_now

    exit_now(0)  # no interpreter teardown: it can hang on gloo's threads (see pimm.engine.failure.exit_now)
