"""Global batch semantics: config totals -> per-rank events and workers (the one source of truth)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pimm.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How the global totals of a config split over `world_size` ranks."""

    world_size: int
    global_batch_size: int
    events_per_rank: int
    global_batch_size_val: int
    val_events_per_rank: int
    global_batch_size_test: int
    test_events_per_rank: int
    global_workers: int
    workers_per_rank: int

    def as_dict(self) -> dict:
        return asdict(self)


def _split(key: str, total: int | None, world_size: int) -> tuple[int, int]:
    """(global, per-rank) for one batch-size key; None means one event per rank."""
    if total is None:
        return world_size, 1
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise ConfigError(f"{key} must be a positive integer or None, got {total!r}")
    if total % world_size:
        lower = total - total % world_size
        options = ", ".join(str(v) for v in (lower, lower + world_size) if v > 0)
        raise ConfigError(
            f"{key}={total} is not divisible by the world size {world_size}: "
            f"{key} is a global total split evenly over ranks. Use a multiple of {world_size} "
            f"(e.g. {options}) or change the number of processes."
        )
    return total, total // world_size


def plan_batches(cfg: dict, world_size: int) -> BatchPlan:
    """Split `batch_size`, `batch_size_val`, `batch_size_test`, `num_worker` over `world_size` ranks."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if cfg.get("batch_size") is None:
        raise ConfigError("batch_size must be set (a global number of events per optimizer step)")
    train = _split("batch_size", cfg["batch_size"], world_size)
    val = _split("batch_size_val", cfg.get("batch_size_val"), world_size)
    test = _split("batch_size_test", cfg.get("batch_size_test"), world_size)
    workers = cfg.get("num_worker", 0)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ConfigError(f"num_worker must be a non-negative integer, got {workers!r}")
    return BatchPlan(
        world_size=world_size,
        global_batch_size=train[0],
        events_per_rank=train[1],
        global_batch_size_val=val[0],
        val_events_per_rank=val[1],
        global_batch_size_test=test[0],
        test_events_per_rank=test[1],
        global_workers=workers,
        workers_per_rank=workers // world_size,
    )
