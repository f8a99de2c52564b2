"""Space-filling-curve orders of voxel grids, for attention over serialized point clouds.

A curve visits every cell of a 2^depth cube once; sorting voxels by their position on it puts
voxels that are close in space mostly close in the sequence, so fixed-size windows of the
sorted sequence ("patches") are local neighbourhoods. Four orders are known by name:

* ``"z"``: z-order (Morton): the bits of x, y, z interleaved, x the most significant of each triple;
* ``"hilbert"``: the 3-D Hilbert curve (Skilling's transpose construction), whose consecutive
  cells always share a face, so its patches are more compact than z-order's;
* ``"z-trans"`` and ``"hilbert-trans"``: the same curves on (y, x, z), whose patch borders fall
  elsewhere, so that blocks alternating orders let information cross every border.

The event index occupies the bits above the 3 x depth curve bits, so sorting by code keeps each
event's voxels together and in event order, and never interleaves two events.
"""

from __future__ import annotations

import torch

from pimm import names

ORDERS = names.SERIALIZATION_ORDERS
CODE_BITS = 63  # codes are non-negative int64
_AXES = {"z": (0, 1, 2), "z-trans": (1, 0, 2), "hilbert": (0, 1, 2), "hilbert-trans": (1, 0, 2)}


def bit_depth(max_coord: int) -> int:
    """Bits per axis a grid whose largest coordinate is `max_coord` needs (at least 1)."""
    return max(int(max_coord).bit_length(), 1)


def check_depth(depth: int, num_events: int) -> None:
    """ValueError unless `num_events` event indices and 3 x `depth` curve bits fit in 63 bits."""
    event_bits = max(int(num_events) - 1, 0).bit_length()
    if depth < 1 or 3 * depth + event_bits > CODE_BITS:
        raise ValueError(
            f"cannot serialize a grid of {depth} bits per axis for {num_events} events: 3 x {depth} curve bits + "
            f"{event_bits} event bits exceed the {CODE_BITS} bits of an int64 code; use a coarser grid "
            f"(larger grid_size) or fewer events per batch"
        )


def _interleave(axes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], depth: int) -> torch.Tensor:
    """Bit b of axes[0], axes[1], axes[2] -> bits 3b+2, 3b+1, 3b of the result."""
    code = torch.zeros_like(axes[0])
    for bit in range(depth):
        for rank, axis in enumerate(axes):
            code |= ((axis >> bit) & 1) << (3 * bit + 2 - rank)
    return code


def _hilbert_transpose(axes: tuple[torch.Tensor, ...], depth: int) -> tuple[torch.Tensor, ...]:
    """Skilling's AxesToTranspose: cell coordinates -> the Hilbert index in "transpose" form,
    whose interleaved bits (axis 0 most significant) are the position along the curve."""
    x = [a.clone() for a in axes]
    top = 1 << (depth - 1)
    q = top
    while q > 1:  # undo the excess work of the Gray code, from the top bit down
        low = q - 1
        for i in range(3):
            set_here = (x[i] & q) != 0
            if i == 0:
                x[0] = torch.where(set_here, x[0] ^ low, x[0])
                continue
            swap = (x[0] ^ x[i]) & low
            x[0], x[i] = torch.where(set_here, x[0] ^ low, x[0] ^ swap), torch.where(set_here, x[i], x[i] ^ swap)
        q >>= 1
    x[1] = x[1] ^ x[0]  # Gray encode
    x[2] = x[2] ^ x[1]
    flip = torch.zeros_like(x[0])
    q = top
    while q > 1:
        flip = torch.where((x[2] & q) != 0, flip ^ (q - 1), flip)
        q >>= 1
    return tuple(a ^ flip for a in x)


def encode(
    grid_coord: torch.Tensor,
    batch_index: torch.Tensor,
    order: str = "z",
    depth: int | None = None,
    num_events: int | None = None,
) -> torch.Tensor:
    """Curve codes of voxels: grid_coord (N,3) non-negative ints, batch_index (N,) -> (N,) int64,
    event index in the bits above the 3 x `depth` curve bits.

    `depth` (bits per axis) and `num_events` default to what the data needs; each default costs a
    device-to-host sync, so callers in a hot path pass both. Raises ValueError for an unknown
    order, a negative coordinate (when checked) or a grid too large for 63 bits.
    """
    if order not in _AXES:
        raise ValueError(f"unknown serialization order {order!r}; known orders: {', '.join(ORDERS)}")
    grid_coord = grid_coord.long()
    batch_index = batch_index.long()
    if depth is None:
        if len(grid_coord) and int(grid_coord.min()) < 0:
            raise ValueError(f"grid coordinates must be >= 0, got a minimum of {int(grid_coord.min())}")
        depth = bit_depth(int(grid_coord.max()) if len(grid_coord) else 0)
    if num_events is None:
        num_events = int(batch_index.max()) + 1 if len(batch_index) else 1
    check_depth(depth, num_events)
    axes = tuple(grid_coord[:, a] for a in _AXES[order])
    if order.startswith("hilbert"):
        axes = _hilbert_transpose(axes, depth)
    return (batch_index << (3 * depth)) | _interleave(axes, depth)


def serialize(
    grid_coord: torch.Tensor,
    batch_index: torch.Tensor,
    orders: tuple[str, ...] | list[str] = ORDERS,
    depth: int | None = None,
    num_events: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort voxels along each order -> (order_idx (K,N), inverse (K,N)) int64:
    grid_coord[order_idx[k]] runs along curve k, and inverse[k][order_idx[k]] == arange(N)
    (inverse[k][i] is voxel i's position along curve k). Codes of distinct voxels of an event
    differ, so the sort is unique; `depth` and `num_events` as in `encode`."""
    codes = torch.stack([encode(grid_coord, batch_index, o, depth, num_events) for o in orders])
    order_idx = torch.argsort(codes, dim=1)
    positions = torch.arange(codes.shape[1], device=codes.device).expand_as(order_idx)
    inverse = torch.empty_like(order_idx).scatter_(1, order_idx, positions)
    return order_idx, inverse
