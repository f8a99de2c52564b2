"""Submanifold sparse 3D convolution in plain PyTorch (CPU and CUDA, with autograd).

A submanifold convolution computes an output at exactly the active voxels of its input: the output
at voxel p is `bias + sum over kernel offsets d of W[d] @ x[p + d]`, where the sum runs over the
offsets whose voxel p + d is active in the same event. This is what spconv 2.x's `SubMConv3d`
computes, with its weight layout `(out, k, k, k, in)`: `weight[:, a, b, c, :]` acts on the
neighbour at `(a - r, b - r, c - r)` from p (r = k // 2) along the three columns of the voxel
coordinates, in the order they are given (Pointcept's PT-v3 gives spconv `(batch, x, y, z)`, so
published kernels load as they are when pimm is given `grid_coord` as `(x, y, z)`).

How it is computed:

* `VoxelSites` holds the active voxels of a batch (integer coordinates and the event of each). Its
  `neighbour_map(k)` finds, once per kernel size, the pairs (input row, output row) of every kernel
  offset: each voxel is packed with its event into one int64 key, the keys are sorted once, and
  the shifted keys are looked up with `torch.searchsorted` (no Python loop over points). Every
  convolution given the same `VoxelSites` reuses the map (spconv's `indice_key`, passed explicitly).
* `SubMConv3d` then runs one gather, matmul and `index_add_` per kernel offset (the centre offset
  is a plain matmul over all rows); the backward recomputes the gathers instead of keeping them.

Backends (`backends.sparse_conv` in a config, applied by `select_sparse_conv_backend`): "torch"
(the above, everywhere), "spconv" (spconv 2.x's `SubMConv3d` on the same parameters, its indice
pairs cached on the `VoxelSites` like the neighbour maps; its CPU backward is wrong, so on CPU it
runs in evaluation only), "auto" (spconv on CUDA when it can be imported, else torch).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable

MAX_KEY = 2**62  # packed keys stay below this, so that key + offset never overflows int64
PLANE_BATCH = 2**16  # neighbour search: planes searched at once hold about this many candidates (cache-sized)


@dataclass(frozen=True, eq=False)
class NeighbourMap:
    """The pairs of a submanifold convolution at one set of sites, for one kernel size.

    `in_rows[i]` and `out_rows[i]` (int64, `counts[i]` each) list, for kernel offset i (offsets in
    the order of the flattened `(k, k, k)` weight dimensions), the input rows that are a neighbour at
    that offset of the output rows. The centre offset (`centre`) pairs every row with itself and is
    stored as empty tensors: the convolution handles it as one matmul over all rows.
    """

    kernel_size: int
    num_sites: int
    in_rows: tuple[torch.Tensor, ...]
    out_rows: tuple[torch.Tensor, ...]
    counts: tuple[int, ...]

    @property
    def centre(self) -> int:
        return self.kernel_size**3 // 2

    @property
    def max_pairs(self) -> int:
        """The most pairs of one offset other than the centre (the rows of the convolution's buffers)."""
        return max(self.counts)

    def pair_counts(self) -> list[int]:
        """Pairs per kernel offset (the centre counts every site)."""
        return [self.num_sites if i == self.centre else count for i, count in enumerate(self.counts)]


@dataclass(eq=False)
class VoxelSites:
    """The active voxels of a batch of events: `grid_coord` [N, 3] integer voxel coordinates and
    `batch_index` [N] the event of each row (events need not be contiguous). Pass the same object
    to every convolution at these sites: the neighbour map of each kernel size is built once and
    kept on it.
    """

    grid_coord: torch.Tensor
    batch_index: torch.Tensor
    _maps: dict[int, NeighbourMap] = field(default_factory=dict, init=False, repr=False)
    _spconv_tensor: object = field(default=None, init=False, repr=False)  # the spconv backend's, with its pairs

    def __post_init__(self) -> None:
        coord, batch = self.grid_coord, self.batch_index
        if coord.dim() != 2 or coord.shape[1] != 3:
            raise ValueError(f"grid_coord must have shape [N, 3] (integer voxel coordinates), got {list(coord.shape)}")
        if coord.is_floating_point() or coord.is_complex() or coord.dtype == torch.bool:
            raise ValueError(f"grid_coord must hold integers, got {coord.dtype}; pass voxel indices, "
                             "e.g. torch.floor(coord / grid_size).long()")
        if batch.shape != (coord.shape[0],):
            raise ValueError(f"batch_index must have shape [N] = [{coord.shape[0]}] (one event index per row of "
                             f"grid_coord), got {list(batch.shape)}")
        if batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool:
            raise ValueError(f"batch_index must hold integers, got {batch.dtype}")
        if batch.device != coord.device:
            raise ValueError(f"grid_coord is on {coord.device} and batch_index on {batch.device}; "
                             "put both on one device")
        if len(batch) and int(batch.min()) < 0:
            raise ValueError(f"batch_index must be >= 0, got a minimum of {int(batch.min())}")

    @classmethod
    def from_offset(cls, grid_coord: torch.Tensor, offset: torch.Tensor) -> VoxelSites:
        """Sites from Pointcept's `offset`: the cumulative point counts of the events, [B]."""
        offset = torch.as_tensor(offset, device=grid_coord.device).long()
        if offset.dim() != 1 or len(offset) == 0:
            raise ValueError(f"offset must be a 1-D tensor of cumulative point counts, got shape {list(offset.shape)}")
        counts = torch.diff(offset, prepend=offset.new_zeros(1))
        if int(counts.min()) < 0 or int(offset[-1]) != len(grid_coord):
            raise ValueError(f"offset must rise to the number of points ({len(grid_coord)}), got {offset.tolist()}")
        batch = torch.repeat_interleave(torch.arange(len(offset), device=grid_coord.device), counts)
        return cls(grid_coord, batch)

    @property
    def num_sites(self) -> int:
        return self.grid_coord.shape[0]

    @property
    def device(self) -> torch.device:
        return self.grid_coord.device

    def spconv_tensor(self, features: torch.Tensor):
        """A spconv SparseConvTensor of `features` at these sites, with the pairs that earlier
        convolutions kept (keep_spconv_pairs): spconv builds those of each kernel size once."""
        import spconv.pytorch as spconv  # deferred: spconv is optional (backends.sparse_conv="spconv")

        if self._spconv_tensor is None:
            indices = torch.cat([self.batch_index[:, None], self.grid_coord], dim=1).int()
            shape = (self.grid_coord.amax(0) + 1).tolist() if self.num_sites else [1, 1, 1]
            batches = int(self.batch_index.max()) + 1 if self.num_sites else 1
            self._spconv_tensor = spconv.SparseConvTensor(features, indices, shape, batches)
        return self._spconv_tensor.replace_feature(features)

    def keep_spconv_pairs(self, result) -> None:
        """Keep the pairs spconv built for a convolution at these sites (it returns them on its result,
        not on its input), so that the next convolution of that kernel size finds them."""
        self._spconv_tensor.indice_dict.update(result.indice_dict)

    def neighbour_map(self, kernel_size: int) -> NeighbourMap:
        """The pairs of a `kernel_size`^3 submanifold convolution at these sites (built on first use)."""
        if kernel_size not in self._maps:
            self._maps[kernel_size] = build_neighbour_map(self.grid_coord, self.batch_index, kernel_size)
        return self._maps[kernel_size]


def _check_kernel_size(kernel_size: int) -> None:
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd whole number (1, 3, 5, ...), got {kernel_size!r}; a "
                         "submanifold convolution centres its kernel on each site")


def build_neighbour_map(grid_coord: torch.Tensor, batch_index: torch.Tensor, kernel_size: int) -> NeighbourMap:
    """The pairs of a `kernel_size`^3 submanifold convolution at the voxels `grid_coord` [N, 3] of the
    events `batch_index` [N]. Raises ValueError if a voxel appears twice in one event."""
    _check_kernel_size(kernel_size)
    num, radius = grid_coord.shape[0], kernel_size // 2
    num_offsets = kernel_size**3
    centre = num_offsets // 2
    device = grid_coord.device
    if num == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return NeighbourMap(kernel_size, 0, (empty,) * num_offsets, (empty,) * num_offsets, (0,) * num_offsets)

    coord = grid_coord.long()
    # one int64 key per (event, x, y, z), mixed radix with every axis shifted to start at `radius`:
    # a neighbour's shifted coordinate is then never negative and never carries into the slower
    # axis, so key(p + d) == key(p) + d_x * stride_x + d_y * stride_y + d_z
    low, high = torch.aminmax(coord, dim=0)
    spans = (high - low + 1 + 2 * radius).tolist()
    num_events = int(batch_index.max()) + 1
    if num_events * math.prod(spans) >= MAX_KEY:
        raise ValueError(f"the voxel grid is too large to pack into int64 keys: {num_events} events (the largest "
                         f"batch_index + 1) x spans {spans} (coordinates {low.tolist()} .. {high.tolist()}); number "
                         "the events 0, 1, ... and use fewer per batch, or a coarser grid")
    stride_x, stride_y = spans[1] * spans[2], spans[2]
    shifted = coord - (low - radius)
    keys = batch_index.long() * math.prod(spans) + shifted[:, 0] * stride_x + shifted[:, 1] * stride_y + shifted[:, 2]
    sorted_keys, order = torch.sort(keys)
    duplicate = sorted_keys[1:] == sorted_keys[:-1]
    if bool(duplicate.any()):
        first = int(order[1:][duplicate][0])
        raise ValueError(f"{int(duplicate.sum())} voxel(s) appear more than once in their event, e.g. row {first} at "
                         f"{grid_coord[first].tolist()} in event {int(batch_index[first])}; merge the points of a "
                         "voxel first (grid sampling) so that every voxel is one row")

    # The pairs of offset -d are those of offset d swapped, so only the offsets before the centre are
    # searched. They come in planes of fixed (d_x, d_y): the voxels of one plane's column around a
    # site are consecutive in key order, so one searchsorted per plane and site finds the first and
    # the next 2r keys hold the rest; the centre plane's earlier voxels are the r keys just before
    # the site's own. Work happens in key order (sorted queries search fast); `table[i * N + s]` is
    # the key-order row of the neighbour at offset i of key-order site s, or -1.
    width = 2 * radius + 1
    padded = torch.cat([sorted_keys.new_full((radius,), -MAX_KEY), sorted_keys,
                        sorted_keys.new_full((width,), MAX_KEY)])  # misses before the start and past the end
    site = torch.arange(num, device=device)
    table = torch.full(((centre + 1) * num,), -1, dtype=torch.long, device=device)  # last N: where misses go
    centre_plane = kernel_size**2 // 2
    rows = site.unsqueeze(1) + torch.arange(-radius, 0, device=device)  # the centre plane: [N, r]
    d_z = padded.take(rows + radius) - sorted_keys.unsqueeze(1)
    slot = torch.where(d_z >= -radius, (centre_plane * kernel_size + radius + d_z) * num, centre * num)
    table.scatter_(0, (slot + site.unsqueeze(1)).flatten(), rows.flatten())
    # the other planes: slot = (plane * k + (d_z + r)) * N + site, computed in place on [P, N, 2r + 1]
    planes = torch.arange(centre_plane, device=device)
    steps = (planes // kernel_size - radius) * stride_x + (planes % kernel_size - radius) * stride_y
    bases = (planes * kernel_size * num).view(-1, 1, 1) + site.view(1, -1, 1)
    window, after = torch.arange(width, device=device), padded[radius:]  # `after` is indexed by row
    per_batch = PLANE_BATCH // (num * width) + 1
    for step, base in zip(steps.split(per_batch), bases.split(per_batch)):
        lowest = sorted_keys + (step.unsqueeze(1) - radius)  # [P, N]: the key at d_z = -r
        rows = torch.searchsorted(sorted_keys, lowest).unsqueeze(2) + window  # [P, N, 2r + 1]
        d_z_plus_r = after.take(rows).sub_(lowest.unsqueeze(2))  # >= 0 by the search
        miss = d_z_plus_r > 2 * radius
        slot = d_z_plus_r.mul_(num).add_(base).masked_fill_(miss, centre * num)
        table.scatter_(0, slot.view(-1), rows.view(-1))
    flat = (table[: centre * num] >= 0).nonzero().squeeze(1)  # ascending: grouped by offset, then site
    counts = torch.searchsorted(flat, torch.arange(centre + 1, device=device) * num).diff().tolist()
    in_half = order.index_select(0, table.index_select(0, flat)).split(counts)
    out_half = order.index_select(0, flat % num).split(counts)
    empty = order.new_empty(0)
    in_rows = in_half + (empty,) + out_half[::-1]  # offset K-1-i is offset i mirrored
    out_rows = out_half + (empty,) + in_half[::-1]
    return NeighbourMap(kernel_size, num, in_rows, out_rows, (*counts, 0, *counts[::-1]))


class _SubmanifoldConv(torch.autograd.Function):
    """features [N, C_in], weight [K, C_in, C_out], bias [C_out] or None -> [N, C_out]."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                neighbours: NeighbourMap) -> torch.Tensor:
        centre = neighbours.centre
        out = torch.mm(features, weight[centre]) if bias is None else torch.addmm(bias, features, weight[centre])
        # one buffer each for the gathered rows and their products, reused by every offset
        gathered = features.new_empty(neighbours.max_pairs, features.shape[1])
        products = features.new_empty(neighbours.max_pairs, out.shape[1])
        for i, (in_rows, out_rows, count) in enumerate(zip(neighbours.in_rows, neighbours.out_rows, neighbours.counts)):
            if count:
                rows = torch.index_select(features, 0, in_rows, out=gathered[:count])
                out.index_add_(0, out_rows, torch.mm(rows, weight[i], out=products[:count]))
        ctx.save_for_backward(features, weight)
        ctx.neighbours = neighbours
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        features, weight = ctx.saved_tensors
        neighbours: NeighbourMap = ctx.neighbours
        need_features, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        centre, most = neighbours.centre, neighbours.max_pairs
        grad_features = torch.mm(grad_out, weight[centre].t()) if need_features else None
        grad_weight = torch.zeros_like(weight) if need_weight else None  # the weight's strides: mm writes in place
        if need_weight:
            torch.mm(features.t(), grad_out, out=grad_weight[centre])
        grad_gathered = grad_out.new_empty(most, grad_out.shape[1])
        in_buffer = features.new_empty(most, features.shape[1])  # gathered inputs, then their gradients
        for i, (in_rows, out_rows, count) in enumerate(zip(neighbours.in_rows, neighbours.out_rows, neighbours.counts)):
            if not count:
                continue
            grad_pairs = torch.index_select(grad_out, 0, out_rows, out=grad_gathered[:count])
            if need_weight:
                rows = torch.index_select(features, 0, in_rows, out=in_buffer[:count])
                torch.mm(rows.t(), grad_pairs, out=grad_weight[i])
            if need_features:
                grad_features.index_add_(0, in_rows, torch.mm(grad_pairs, weight[i].t(), out=in_buffer[:count]))
        grad_bias = grad_out.sum(0) if need_bias and ctx.has_bias else None
        return grad_features, grad_weight, grad_bias, None


def submanifold_conv3d(features: torch.Tensor, sites: VoxelSites, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The submanifold convolution of `features` [N, C_in] at `sites` with `weight`
    [C_out, k, k, k, C_in] (spconv 2.x's layout) and `bias` [C_out] -> [N, C_out]."""
    if weight.dim() != 5 or weight.shape[1] != weight.shape[2] or weight.shape[1] != weight.shape[3]:
        raise ValueError(f"weight must have shape [out, k, k, k, in] (spconv 2.x's layout), got {list(weight.shape)}")
    out_channels, kernel_size, in_channels = weight.shape[0], weight.shape[1], weight.shape[4]
    if features.dim() != 2 or features.shape[1] != in_channels:
        raise ValueError(f"features must have shape [N, {in_channels}] (the weight's input channels), "
                         f"got {list(features.shape)}")
    if features.shape[0] != sites.num_sites:
        raise ValueError(f"features has {features.shape[0]} rows but the sites have {sites.num_sites}; "
                         "give one feature row per voxel, in the order of grid_coord")
    if features.device != sites.device:
        raise ValueError(f"features are on {features.device} and the sites on {sites.device}; put both on one device")
    dtype = features.dtype
    if torch.is_autocast_enabled(features.device.type):  # run at the autocast precision, as nn.Linear would
        dtype = torch.get_autocast_dtype(features.device.type)
    # [out, k, k, k, in] -> [K, in, out] as a view: weight_per_offset[i] is offset i's matrix, which
    # BLAS reads transposed in place (no copy); the backward writes the weight's gradient the same way
    weight_per_offset = weight.to(dtype).reshape(out_channels, -1, in_channels).permute(1, 2, 0)
    with torch.autocast(features.device.type, enabled=False):
        return _SubmanifoldConv.apply(features.to(dtype), weight_per_offset,
                                      None if bias is None else bias.to(dtype), sites.neighbour_map(kernel_size))


class SubMConv3d(nn.Module):
    """Submanifold sparse 3D convolution with spconv 2.x's parameters: `weight` [out, k, k, k, in]
    and `bias` [out], so a state_dict of spconv's `SubMConv3d` loads as it is. Odd kernel sizes,
    dilation 1. `forward(features [N, in], sites: VoxelSites) -> [N, out]`."""

    backend = "torch"  # "torch" or "spconv": select_sparse_conv_backend sets it on a model's convolutions

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, bias: bool = True) -> None:
        super().__init__()
        _check_kernel_size(kernel_size)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel_size
        self._spconv_module = None  # spconv's SubMConv3d on this module's weight (made on first use)
        self.weight = nn.Parameter(torch.empty(out_channels, kernel_size, kernel_size, kernel_size, in_channels))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default over the kernel's whole fan-in (in * k^3)
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size**3)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, features: torch.Tensor, sites: VoxelSites) -> torch.Tensor:
        if self.backend == "spconv":
            return self._spconv_forward(features, sites)
        return submanifold_conv3d(features, sites, self.weight, self.bias)

    def _spconv_forward(self, features: torch.Tensor, sites: VoxelSites) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and features.device.type != "cuda":
            raise RuntimeError("the spconv sparse-convolution backend trains on CUDA only (its CPU backward gives "
                               "wrong results): set backends.sparse_conv='torch' or 'auto' to train on CPU")
        if self._spconv_module is None:
            import spconv.pytorch as spconv  # deferred: spconv is optional

            module = spconv.SubMConv3d(self.in_channels, self.out_channels, self.kernel_size, bias=False,
                                       indice_key=f"pimm_subm{self.kernel_size}")
            object.__setattr__(self, "_spconv_module", module)  # not a submodule: its weight is this module's
        self._spconv_module.weight = self.weight
        result = self._spconv_module(sites.spconv_tensor(features))
        sites.keep_spconv_pairs(result)
        return result.features if self.bias is None else result.features + self.bias

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"bias={self.bias is not None}")


def spconv_installed() -> bool:
    return importlib.util.find_spec("spconv") is not None


def select_sparse_conv_backend(model: nn.Module, requested: str, device: torch.device) -> str | None:
    """Set the backend of every SubMConv3d in `model` (names.SPARSE_CONV_BACKENDS); returns the one
    chosen, None for a model without sparse convolutions. "auto": spconv on CUDA where it is installed,
    else torch; "spconv" where it is not installed: ValueError saying how to install it."""
    convs = [m for m in model.modules() if isinstance(m, SubMConv3d)]
    if not convs:
        return None
    if requested == "spconv" and not spconv_installed():
        raise ValueError("backends.sparse_conv='spconv' but spconv is not installed: pip install spconv-cu126 (the "
                         "build for your CUDA), or use 'torch' (pure PyTorch) or 'auto'")
    chosen = requested
    if requested == "auto":
        chosen = "spconv" if device.type == "cuda" and spconv_installed() else "torch"
    for conv in convs:
        conv.backend = chosen
    return chosen


def apply_backends(model: nn.Module, cfg: dict, device: torch.device) -> dict[str, str]:
    """The config's `backends` applied to `model` on `device`: {"sparse_conv": the backend chosen}
    for a model with sparse convolutions, {} otherwise (what provenance records and the log says)."""
    chosen = select_sparse_conv_backend(model, (cfg.get("backends") or {}).get("sparse_conv", "auto"), device)
    return {} if chosen is None else {"sparse_conv": chosen}
