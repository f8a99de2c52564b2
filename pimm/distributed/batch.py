"""Global batch semantics: config totals -> per-rank events, micro-batches and workers (the one
source of truth). `batch_size` is the global number of events per optimizer step, whatever the
world size W and the gradient accumulation A: each rank takes batch_size / W events per step and
runs them as A micro-batches of batch_size / (W x A) events."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pimm.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How the global totals of a config split over `world_size` ranks."""

    world_size: int
    global_batch_size: int
    events_per_rank: int  # per optimizer step
    grad_accum_steps: int  # micro-batches per optimizer step on each rank (1: no accumulation)
    micro_batch_per_rank: int  # events of one forward/backward = events_per_rank / grad_accum_steps
    global_batch_size_val: int
    val_events_per_rank: int
    global_batch_size_test: int
    test_events_per_rank: int
    global_workers: int
    workers_per_rank: int

    def as_dict(self) -> dict:
        return asdict(self)


def _split(key: str, total: int | None, world_size: int, grad_accum_steps: int = 1) -> tuple[int, int]:
    """(global, per-rank) for one batch-size key; None means one event per rank."""
    if total is None:
        return world_size, 1
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise ConfigError(f"{key} must be a positive integer or None, got {total!r}")
    divisor = world_size * grad_accum_steps
    if total % divisor:
        lower = total - total % divisor
        options = ", ".join(str(v) for v in (lower, lower + divisor) if v > 0)
        if grad_accum_steps == 1:
            by, split, change = f"the world size {world_size}", "", "change the number of processes"
        else:
            by = f"the world size {world_size} x grad_accum_steps {grad_accum_steps} = {divisor}"
            split = f", then into {grad_accum_steps} micro-batches per rank"
            change = "change grad_accum_steps or the number of processes"
        raise ConfigError(
            f"{key}={total} is not divisible by {by}: {key} is a global total split evenly over ranks{split}. "
            f"Use a multiple of {divisor} (e.g. {options}) or {change}."
        )
    return total, total // world_size


def plan_batches(cfg: dict, world_size: int) -> BatchPlan:
    """Split `batch_size`, `batch_size_val`, `batch_size_test`, `num_worker` over `world_size` ranks,
    and each rank's training events of a step into `grad_accum_steps` micro-batches."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if cfg.get("batch_size") is None:
        raise ConfigError("batch_size must be set (a global number of events per optimizer step)")
    accum = cfg.get("grad_accum_steps", 1)
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        raise ConfigError(f"grad_accum_steps must be an integer >= 1 (1: no accumulation), got {accum!r}")
    train = _split("batch_size", cfg["batch_size"], world_size, accum)
    val = _split("batch_size_val", cfg.get("batch_size_val"), world_size)
    test = _split("batch_size_test", cfg.get("batch_size_test"), world_size)
    workers = cfg.get("num_worker", 0)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ConfigError(f"num_worker must be a non-negative integer, got {workers!r}")
    return BatchPlan(
        world_size=world_size,
        global_batch_size=train[0],
        events_per_rank=train[1],
        grad_accum_steps=accum,
        micro_batch_per_rank=train[1] // accum,
        global_batch_size_val=val[0],
        val_events_per_rank=val[1],
        global_batch_size_test=test[0],
        test_events_per_rank=test[1],
        global_workers=workers,
        workers_per_rank=workers // world_size,
    )
