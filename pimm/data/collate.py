"""Pack variable-length events into one point tensor with Pointcept-style offsets."""

from __future__ import annotations

from typing import Any

import torch

_POINT_KEYS = ("coord", "feat", "segment")
# per-point instance targets (pimm.data.dataset.TARGET_KEYS), collated when every event of the batch has them;
# instance ids stay dense per event (0..K-1): an event's instances are told apart with `offset`
_TARGET_KEYS = ("particle", "interaction", "pid", "momentum", "vertex")


def collate_events(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Concatenate events' points: coord (sumN,3), feat (sumN,F), segment (sumN,), plus
    offset (B,) int64 with offset[i] = end row of event i (offset[-1] == sumN) and event_id (B,)."""
    if not batch:
        raise ValueError("collate_events got an empty batch; a batch needs at least one event")
    keys = [*_POINT_KEYS, *(k for k in _TARGET_KEYS if all(k in event for event in batch))]
    out: dict[str, torch.Tensor] = {key: torch.cat([event[key] for event in batch]) for key in keys}
    counts = torch.tensor([len(event["coord"]) for event in batch], dtype=torch.int64)
    out["offset"] = torch.cumsum(counts, dim=0)
    out["event_id"] = torch.tensor([int(event["event_id"]) for event in batch], dtype=torch.int64)
    return out


def split_events(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """A collated batch of B events -> `parts` collated batches of B / parts consecutive events each
    (views of the point tensors, offsets rebased to 0); used for the micro-batches of accumulation."""
    offset = batch["offset"]
    if parts == 1:
        return [batch]
    if len(offset) % parts:
        raise ValueError(f"{len(offset)} events cannot be split into {parts} equal micro-batches")
    size = len(offset) // parts
    rows = [0, *offset[size - 1 :: size].tolist()]  # point-row bounds of the parts (host tensors: no sync)
    out = []
    for i in range(parts):
        events = slice(i * size, (i + 1) * size)
        micro = {key: batch[key][rows[i] : rows[i + 1]] for key in (*_POINT_KEYS, *_TARGET_KEYS) if key in batch}
        micro["offset"] = offset[events] - rows[i]
        micro["event_id"] = batch["event_id"][events]
        out.append(micro)
    return out


def offset_to_batch_index(offset: torch.Tensor, num_points: int | None = None) -> torch.Tensor:
    """(B,) end-row offsets -> (sumN,) int64 event index of every point (empty events allowed).
    Give `num_points` (= sumN, known on the host) to spare a device-to-host sync on GPUs."""
    offset = offset.to(torch.int64)
    counts = torch.diff(offset, prepend=offset.new_zeros(1))
    return torch.repeat_interleave(torch.arange(len(offset), device=offset.device), counts, output_size=num_points)


def batch_index_to_offset(batch_index: torch.Tensor, num_events: int | None = None) -> torch.Tensor:
    """(sumN,) sorted event index per point -> (B,) int64 end-row offsets.

    B is `num_events` when given (needed if trailing events are empty), else max index + 1.
    """
    batch_index = batch_index.to(torch.int64)
    if num_events is None:
        num_events = int(batch_index.max()) + 1 if len(batch_index) else 0
    counts = torch.bincount(batch_index, minlength=num_events)
    if len(counts) > num_events:
        raise ValueError(f"batch index {int(batch_index.max())} is out of range for {num_events} events")
    return torch.cumsum(counts, dim=0)
