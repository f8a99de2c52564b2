"""A small point-cloud segmentation network in pure PyTorch.

Points of a batch are packed into one tensor with per-event `offset` (cumulative counts).
Each `Block` mixes a point's features with the mean features of the points sharing its
voxel at one grid scale, so stacking blocks of several scales sees local geometry
(thin track, diffuse shower, isolated blip) without any compiled neighbour search.
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.config.validate import check_model_arguments
from pimm.data.collate import offset_to_batch_index


def voxel_clusters(
    coord: torch.Tensor, batch_index: torch.Tensor, grid_size: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Voxels of edge `grid_size`, never mixing events -> (cluster id per point, points per cluster)."""
    cell = torch.div(coord, grid_size, rounding_mode="floor").long()
    cell = cell - cell.min(dim=0).values
    extent = cell.max(dim=0).values + 1
    # one int64 key per (event, voxel): cheaper to unique than rows of a 2-D tensor
    key = ((batch_index * extent[0] + cell[:, 0]) * extent[1] + cell[:, 1]) * extent[2] + cell[:, 2]
    # the counts come with the unique for free (and no host sync for the number of clusters)
    _, cluster, counts = torch.unique(key, return_inverse=True, return_counts=True)
    return cluster, counts


def cluster_mean(features: torch.Tensor, cluster: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(clusters, C) float32 mean of `features` over each cluster, computed in float32 whatever the
    autocast dtype (in bf16 a count saturates at 256 and a sum of thousands of points loses its low digits)."""
    summed = features.new_zeros(len(counts), features.shape[1], dtype=torch.float32)
    summed.index_add_(0, cluster, features.float())
    return summed / counts.unsqueeze(1)


def voxel_mean(features: torch.Tensor, cluster: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of `features` over each point's voxel, back at every point, in `features`' dtype."""
    return cluster_mean(features, cluster, counts)[cluster].to(features.dtype)


class Block(nn.Module):
    """Residual block: point features + voxel-mean context at one grid scale, then an MLP."""

    def __init__(self, channels: int, expansion: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.context = nn.Linear(channels, channels)
        self.mlp = nn.Sequential(
            nn.Linear(2 * channels, expansion * channels),
            nn.GELU(),
            nn.Linear(expansion * channels, channels),
        )

    def forward(self, x: torch.Tensor, cluster: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        pooled = voxel_mean(self.context(h), cluster, counts)
        return x + self.mlp(torch.cat([h, pooled.to(h.dtype)], dim=1))


class PointSegNet(nn.Module):
    """Per-point classifier: stem MLP, one `Block` per entry of `grid_sizes`, linear head."""

    def __init__(
        self,
        in_channels: int = 4,
        num_classes: int = 5,
        channels: int = 64,
        grid_sizes: tuple[float, ...] | list[float] = (2.0, 4.0, 8.0, 16.0, 8.0, 4.0),
        expansion: int = 2,
    ) -> None:
        super().__init__()
        check_model_arguments("PointSegNet", {key: value for key, value in locals().items()
                                              if key not in ("self", "__class__")})
        self.grid_sizes = [float(g) for g in grid_sizes]
        self.stem = nn.Sequential(nn.Linear(in_channels, channels), nn.GELU(), nn.Linear(channels, channels))
        self.blocks = nn.ModuleList(Block(channels, expansion) for _ in self.grid_sizes)
        self.head = nn.Sequential(nn.LayerNorm(channels), nn.Linear(channels, num_classes))

    def forward(self, coord: torch.Tensor, feat: torch.Tensor, offset: torch.Tensor,
                event_id: torch.Tensor | None = None) -> torch.Tensor:
        """coord (N,3), feat (N,C_in), offset (B,) cumulative counts -> logits (N, num_classes).
        `event_id` (the models' common signature) is not used: PointSegNet draws no randomness."""
        batch_index = offset_to_batch_index(offset, len(coord))
        clusters = {g: voxel_clusters(coord, batch_index, g) for g in set(self.grid_sizes)}
        x = self.stem(feat)
        for grid_size, block in zip(self.grid_sizes, self.blocks):
            x = block(x, *clusters[grid_size])
        return self.head(x)
