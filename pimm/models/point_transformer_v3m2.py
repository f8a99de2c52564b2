"""PT-v3m2 and DefaultSegmentorV2 as the field publishes them, in plain PyTorch.

The published network (DeepLearnPhysics/pimm `pimm/models/point_transformer_v3/point_transformer_v3m2_sonata.py`
and `pimm/models/default.py`, the Sonata-pretrained Panda backbone) needs spconv, torch_scatter and
flash-attn. This is the same network on pimm's own pieces: its `state_dict` has the published names,
shapes and dtypes (tests/data/published_ptv3m2_manifest.json, derived from the published source by
scripts/published_reference.py), so published weights load as they are, and its forward computes the
published function:

* serialization: the z, z-trans, hilbert and hilbert-trans codes of `pimm.models.serialization`
  (equal to the published ones), the event index above the curve bits, block i of a stage on order
  i % len(order);
* attention in windows of `patch_size` consecutive voxels of an order, as the published flash path
  groups them: an event of n > P voxels is padded to a multiple of P by repeating the voxels before
  its last window (so its last window is its last P voxels, and every key is a real voxel); an event
  of n <= P voxels is one window of n (padding masked here); with `enable_flash=False` the published
  code shrinks the window to the smallest event of the batch, which `published` inputs reproduce;
* pre-norm blocks: x + CPE(x) (submanifold 3x3x3 conv, Linear, LayerNorm, in float32), then
  x + drop_path(ls1(attn(norm1(x)))), x + drop_path(ls2(mlp(norm2(x))));
* grid pooling (Linear, reduce over the children, LayerNorm, GELU) and unpooling (projections of the
  coarse and the skip features, added), and the segmentor's up-cast of every pooled level's features
  to the points (concatenated, finest first) when the backbone ends on a pooled level (`enc_mode`).

Where it differs from the published code, and why (docs/models.md says by how much):

* Two ways in. `model(data_dict)` with the published input dict (`coord`, `grid_coord`, `feat`, `offset`,
  `grid_size`) follows the published code exactly, draws included: the serialization depth of the
  whole batch, the order permutation of each level drawn with `torch.randperm` from the global RNG at
  the same places (so a seeded published forward and a seeded pimm forward agree), drop path per point
  from torch's RNG. pimm's own call `model(coord, feat, offset, event_id)` (trainer, test, predict) makes
  every event's result independent of its batch, so 1 rank and N ranks compute the same function: each
  event is serialized with its own depth (the published depth when it is alone in its batch), small
  events are one window whatever `enable_flash` says, and the draws are keyed: in training the order
  permutation of each level by (build seed, optimizer step, event id, level) and drop path by (build
  seed, step, event id, voxel, branch); in evaluation the orders are not permuted.
* pimm's call grid-samples the points itself (`grid_size`, `grid_origin`, in the units of `coord`): points
  that share a cell are averaged into one voxel and every point takes its voxel's logits; the published
  data pipeline keeps one point per cell before the model instead.
* `enable_rpe=True` is refused (the published recipes do not use it); `upcast_attention` and
  `upcast_softmax` are accepted and change nothing in float32 (attention runs through
  `scaled_dot_product_attention`).
* `weight_init` is pimm's own: "trunc_normal" (the default) starts the layers as the published code does,
  "fan_in" as torch builds them, at the scale of their width (pimm.models.weight_init).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pimm.config.validate import check_backbone_arguments, check_model_arguments
from pimm.data.collate import offset_to_batch_index
from pimm.models.point_seg_net import cluster_mean
from pimm.models.point_transformer import event_keys, event_uniforms, pack_keys, step_key
from pimm.models.serialization import check_depth, encode
from pimm.models.sparse_conv import SubMConv3d, VoxelSites
from pimm.models.weight_init import initialise

_ORDER_STREAM = 1 << 20  # keyed draws: the order permutation of level l uses streams _ORDER_STREAM + l
_MAX_DEPTH = 16  # bits per axis, as the published serialization allows


def serialization_depth(max_coord: int) -> int:
    """The published depth of a grid whose largest coordinate is `max_coord`: bits of max + 1."""
    return int(max_coord + 1).bit_length()


@dataclass
class Windows:
    """Where one level's voxels go in the windows of one order: `gather` (T,) the voxel of each slot,
    `scatter` (N,) each voxel's slot, `key_mask` (T/P, 1, 1, P) False on padding (None if none)."""

    gather: torch.Tensor
    scatter: torch.Tensor
    key_mask: torch.Tensor | None
    size: int


class Level:
    """One grid scale of a batch: voxels `grid` (N, 3) and their events `batch` (N,), the sites of the
    CPE convolutions, the curve orders of the blocks and the windows of each (order, patch size).

    `parent`: for a pooled level, the voxel of this level of each voxel of the finer one."""

    def __init__(self, grid: torch.Tensor, batch: torch.Tensor, num_events: int, *, published: bool,
                 parent: torch.Tensor | None = None) -> None:
        self.grid, self.batch, self.num_events, self.parent = grid, batch, num_events, parent
        self.published = published
        self.num_voxels = len(grid)
        self.counts = torch.bincount(batch, minlength=num_events).tolist()  # host: window layout needs them
        self.starts = [0, *itertools.accumulate(self.counts)][:-1]
        self.sites = VoxelSites(grid, batch)
        self._codes: torch.Tensor | None = None
        self.order_idx: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        self._windows: dict[tuple[int, int], Windows] = {}

    @classmethod
    def of_cells(cls, cells: torch.Tensor, batch: torch.Tensor, num_events: int, published: bool
                 ) -> tuple[Level, torch.Tensor, torch.Tensor]:
        """The level of the distinct (event, cell) pairs of `cells` (N, 3) >= 0, voxels sorted by (event,
        x, y, z), its `parent` set to each row's voxel -> (level, parent (N,), rows per voxel)."""
        bits = max(int(cells.max()).bit_length(), 1) if len(cells) else 1
        keys, parent, counts = torch.unique(pack_keys(batch, cells, bits), return_inverse=True, return_counts=True)
        mask = (1 << bits) - 1
        grid = torch.stack([(keys >> 2 * bits) & mask, (keys >> bits) & mask, keys & mask], 1)
        return cls(grid, keys >> 3 * bits, num_events, published=published, parent=parent), parent, counts

    def pooled(self, stride: int) -> Level:
        """The level of `stride` times the voxel edge: voxels sorted by (event, x, y, z)."""
        coarse = torch.div(self.grid, stride, rounding_mode="floor")
        return Level.of_cells(coarse, self.batch, self.num_events, self.published)[0]

    @functools.cached_property
    def place(self) -> torch.Tensor:
        """(N,) each voxel's place within its event (voxels are stored event by event)."""
        starts = torch.tensor(self.starts, device=self.grid.device)
        return torch.arange(self.num_voxels, device=self.grid.device) - starts[self.batch]

    def codes(self, orders: list[str]) -> torch.Tensor:
        """(K, N) int64 curve codes of the voxels for each order, the event index above the curve bits.
        Published inputs: one depth for the batch (its largest coordinate); pimm's: each event its own."""
        if self._codes is not None:
            return self._codes
        batch_depth = serialization_depth(int(self.grid.max())) if self.num_voxels else 1
        if batch_depth > _MAX_DEPTH:
            raise ValueError(f"grid coordinates up to {int(self.grid.max())} need {batch_depth} bits per axis; the "
                             f"published serialization allows {_MAX_DEPTH}: use a larger grid_size")
        check_depth(batch_depth, self.num_events)
        codes = torch.empty(len(orders), self.num_voxels, dtype=torch.int64, device=self.grid.device)
        if self.published:
            depths = {batch_depth: None}
        else:  # each event's depth (host sync: one max per event)
            event_max = torch.zeros(self.num_events, dtype=torch.int64, device=self.grid.device)
            event_max.scatter_reduce_(0, self.batch, self.grid.amax(1), "amax")
            per_event = [serialization_depth(m) for m in event_max.tolist()]
            voxel_depth = torch.tensor(per_event, device=self.grid.device)[self.batch]
            depths = {d: voxel_depth == d for d in sorted(set(per_event))}
        zeros = torch.zeros_like(self.batch)
        for depth, rows in depths.items():
            grid = self.grid if rows is None else self.grid[rows]
            for k, order in enumerate(orders):
                code = encode(grid, zeros[: len(grid)], order, depth, 1)
                if rows is None:
                    codes[k] = code
                else:
                    codes[k, rows] = code
        self._codes = codes | (self.batch << 3 * batch_depth)
        return self._codes

    def serialize(self, orders: list[str], permutation: torch.Tensor | None) -> None:
        """Sort the voxels along each order; `permutation` (K,) for the whole batch or (B, K) per event
        reorders which curve each block index gets (None: as listed)."""
        codes = self.codes(orders)
        if permutation is not None:
            if permutation.dim() == 1:
                codes = codes[permutation.to(codes.device)]
            else:
                codes = codes.gather(0, permutation.to(codes.device)[self.batch].T)
        self.order_idx = torch.argsort(codes, dim=1)
        positions = torch.arange(self.num_voxels, device=codes.device).expand_as(self.order_idx)
        self.inverse = torch.empty_like(self.order_idx).scatter_(1, self.order_idx, positions)
        self._windows.clear()

    def windows(self, order_index: int, patch_size: int, shrink_to_smallest: bool) -> Windows:
        """The windows of order `order_index` for `patch_size`, as the published code pads them."""
        size = patch_size
        if shrink_to_smallest and self.published:  # published enable_flash=False: the smallest event
            size = min(*(c for c in self.counts if c > 0), patch_size)
        key = (order_index, size)
        if key not in self._windows:
            self._windows[key] = self._layout(self.order_idx[order_index], self.inverse[order_index], size)
        return self._windows[key]

    def _layout(self, order_idx: torch.Tensor, inverse: torch.Tensor, size: int) -> Windows:
        device = order_idx.device
        slots = [math.ceil(c / size) * size if c > size else (size if c > 0 else 0) for c in self.counts]
        total = sum(slots)
        counts = torch.tensor(self.counts, device=device)
        start = torch.tensor(self.starts, device=device)
        slots_t = torch.tensor(slots, device=device)
        slot_start = torch.cumsum(slots_t, 0) - slots_t
        slot_event = torch.repeat_interleave(torch.arange(self.num_events, device=device), slots_t, output_size=total)
        rank = torch.arange(total, device=device) - slot_start[slot_event]
        n = counts[slot_event]
        # an event longer than a window repeats, after its last voxel, the voxels one window back
        local = torch.where(rank < n, rank, torch.where(n > size, rank - size, n - 1))
        real = (rank < n) | (n > size)
        position = inverse  # each voxel's place along the curve, counted over the batch
        scatter = position - start[self.batch] + slot_start[self.batch]
        key_mask = None if bool(real.all()) else real.view(-1, 1, 1, size)
        return Windows(order_idx[start[slot_event] + local], scatter, key_mask, size)


class LayerScale(nn.Module):
    """x * gamma, gamma per channel (published name `gamma`)."""

    def __init__(self, channels: int, init_values: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Drops the residual branch of single voxels in training (the published timm DropPath on (N, C)
    rows), scaled by 1 / (1 - p). Keyed by (event key, the voxel's place in its event, `stream`) when the
    level has event keys; from torch's RNG otherwise."""

    def __init__(self, p: float, stream: int) -> None:
        super().__init__()
        self.p, self.stream = float(p), int(stream)

    def forward(self, x: torch.Tensor, level: Level, keys: torch.Tensor | None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if keys is None:
            keep = x.new_empty(x.shape[0], 1).bernoulli_(1.0 - self.p)
        else:
            voxel_keys = event_keys(level.place, keys[level.batch])  # (event key, voxel), as (step key, event)
            keep = (event_uniforms(voxel_keys, self.stream) >= self.p).to(x.dtype).unsqueeze(1)
        return x * keep / (1.0 - self.p)


class SerializedAttention(nn.Module):
    """Multi-head attention within windows of one curve order; published names qkv, proj."""

    def __init__(self, channels: int, num_heads: int, patch_size: int, qkv_bias: bool, qk_scale: float | None,
                 attn_drop: float, proj_drop: float, order_index: int, enable_flash: bool) -> None:
        super().__init__()
        self.channels, self.num_heads, self.patch_size = channels, num_heads, patch_size
        self.scale = qk_scale or (channels // num_heads) ** -0.5
        self.order_index, self.enable_flash, self.attn_drop = order_index, enable_flash, float(attn_drop)
        self.qkv = nn.Linear(channels, channels * 3, bias=qkv_bias)
        self.proj = nn.Linear(channels, channels)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, level: Level) -> torch.Tensor:
        windows = level.windows(self.order_index, self.patch_size, shrink_to_smallest=not self.enable_flash)
        heads, width = self.num_heads, self.channels // self.num_heads
        qkv = self.qkv(x).index_select(0, windows.gather)
        q, k, v = qkv.view(-1, windows.size, 3, heads, width).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=windows.key_mask, scale=self.scale,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        out = out.transpose(1, 2).reshape(-1, self.channels).index_select(0, windows.scatter)
        return self.proj_drop(self.proj(out))


class MLP(nn.Module):
    def __init__(self, channels: int, hidden: int, drop: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, channels)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """One published PT-v3m2 block (the unit FSDP2 wraps: parallel.wrap_classes=["Block"]). Its
    children are numbered as the published PointSequential numbers them (cpe.0, norm1.0, ls1.0, mlp.0)."""

    def __init__(self, channels: int, num_heads: int, patch_size: int, mlp_ratio: float, qkv_bias: bool,
                 qk_scale: float | None, attn_drop: float, proj_drop: float, drop_path: float,
                 layer_scale: float | None, pre_norm: bool, order_index: int, enable_flash: bool,
                 cpe_conv: SubMConv3d | None, stream: int) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.cpe = None if cpe_conv is None else nn.ModuleList(
            [cpe_conv, nn.Linear(channels, channels), nn.LayerNorm(channels)])
        self.norm1 = nn.Sequential(nn.LayerNorm(channels))
        self.ls1 = nn.Sequential(LayerScale(channels, layer_scale) if layer_scale is not None else nn.Identity())
        self.attn = SerializedAttention(channels, num_heads, patch_size, qkv_bias, qk_scale, attn_drop, proj_drop,
                                        order_index, enable_flash)
        self.norm2 = nn.Sequential(nn.LayerNorm(channels))
        self.ls2 = nn.Sequential(LayerScale(channels, layer_scale) if layer_scale is not None else nn.Identity())
        self.mlp = nn.Sequential(MLP(channels, int(channels * mlp_ratio), proj_drop))
        self.drop_attn = DropPath(drop_path, 2 * stream)
        self.drop_mlp = DropPath(drop_path, 2 * stream + 1)

    def forward(self, x: torch.Tensor, level: Level, keys: torch.Tensor | None) -> torch.Tensor:
        if self.cpe is not None:
            conv, linear, norm = self.cpe
            with torch.autocast(device_type=x.device.type, enabled=False):  # published: CPE in float32
                h = x.float()
                x = (h + norm(linear(conv(h, level.sites)))).to(x.dtype)
        h = self.norm1(x) if self.pre_norm else x
        x = x + self.drop_attn(self.ls1(self.attn(h, level)), level, keys)
        if not self.pre_norm:
            x = self.norm1(x)
        h = self.norm2(x) if self.pre_norm else x
        x = x + self.drop_mlp(self.ls2(self.mlp(h)), level, keys)
        return x if self.pre_norm else self.norm2(x)


class GridPooling(nn.Module):
    """Finer voxels -> their parents: Linear, `reduce` over the children, LayerNorm, GELU (published
    names proj, norm.0)."""

    def __init__(self, in_channels: int, out_channels: int, reduce: str = "max") -> None:
        super().__init__()
        self.reduce = reduce
        self.proj = nn.Linear(in_channels, out_channels)
        self.norm = nn.Sequential(nn.LayerNorm(out_channels))
        self.act = nn.Sequential(nn.GELU())

    def forward(self, x: torch.Tensor, coarse: Level) -> torch.Tensor:
        h = self.proj(x)
        index = coarse.parent.unsqueeze(1).expand_as(h)
        how = {"max": "amax", "min": "amin", "sum": "sum", "mean": "mean"}[self.reduce]
        pooled = h.new_zeros(coarse.num_voxels, h.shape[1]).scatter_reduce_(0, index, h, how, include_self=False)
        return self.act(self.norm(pooled))


class GridUnpooling(nn.Module):
    """Coarse voxels -> their children: proj(coarse)[parent] + proj_skip(skip) (published names
    proj.0/1, proj_skip.0/1: Linear, LayerNorm, GELU)."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(in_channels, out_channels), nn.LayerNorm(out_channels), nn.GELU())
        self.proj_skip = nn.Sequential(nn.Linear(skip_channels, out_channels), nn.LayerNorm(out_channels), nn.GELU())

    def forward(self, x: torch.Tensor, skip: torch.Tensor, coarse: Level) -> torch.Tensor:
        return self.proj_skip(skip) + self.proj(x).index_select(0, coarse.parent)


class Embedding(nn.Module):
    """Linear, LayerNorm, GELU per point (published names stem.linear, stem.norm); masked points take
    the learned `mask_token` (1, C) when the model has one."""

    def __init__(self, in_channels: int, channels: int, act: bool, mask_token: bool) -> None:
        super().__init__()
        layers = OrderedDict(linear=nn.Linear(in_channels, channels), norm=nn.LayerNorm(channels))
        if act:
            layers["act"] = nn.GELU()
        self.stem = nn.Sequential(layers)
        self.mask_token = nn.Parameter(torch.zeros(1, channels)) if mask_token else None

    def forward(self, feat: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stem(feat)
        if mask is not None:
            if self.mask_token is None:
                raise ValueError("the input has a 'mask' but the model was built with mask_token=False")
            x = torch.where(mask.unsqueeze(-1), self.mask_token.to(x.dtype), x)
        return x


def published_level(data: Mapping) -> Level:
    """Level 0 of the published input dict, as the published Point builds it: grid_coord as given (or
    coord and grid_size: (coord - min) // grid_size over the batch), events from offset (or batch)."""
    feat = data["feat"]
    if "offset" in data:
        batch = offset_to_batch_index(torch.as_tensor(data["offset"], device=feat.device), len(feat))
    else:
        batch = torch.as_tensor(data["batch"], device=feat.device).long()
    if "grid_coord" in data:
        grid = torch.as_tensor(data["grid_coord"], device=feat.device).long()
    else:
        coord = data["coord"]
        grid = torch.div(coord - coord.min(0)[0], data["grid_size"], rounding_mode="trunc").long()
    if len(grid) and int(grid.min()) < 0:
        raise ValueError(f"grid_coord must be >= 0, got a minimum of {int(grid.min())}: the published GridSample "
                         "subtracts each event's smallest cell (grid_coord - grid_coord.min(0))")
    num_events = int(batch.max()) + 1 if len(batch) else 1
    return Level(grid, batch, num_events, published=True)


@dataclass
class Features:
    """What the backbone returns: the last stage's voxel features, its level, and every encoder
    stage's output with its level (for the segmentor's up-cast)."""

    feat: torch.Tensor
    levels: list[Level]
    encoder_outputs: list[torch.Tensor]


class PointTransformerV3(nn.Module):
    """PT-v3m2, the published constructor's arguments and defaults; DefaultSegmentorV2 builds it from
    backbone=dict(type="PT-v3m2", ...) (names.BACKBONES)."""

    def __init__(self, in_channels=6, order=("z", "z-trans"), stride=(2, 2, 2, 2), enc_depths=(2, 2, 2, 6, 2),
                 enc_channels=(32, 64, 128, 256, 512), enc_num_head=(2, 4, 8, 16, 32),
                 enc_patch_size=(48, 48, 48, 48, 48), dec_depths=(2, 2, 2, 2), dec_channels=(64, 64, 128, 256),
                 dec_num_head=(4, 4, 8, 16), dec_patch_size=(48, 48, 48, 48), mlp_ratio=4, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, drop_path=0.3, layer_scale=None, pre_norm=True,
                 shuffle_orders=True, enable_rpe=False, enable_flash=True, full_attention=False,
                 upcast_attention=False, upcast_softmax=False, traceable=False, mask_token=False, enc_mode=False,
                 freeze_encoder=False, cpe_first_layer_only=False, cpe_shared_weight=False,
                 embedding_act_layer=True, add_iso_features=False, iso_k=8, iso_r=None,
                 weight_init="trunc_normal") -> None:
        super().__init__()
        check_backbone_arguments("PT-v3m2", {k: v for k, v in locals().items() if k not in ("self", "__class__")})
        stages = len(enc_depths)
        self.order = [order] if isinstance(order, str) else list(order)
        self.stride = list(stride)
        self.shuffle_orders, self.enc_mode, self.freeze_encoder = bool(shuffle_orders), bool(enc_mode), freeze_encoder
        self.shuffle_seed = torch.initial_seed()  # the same on every rank: the trainer seeds before building
        self.step: int | None = None
        self.training_forwards = 0
        self.embedding = Embedding(in_channels, enc_channels[0], embedding_act_layer, mask_token)
        cpe_convs: dict[str, SubMConv3d] = {}
        if cpe_shared_weight:
            self.shared_cpe_convs = nn.ModuleDict()
            for s in range(stages):
                self.shared_cpe_convs[f"enc_stage{s}"] = SubMConv3d(enc_channels[s], enc_channels[s], 3)
            if not enc_mode:
                for s in range(stages - 1):
                    self.shared_cpe_convs[f"dec_stage{s}"] = SubMConv3d(dec_channels[s], dec_channels[s], 3)
            cpe_convs = dict(self.shared_cpe_convs.items())

        def conv(where: str, s: int, i: int, channels: int) -> SubMConv3d | None:
            if cpe_first_layer_only and i != 0:
                return None
            return cpe_convs[f"{where}_stage{s}"] if cpe_shared_weight else SubMConv3d(channels, channels, 3)

        block = dict(mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop,
                     proj_drop=proj_drop, layer_scale=layer_scale, pre_norm=pre_norm, enable_flash=enable_flash)
        streams = iter(range(sum(enc_depths) + (0 if enc_mode else sum(dec_depths))))
        enc_rates = torch.linspace(0, drop_path, sum(enc_depths), device="cpu").tolist()
        self.enc = nn.Sequential()
        for s in range(stages):
            stage = nn.Sequential()
            if s > 0:
                stage.add_module("down", GridPooling(enc_channels[s - 1], enc_channels[s]))
            for i in range(enc_depths[s]):
                stage.add_module(f"block{i}", Block(
                    enc_channels[s], enc_num_head[s], enc_patch_size[s], drop_path=enc_rates[sum(enc_depths[:s]) + i],
                    order_index=i % len(self.order), cpe_conv=conv("enc", s, i, enc_channels[s]),
                    stream=next(streams), **block))
            self.enc.add_module(f"enc{s}", stage)
        if not enc_mode:
            dec_rates = torch.linspace(0, drop_path, sum(dec_depths), device="cpu").tolist()
            channels = list(dec_channels) + [enc_channels[-1]]
            self.dec = nn.Sequential()
            for s in reversed(range(stages - 1)):
                rates = dec_rates[sum(dec_depths[:s]): sum(dec_depths[: s + 1])][::-1]
                stage = nn.Sequential()
                stage.add_module("up", GridUnpooling(channels[s + 1], enc_channels[s], channels[s]))
                for i in range(dec_depths[s]):
                    stage.add_module(f"block{i}", Block(
                        channels[s], dec_num_head[s], dec_patch_size[s], drop_path=rates[i],
                        order_index=i % len(self.order), cpe_conv=conv("dec", s, i, channels[s]),
                        stream=next(streams), **block))
                self.dec.add_module(f"dec{s}", stage)
        if freeze_encoder:
            for p in [*self.embedding.parameters(), *self.enc.parameters()]:
                p.requires_grad = False
        initialise(self, weight_init)

    def begin_optimizer_step(self, step: int) -> None:
        """The trainer announces each optimizer step (1, 2, ...) before its micro-batches."""
        self.step = int(step)

    def _permutation(self, level_index: int, key: int | None, keys: torch.Tensor | None, published: bool,
                     num_events: int) -> torch.Tensor | None:
        """Which curve each block index of a level gets: published as drawn (level 0 when shuffle_orders,
        every pooled level always, from the global RNG); pimm's keyed by step and event in training,
        none in evaluation."""
        count = len(self.order)
        if published:
            return torch.randperm(count) if level_index > 0 or self.shuffle_orders else None
        if key is None or (level_index == 0 and not self.shuffle_orders):
            return None
        stream = _ORDER_STREAM + level_index
        if keys is None:  # no event ids: one permutation for the batch, keyed by the step
            generator = torch.Generator().manual_seed(int(event_keys(torch.tensor([0]), key + stream)))
            return torch.randperm(count, generator=generator)
        draws = torch.stack([event_uniforms(keys, stream * 16 + k) for k in range(count)], 1)  # (B, K)
        return torch.argsort(draws, dim=1)

    def _training_key(self) -> int:
        if self.step is None:
            self.training_forwards += 1
            return step_key(self.shuffle_seed, self.training_forwards)
        return step_key(self.shuffle_seed, self.step)

    def forward(self, data: Mapping) -> Features:
        """The published backbone call on the published input dict (published draws included): the last
        stage's features (`.feat`: per point with the decoder, per coarsest voxel with enc_mode), every
        level and encoder output."""
        return self.forward_levels(data["feat"], published_level(data), None, data.get("mask"))

    def forward_levels(self, feat: torch.Tensor, level: Level, event_id: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> Features:
        """Run the network on level 0 (`feat` one row per voxel of `level`)."""
        published = level.published
        key = self._training_key() if self.training and not published else None
        keys = event_keys(event_id.to(feat.device), key) if key is not None and event_id is not None else None
        x = self.embedding(feat, mask)
        level.serialize(self.order, self._permutation(0, key, keys, published, level.num_events))
        levels, outputs = [level], []
        for s, stage in enumerate(self.enc):
            for name, module in stage.named_children():
                if name == "down":
                    level = levels[-1].pooled(self.stride[s - 1])
                    level.serialize(self.order, self._permutation(s, key, keys, published, level.num_events))
                    levels.append(level)
                    x = module(x, level)
                else:
                    x = module(x, level, keys)
            outputs.append(x)
        if not self.enc_mode:
            for i, stage in enumerate(self.dec):
                s = len(self.enc) - 2 - i
                for name, module in stage.named_children():
                    x = module(x, outputs[s], levels[s + 1]) if name == "up" else module(x, levels[s], keys)
                levels.pop()
        return Features(x, levels, outputs)


def grid_sample(coord: torch.Tensor, offset: torch.Tensor, grid_size: float, grid_origin: float
                ) -> tuple[Level, torch.Tensor, torch.Tensor]:
    """pimm's call of a PT-v3m2 model: points (N, 3) of the events `offset` -> (level 0 of their voxels,
    each point's voxel, points per voxel); cell = floor((coord - grid_origin) / grid_size) minus the
    event's smallest cell."""
    batch = offset_to_batch_index(offset, len(coord))
    num_events = len(offset)
    cells = torch.floor((coord.double() - grid_origin) / grid_size).long()
    corner = cells.new_full((num_events, 3), torch.iinfo(torch.int64).max)
    corner.scatter_reduce_(0, batch.unsqueeze(1).expand_as(cells), cells, "amin")
    return Level.of_cells(cells - corner[batch], batch, num_events, published=False)


def point_features(result: Features, enc_mode: bool) -> torch.Tensor:
    """Features per voxel of level 0: the decoder's output, or with enc_mode every encoder level up-cast
    and concatenated, finest first (the published up_cast)."""
    if not enc_mode:
        return result.feat
    feat = result.encoder_outputs[-1]
    for s in range(len(result.levels) - 1, 0, -1):
        feat = torch.cat([result.encoder_outputs[s - 1], feat.index_select(0, result.levels[s].parent)], dim=1)
    return feat


class DefaultSegmentorV2(nn.Module):
    """The published segmentor: `backbone` (PT-v3m2) and `seg_head` (Linear, or Linear-ReLU-Dropout-Linear
    with mlp_head, or none for num_classes=0), names as published. When the backbone ends on a pooled
    level (enc_mode), every encoder level's features are up-cast to the points and concatenated, finest
    first (backbone_out_channels = their sum).

    `forward(coord, feat, offset, event_id=None)` -> logits per point (pimm's trainer, test, predict), or
    `forward(data_dict)` with the published input dict -> {"seg_logits": logits}. pimm-only options:
    `grid_size` and `grid_origin` (pimm's call grid-samples coord: cell = floor((coord - origin) / size)
    minus the event's smallest cell, the published GridSample of NormalizeCoord'ed coordinates when
    grid_origin is the centre and grid_size the published cell times the published scale)."""

    def __init__(self, num_classes: int, backbone_out_channels: int, backbone: dict | None = None,
                 criteria: list | None = None, freeze_backbone: bool = False, mlp_head: bool = False,
                 grid_size: float = 1.0, grid_origin: float = 0.0) -> None:
        super().__init__()
        check_model_arguments("DefaultSegmentorV2",
                              {k: v for k, v in locals().items() if k not in ("self", "__class__")})
        if mlp_head:
            self.seg_head = nn.Sequential(nn.Linear(backbone_out_channels, backbone_out_channels // 2),
                                          nn.ReLU(inplace=True), nn.Dropout(p=0.3),
                                          nn.Linear(backbone_out_channels // 2, num_classes))
        else:
            self.seg_head = nn.Linear(backbone_out_channels, num_classes) if num_classes > 0 else nn.Identity()
        self.backbone = PointTransformerV3(**{k: v for k, v in backbone.items() if k != "type"})
        self.criteria = criteria  # the published losses: pimm's task computes them (task.loss)
        self.grid_size, self.grid_origin = float(grid_size), float(grid_origin)
        if freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad = False

    def point_features(self, result: Features) -> torch.Tensor:
        return point_features(result, self.backbone.enc_mode)

    def forward(self, coord, feat: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                event_id: torch.Tensor | None = None):
        if isinstance(coord, Mapping):
            return {"seg_logits": self._forward_published(coord)}
        level, voxel_of_point, counts = grid_sample(coord, offset, self.grid_size, self.grid_origin)
        voxel_feat = cluster_mean(feat, voxel_of_point, counts).to(feat.dtype)
        result = self.backbone.forward_levels(voxel_feat, level, event_id)
        return self.seg_head(self.point_features(result)).index_select(0, voxel_of_point)

    def _forward_published(self, data: Mapping) -> torch.Tensor:
        """The published input dict: grid_coord (or coord and grid_size), feat, offset (or batch)."""
        return self.seg_head(self.point_features(self.backbone(data)))
