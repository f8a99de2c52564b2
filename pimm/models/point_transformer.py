"""A Point Transformer V3-style encoder-decoder in pure PyTorch (no sparse-convolution library).

The input points are grid-sampled into voxels; each encoder stage pools the voxels of the stage
before it by 2 per axis, each decoder stage unpools back and adds the encoder's skip features,
and the last voxel features are gathered back to the points for the per-point head. Every stage
is a stack of `TransformerBlock`s: a conditional positional encoding (a depthwise 3x3x3
convolution over occupied neighbour voxels), attention within patches of `patch_size`
consecutive voxels along a space-filling curve (`pimm.models.serialization`), and an MLP.

Everything that depends only on the coordinates (voxels, parents, neighbours, curve orders,
patch layouts) is computed once per forward in `Level`s and shared by the blocks. Patches never
mix events: every event's sequence is padded to a multiple of the patch size and the padding is
masked out of the keys, so an event's output does not depend on the other events of its batch.

Host syncs (they stall a GPU, not a CPU): the grid's extent once per forward, and per level the
voxel count (torch.unique), the voxels per event (the padded sequence's length) and the count of
neighbour edges. All are sizes that depend on the data; everything else stays on the device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pimm.config.validate import check_model_arguments
from pimm.data.collate import offset_to_batch_index
from pimm.models.point_seg_net import cluster_mean
from pimm.models.serialization import ORDERS, bit_depth, check_depth, serialize

_NEIGHBOUR_OFFSETS = list(itertools.product((-1, 0, 1), repeat=3))  # the 27 cells of a 3x3x3 kernel


def pack_keys(batch: torch.Tensor, grid: torch.Tensor, depth: int) -> torch.Tensor:
    """One int64 per (event, cell): sorting by it sorts by event, then x, y, z."""
    return (batch << 3 * depth) | (grid[:, 0] << 2 * depth) | (grid[:, 1] << depth) | grid[:, 2]


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """An avalanche mix of 32-bit values (int64 tensors or ints in [0, 2^32)): no product overflows int64."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def step_key(seed: int, step: int) -> int:
    """A 32-bit key of (seed, optimizer step)."""
    return int(_mix32((_mix32(seed & _MASK32) + step * 0x9E3779B9) & _MASK32))


def event_keys(event_id: torch.Tensor, key: int) -> torch.Tensor:
    """(B,) 32-bit keys of (step key, event id): what an event's random draws in a step depend on,
    so they are the same at any world size, micro-batch split or position in the batch."""
    return _mix32((event_id.long() * 0x9E3779B1 + key) & _MASK32)


def event_uniforms(keys: torch.Tensor, stream: int) -> torch.Tensor:
    """(B,) float64 uniforms in [0, 1), one per event key, independent across `stream`s."""
    return _mix32((keys + _mix32(stream + 1)) & _MASK32).double() / 2.0**32


@dataclass
class PatchLayout:
    """Where one level's voxels go in the padded, patch-aligned sequence of one order.

    gather (T,): the voxel in each slot (padding slots repeat a voxel of the same event);
    scatter (N,): each voxel's slot; key_mask (T/P, 1, 1, P) bool, False on padding, or None
    when no event needed padding.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    key_mask: torch.Tensor | None


class Level:
    """The voxels of one grid scale of a batch and everything the blocks need about them.

    Voxels are stored sorted by `pack_keys`, so each event's voxels are contiguous and in event
    order, and a voxel's index is its position in `keys` (which the neighbour search relies on).
    `parent` maps every element of the finer level (points for level 0) to its voxel here, and
    `children` counts those elements per voxel.
    """

    def __init__(self, batch: torch.Tensor, grid: torch.Tensor, depth: int, num_events: int,
                 event_keys: torch.Tensor | None = None) -> None:
        check_depth(depth, num_events)
        self.event_keys = event_keys  # (num_events,) keys of the training step's random draws, or None
        # unique sorts, and gives the parent of every finer element (a host sync: its size is data-dependent)
        self.keys, self.parent, self.children = torch.unique(pack_keys(batch, grid, depth), return_inverse=True,
                                                             return_counts=True)
        self.depth = depth
        self.num_events = num_events
        self.num_voxels = len(self.keys)
        mask = (1 << depth) - 1
        self.grid = torch.stack([(self.keys >> 2 * depth) & mask, (self.keys >> depth) & mask, self.keys & mask], 1)
        self.batch = self.keys >> 3 * depth
        # voxels per event, on the host: the padded sequence's length needs it (one sync per level)
        self.counts = torch.bincount(self.batch, minlength=num_events).tolist()
        self._neighbours: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._orders: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layouts: dict[tuple[str, int], PatchLayout] = {}

    def coarser(self) -> Level:
        """The level of twice the voxel edge (parents of this level's voxels)."""
        return Level(self.batch, self.grid >> 1, max(self.depth - 1, 1), self.num_events, self.event_keys)

    def neighbours(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Occupied 3x3x3 neighbourhoods, the centre cell left out, as edges (centre voxel, neighbour
        voxel, kernel offset: an index of _NEIGHBOUR_OFFSETS)."""
        if self._neighbours is None:
            # j is i's neighbour at offset k exactly when i is j's at the opposite offset 26 - k: look up
            # the 13 offsets after the centre (0,0,0) and mirror them (half the searches)
            after = len(_NEIGHBOUR_OFFSETS) // 2 + 1
            offsets = torch.tensor(_NEIGHBOUR_OFFSETS[after:], device=self.grid.device)
            cells = self.grid.unsqueeze(0) + offsets.unsqueeze(1)  # (13, N, 3)
            inside = (cells < 1 << self.depth).all(dim=2) & (cells >= 0).all(dim=2)
            batch = self.batch.expand(len(offsets), -1)
            wanted = pack_keys(batch.reshape(-1), cells.clamp(min=0).reshape(-1, 3), self.depth).view_as(batch)
            found = torch.searchsorted(self.keys, wanted).clamp(max=self.num_voxels - 1)
            hit = inside & (self.keys[found] == wanted)
            k, centre = hit.nonzero(as_tuple=True)  # a host sync: the edge count is data-dependent
            neighbour = found[k, centre]
            k = k + after
            opposite = len(_NEIGHBOUR_OFFSETS) - 1 - k
            self._neighbours = (torch.cat([centre, neighbour]), torch.cat([neighbour, centre]),
                                torch.cat([k, opposite]))
        return self._neighbours

    def order(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(order_idx, inverse) of the voxels along curve `name`."""
        if name not in self._orders:
            order_idx, inverse = serialize(self.grid, self.batch, (name,), self.depth, self.num_events)
            self._orders[name] = (order_idx[0], inverse[0])
        return self._orders[name]

    def patches(self, name: str, patch_size: int) -> PatchLayout:
        """The padded layout of curve `name` in patches of `patch_size` voxels, each within one event."""
        key = (name, patch_size)
        if key not in self._layouts:
            self._layouts[key] = self._layout(*self.order(name), patch_size)
        return self._layouts[key]

    def _layout(self, order_idx: torch.Tensor, inverse: torch.Tensor, patch_size: int) -> PatchLayout:
        """Event b's c_b voxels, in curve order, fill slots padded_start_b .. + c_b of its
        ceil(c_b / P) * P slots; the rest of its slots repeat its last voxel and are masked."""
        device = order_idx.device
        padded = [math.ceil(c / patch_size) * patch_size for c in self.counts]
        total = sum(padded)
        counts = torch.tensor(self.counts, device=device)
        start = torch.cumsum(counts, 0) - counts
        padded_t = torch.tensor(padded, device=device)
        padded_start = torch.cumsum(padded_t, 0) - padded_t
        # a curve keeps events contiguous and in event order, so sorted position j is in the event of voxel j
        scatter = (torch.arange(self.num_voxels, device=device) + (padded_start - start)[self.batch])[inverse]
        slot_event = torch.repeat_interleave(torch.arange(self.num_events, device=device), padded_t,
                                             output_size=total)
        rank = torch.arange(total, device=device) - padded_start[slot_event]
        real = rank < counts[slot_event]
        source = start[slot_event] + torch.minimum(rank, counts[slot_event] - 1)
        key_mask = real.view(-1, 1, 1, patch_size) if total > self.num_voxels else None
        return PatchLayout(order_idx[source], scatter, key_mask)


class PositionalEncoding(nn.Module):
    """Conditional positional encoding: a depthwise 3x3x3 convolution over the occupied
    neighbour voxels (the sparse convolution of PTv3, made depthwise so it is cheap in plain
    torch), then Linear and LayerNorm. It tells attention, which is blind to position, where
    each voxel sits relative to its neighbours."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(len(_NEIGHBOUR_OFFSETS), channels) / math.sqrt(len(_NEIGHBOUR_OFFSETS)))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.linear = nn.Linear(channels, channels)
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor, level: Level) -> torch.Tensor:
        centre, neighbour, offset = level.neighbours()
        contributions = x.index_select(0, neighbour) * self.weight.index_select(0, offset)
        own = x * self.weight[len(_NEIGHBOUR_OFFSETS) // 2] + self.bias  # the centre cell needs no gather
        return self.norm(self.linear(own.index_add(0, centre, contributions)))


class SerializedAttention(nn.Module):
    """Multi-head self-attention within patches of `patch_size` consecutive voxels of one curve."""

    def __init__(self, channels: int, num_heads: int, patch_size: int) -> None:
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"channels {channels} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.patch_size = patch_size
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, layout: PatchLayout) -> torch.Tensor:
        channels = x.shape[1]
        # project the N voxels, then gather into the T >= N padded slots
        qkv = self.qkv(x).index_select(0, layout.gather)
        qkv = qkv.view(-1, self.patch_size, 3, self.num_heads, channels // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=layout.key_mask)
        out = out.transpose(1, 2).reshape(-1, channels)  # (T, C) in slot order
        return self.proj(out.index_select(0, layout.scatter))


class DropPath(nn.Module):
    """Drops a residual branch for whole events (stochastic depth) in training; identity in eval.

    With the level's event keys (the trainer's steps), an event's draw depends on (seed, step,
    event id, `stream`) only: 1 and N ranks, and any gradient accumulation, drop the same branches
    of the same events. Without them (a forward outside pimm's trainer) it draws from torch's RNG."""

    def __init__(self, p: float, stream: int = 0) -> None:
        super().__init__()
        self.p = float(p)
        self.stream = int(stream)  # unique per DropPath of the model

    def forward(self, x: torch.Tensor, level: Level) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if level.event_keys is None:
            uniforms = torch.rand(level.num_events, device=x.device)
        else:
            uniforms = event_uniforms(level.event_keys, self.stream)
        keep = (uniforms >= self.p).to(x.dtype) / (1.0 - self.p)
        return x * keep[level.batch].unsqueeze(1)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block on one level's voxels: x + CPE(x), then x + attention(LN(x))
    along one curve, then x + MLP(LN(x)). The unit that FSDP2 shards (parallel.wrap_classes)."""

    def __init__(self, channels: int, num_heads: int, patch_size: int, mlp_ratio: float = 4.0,
                 drop_path: float = 0.0, index: int = 0) -> None:
        super().__init__()
        hidden = int(channels * mlp_ratio)
        self.cpe = PositionalEncoding(channels)
        self.norm1 = nn.LayerNorm(channels)
        self.attn = SerializedAttention(channels, num_heads, patch_size)
        self.norm2 = nn.LayerNorm(channels)
        self.mlp = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, channels))
        # `index`: the block's place in the model, so that every branch draws its own stream
        self.drop_attn = DropPath(drop_path, stream=2 * index)
        self.drop_mlp = DropPath(drop_path, stream=2 * index + 1)

    def forward(self, x: torch.Tensor, level: Level, order: str) -> torch.Tensor:
        x = x + self.cpe(x, level)
        x = x + self.drop_attn(self.attn(self.norm1(x), level.patches(order, self.attn.patch_size)), level)
        return x + self.drop_mlp(self.mlp(self.norm2(x)), level)


class GridPooling(nn.Module):
    """Voxels -> their parents in the next coarser level: Linear, max over the children, LN, GELU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_channels, out_channels)
        self.norm = nn.LayerNorm(out_channels)

    def forward(self, x: torch.Tensor, coarse: Level) -> torch.Tensor:
        h = self.proj(x)
        index = coarse.parent.unsqueeze(1).expand_as(h)
        pooled = h.new_zeros(coarse.num_voxels, h.shape[1]).scatter_reduce_(0, index, h, "amax", include_self=False)
        return F.gelu(self.norm(pooled))


class GridUnpooling(nn.Module):
    """Coarse voxels -> their children: projected coarse features gathered to each child plus the
    projected skip features of the encoder at the child's level."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(in_channels, out_channels), nn.LayerNorm(out_channels), nn.GELU())
        self.proj_skip = nn.Sequential(nn.Linear(skip_channels, out_channels), nn.LayerNorm(out_channels), nn.GELU())

    def forward(self, x: torch.Tensor, skip: torch.Tensor, coarse: Level) -> torch.Tensor:
        return self.proj(x).index_select(0, coarse.parent) + self.proj_skip(skip)


class Stage(nn.Module):
    """Blocks of one level; block i attends along curve orders[i % len(orders)]."""

    def __init__(self, channels: int, num_heads: int, patch_size: int, mlp_ratio: float,
                 drop_paths: list[tuple[int, float]]) -> None:
        """`drop_paths`: (block index in the model, drop-path rate) of each block of the stage."""
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(channels, num_heads, patch_size, mlp_ratio, rate, index) for index, rate in drop_paths
        )

    def forward(self, x: torch.Tensor, level: Level, orders: list[str]) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, level, orders[i % len(orders)])
        return x


class PointTransformer(nn.Module):
    """Per-point classifier: grid sampling, an encoder of len(enc_depths) stages joined by stride-2
    grid pooling, a decoder of len(enc_depths) - 1 stages (dec_* listed from the finest level up,
    as in PTv3), the finest voxels' features gathered back to the points, LayerNorm + Linear head.

    `orders` are the curves the blocks of a stage cycle through; with `shuffle_orders` each training
    step permutes them. Training randomness (that permutation and drop path) is keyed by the torch
    seed at construction and the optimizer step, which pimm's trainer announces through
    `begin_optimizer_step`, and drop path also by each event's id: never by the global RNG, which the
    trainer reseeds per rank (ranks attending along different curves would each compute the gradient
    of a different function). So every rank, any world size, any gradient accumulation and a resumed
    run draw the same curves and drop the same branches of the same events. Outside the trainer (no
    step announced) each training forward counts as a step and drop path uses torch's RNG.
    """

    def __init__(
        self,
        in_channels: int = 4,
        num_classes: int = 5,
        grid_size: float = 1.0,
        orders: tuple[str, ...] | list[str] = ORDERS,
        shuffle_orders: bool = True,
        enc_depths: tuple[int, ...] | list[int] = (2, 2, 2, 6, 2),
        enc_channels: tuple[int, ...] | list[int] = (32, 64, 128, 256, 512),
        enc_num_head: tuple[int, ...] | list[int] = (2, 4, 8, 16, 32),
        enc_patch_size: tuple[int, ...] | list[int] = (128, 128, 128, 128, 128),
        dec_depths: tuple[int, ...] | list[int] = (2, 2, 2, 2),
        dec_channels: tuple[int, ...] | list[int] = (64, 64, 128, 256),
        dec_num_head: tuple[int, ...] | list[int] = (4, 4, 8, 16),
        dec_patch_size: tuple[int, ...] | list[int] = (128, 128, 128, 128),
        mlp_ratio: float = 4.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        check_model_arguments("PointTransformer",
                              {key: value for key, value in locals().items() if key not in ("self", "__class__")})
        stages = len(enc_depths)
        self.grid_size = float(grid_size)
        self.orders = list(orders)
        self.shuffle_orders = bool(shuffle_orders)
        self.shuffle_seed = torch.initial_seed()  # the same on every rank: the trainer seeds before building
        self.step: int | None = None  # the optimizer step being trained (begin_optimizer_step)
        self.training_forwards = 0  # the step's stand-in when no trainer announces steps
        # stochastic depth grows linearly over all blocks, encoder then decoder (python: buildable on meta)
        blocks = sum(enc_depths) + sum(dec_depths)
        # (block index, rate) in model order; the index also names each block's drop-path draws
        schedule = iter(enumerate(float(drop_path) * i / max(blocks - 1, 1) for i in range(blocks)))

        self.stem = nn.Sequential(nn.Linear(in_channels + 3, enc_channels[0]), nn.LayerNorm(enc_channels[0]),
                                  nn.GELU())
        self.pools = nn.ModuleList(GridPooling(enc_channels[s - 1], enc_channels[s]) for s in range(1, stages))
        self.encoder = nn.ModuleList(
            Stage(enc_channels[s], enc_num_head[s], enc_patch_size[s], mlp_ratio,
                  [next(schedule) for _ in range(enc_depths[s])])
            for s in range(stages))
        self.unpools = nn.ModuleList()
        self.decoder = nn.ModuleList()
        coarse_channels = enc_channels[-1]
        for s in reversed(range(stages - 1)):  # from the coarsest decoder stage to the finest
            self.unpools.append(GridUnpooling(coarse_channels, enc_channels[s], dec_channels[s]))
            self.decoder.append(Stage(dec_channels[s], dec_num_head[s], dec_patch_size[s], mlp_ratio,
                                      [next(schedule) for _ in range(dec_depths[s])]))
            coarse_channels = dec_channels[s]
        self.point_skip = nn.Linear(enc_channels[0], coarse_channels)
        self.head = nn.Sequential(nn.LayerNorm(coarse_channels), nn.Linear(coarse_channels, num_classes))

    def begin_optimizer_step(self, step: int) -> None:
        """The trainer announces each optimizer step (1, 2, ...) before its micro-batches."""
        self.step = int(step)

    def _training_step_key(self) -> int:
        if self.step is None:
            self.training_forwards += 1
            return step_key(self.shuffle_seed, self.training_forwards)
        return step_key(self.shuffle_seed, self.step)

    def _block_orders(self, key: int | None) -> list[str]:
        if key is None or not self.shuffle_orders:
            return self.orders
        generator = torch.Generator().manual_seed(key)
        return [self.orders[i] for i in torch.randperm(len(self.orders), generator=generator).tolist()]

    def levels(self, scaled: torch.Tensor, batch_index: torch.Tensor, num_events: int,
               keys: torch.Tensor | None = None) -> list[Level]:
        """Level 0 (the voxels of the points at `scaled` = coordinates in grid_size units from each
        event's minimum corner) and each coarser level, one per encoder stage."""
        grid = scaled.floor().long()
        depth = bit_depth(int(grid.max()) if len(grid) else 0)  # a host sync, once per forward
        levels = [Level(batch_index, grid, depth, num_events, keys)]
        for _ in range(len(self.encoder) - 1):
            levels.append(levels[-1].coarser())
        return levels

    def forward(self, coord: torch.Tensor, feat: torch.Tensor, offset: torch.Tensor,
                event_id: torch.Tensor | None = None) -> torch.Tensor:
        """coord (N,3), feat (N,C_in), offset (B,) cumulative counts, event_id (B,) the events' ids in
        the data set (keys drop path's draws; optional) -> logits (N, num_classes)."""
        key = self._training_step_key() if self.training else None
        keys = event_keys(event_id.to(coord.device), key) if key is not None and event_id is not None else None
        batch_index = offset_to_batch_index(offset, len(coord))
        num_events = len(offset)
        corner = coord.new_full((num_events, 3), torch.inf)
        corner = corner.scatter_reduce_(0, batch_index.unsqueeze(1).expand_as(coord), coord, "amin")
        scaled = (coord - corner[batch_index]) / self.grid_size  # the same for an event alone or in a batch
        levels = self.levels(scaled, batch_index, num_events, keys)
        orders = self._block_orders(key)
        # each point's place within its voxel: what grid sampling alone would throw away
        within = scaled - scaled.floor() - 0.5
        points = self.stem(torch.cat([feat, within.to(feat.dtype)], dim=1))
        x = cluster_mean(points, levels[0].parent, levels[0].children).to(points.dtype)
        skips = []
        for s, stage in enumerate(self.encoder):
            if s > 0:
                x = self.pools[s - 1](x, levels[s])
            x = stage(x, levels[s], orders)
            skips.append(x)
        for i, (unpool, stage) in enumerate(zip(self.unpools, self.decoder)):
            s = len(self.encoder) - 2 - i  # the level this decoder stage works on
            x = stage(unpool(x, skips[s], levels[s + 1]), levels[s], orders)
        return self.head(x.index_select(0, levels[0].parent) + self.point_skip(points))
