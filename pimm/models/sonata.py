"""Sonata-style self-distillation's network ("Sonata-v1m1"): a student and an EMA teacher, each a PT-v3m2
encoder with prototype heads, named as published so that a pretrained payload's `student.backbone.*` is what
`pretrained.key_map="sonata"` loads into a fine-tuning model.

`model = dict(type="Sonata-v1m1", backbone=dict(type="PT-v3m2", ...), head_in_channels=..., ...)` is the
published config (DeepLearnPhysics/pimm configs/panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask.py;
the class: pimm/models/sonata/sonata_v1m1_base.py). The schedule, masking, temperature, momentum and loss
options live here as published; the SelfDistillation task (pimm.tasks.self_distillation) reads them and
runs the step. The teacher is built from the same backbone config with `teacher_custom` applied (published:
no drop path), starts as a copy of the student and never receives gradients: the task moves it by EMA
after each optimizer step. Both are parts of this module, so a checkpoint holds them and FSDP2 shards them
alike.

pimm's call: `model(coord, feat, offset, origin, view_id, point_mask=None, part="student"|"teacher",
heads=(...))` encodes a batch of views (each view one "event" of `offset`) as DefaultSegmentorV2 does
(grid_size, grid_origin), up-casts `up_cast_level` levels from the last encoder stage (published up_cast),
and returns per voxel of that level its features' prototype scores for each named head, the view of the
voxel, and the mean `origin` (the event-frame coordinate each point came from) of its points, which the
task matches across views. `point_mask` (training, student) puts the learned mask token on the voxels of
masked points.

What pimm does differently: match_max_k is accepted for the config but matching is by origin cell (see
pimm.tasks.self_distillation), which needs no k.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pimm.config.validate import check_model_arguments
from pimm.models.point_seg_net import cluster_mean
from pimm.models.point_transformer_v3m2 import PointTransformerV3, grid_sample

HEADS = ("mask_head", "unmask_head")


class OnlineCluster(nn.Module):
    """A prototype head (published name and layout): MLP (mlp.0, mlp.2) -> L2 normalised embedding ->
    weight-normalised Linear to the prototypes, its norm fixed to 1 (prototype.parametrizations.weight
    .original0, not trained)."""

    def __init__(self, in_channels: int, hidden_channels: int = 4096, embed_channels: int = 512,
                 num_prototypes: int = 4096) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_channels, hidden_channels), nn.GELU(),
                                 nn.Linear(hidden_channels, embed_channels))
        for layer in (self.mlp[0], self.mlp[2]):  # sonata_v1m1_base.py:56-61
            nn.init.trunc_normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        self.prototype = nn.utils.parametrizations.weight_norm(nn.Linear(embed_channels, num_prototypes, bias=False))
        self.prototype.parametrizations.weight.original0.data.fill_(1.0)
        self.prototype.parametrizations.weight.original0.requires_grad = False

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        eps = 1e-6 if feat.dtype == torch.float16 else 1e-12
        return self.prototype(F.normalize(self.mlp(feat), dim=-1, p=2, eps=eps))


@dataclass
class ViewScores:
    """One pass over a batch of views: per voxel of the up-cast level its prototype scores per head, view and
    mean origin coordinate."""

    scores: dict[str, torch.Tensor]  # head name -> (V, num_prototypes); "probe" -> (P, probe_classes)
    view: torch.Tensor  # (V,) the voxel's view (index into the batch's views)
    origin: torch.Tensor  # (V, 3)
    feat: torch.Tensor  # (V, head_in_channels) the up-cast features the heads read
    point_voxel: torch.Tensor  # (N,) each input point's voxel


class Sonata(nn.Module):
    """Student and teacher (module docstring); defaults are the published class's."""

    def __init__(self, backbone: dict, head_in_channels: int, head_hidden_channels: int = 4096,
                 head_embed_channels: int = 512, head_num_prototypes: int = 4096, teacher_custom: dict | None = None,
                 num_global_view: int = 2, num_local_view: int = 4, mask_size_start: float = 0.1,
                 mask_size_base: float = 0.4, mask_size_warmup_ratio: float = 0.05, mask_ratio_start: float = 0.3,
                 mask_ratio_base: float = 0.7, mask_ratio_warmup_ratio: float = 0.05, mask_jitter: float | None = None,
                 mask_jitter_start: float = 0.0, mask_jitter_base: float = 0.01, mask_jitter_warmup_ratio: float = 0.05,
                 teacher_temp_start: float = 0.04, teacher_temp_base: float = 0.07,
                 teacher_temp_warmup_ratio: float = 0.05, student_temp: float = 0.1,
                 mask_loss_weight: float = 2 / 8, roll_mask_loss_weight: float = 2 / 8,
                 unmask_loss_weight: float = 4 / 8, momentum_base: float = 0.996, momentum_final: float = 1.0,
                 match_max_k: int = 8, match_max_r: float = 0.08, up_cast_level: int = 2, grid_size: float = 1.0,
                 grid_origin: float = 0.0, probe_classes: int = 0) -> None:
        super().__init__()
        self.options = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        check_model_arguments("Sonata-v1m1", self.options)
        self.up_cast_level = int(up_cast_level)
        self.grid_size, self.grid_origin = float(grid_size), float(grid_origin)
        heads = [name for name, used in (("mask_head", mask_loss_weight > 0 or roll_mask_loss_weight > 0),
                                         ("unmask_head", unmask_loss_weight > 0)) if used]

        def part(backbone_cfg: dict) -> nn.ModuleDict:
            modules = {"backbone": PointTransformerV3(**{k: v for k, v in backbone_cfg.items() if k != "type"})}
            for name in heads:
                modules[name] = OnlineCluster(head_in_channels, head_hidden_channels, head_embed_channels,
                                              head_num_prototypes)
            return nn.ModuleDict(modules)

        self.student = part(backbone)
        self.teacher = part({**backbone, **(teacher_custom or {})})
        self.teacher.load_state_dict(self.student.state_dict())
        for p in self.teacher.parameters():
            p.requires_grad = False
        # pimm's online linear probe (nothing published): the classes of the teacher's detached features
        self.probe = nn.Linear(head_in_channels, probe_classes) if probe_classes > 0 else None

    def forward(self, coord: torch.Tensor, feat: torch.Tensor, offset: torch.Tensor, origin: torch.Tensor,
                view_id: torch.Tensor | None = None, point_mask: torch.Tensor | None = None, part: str = "student",
                head_of_view: torch.Tensor | None = None, probe_feat: torch.Tensor | None = None) -> ViewScores:
        """Encode a batch of views; `head_of_view` (views,) picks each view's head by its index in the
        part's heads (mask_head, unmask_head; None: every head scores every voxel, others' rows are 0).
        `probe_feat` (P, head_in_channels), detached features, get the probe's logits as scores["probe"]
        (in this call, so that data parallelism reduces the probe's gradients with the student's)."""
        network = self.student if part == "student" else self.teacher
        level, voxel_of_point, counts = grid_sample(coord, offset, self.grid_size, self.grid_origin)
        voxel_mask = None
        if point_mask is not None:  # a voxel takes the mask token when any of its points is masked
            voxel_mask = torch.zeros(level.num_voxels, dtype=torch.bool, device=coord.device)
            voxel_mask.index_fill_(0, voxel_of_point[point_mask], True)
        result = network.backbone.forward_levels(cluster_mean(feat, voxel_of_point, counts).to(feat.dtype), level,
                                                 view_id, voxel_mask)
        top = len(result.levels) - 1
        x = result.encoder_outputs[-1]
        for s in range(top, top - self.up_cast_level, -1):  # the published up_cast, coarse to fine
            x = torch.cat([result.encoder_outputs[s - 1], x.index_select(0, result.levels[s].parent)], dim=1)
        levels = result.levels[:top - self.up_cast_level + 1]
        view, voxel_origin, point_voxel = level_origins(levels, voxel_of_point, origin)
        heads = [name for name in HEADS if name in network]
        scores = {}
        for h, name in enumerate(heads):
            if head_of_view is None:
                scores[name] = network[name](x)
                continue
            rows = (head_of_view[view] == h).nonzero().squeeze(1)
            scored = network[name](x.index_select(0, rows))
            scores[name] = scored.new_zeros(len(x), scored.shape[1]).index_copy_(0, rows, scored)
        if probe_feat is not None and self.probe is not None:
            scores["probe"] = self.probe(probe_feat.detach())
        return ViewScores(scores, view, voxel_origin, x, point_voxel)

    def view_voxels(self, coord: torch.Tensor, offset: torch.Tensor, origin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(view, mean origin) of every voxel `forward` scores, without running the network: the grid
        and pooling depend on the coordinates alone."""
        level, voxel_of_point, _ = grid_sample(coord, offset, self.grid_size, self.grid_origin)
        levels = [level]
        for s in range(self._target_level):
            levels.append(levels[-1].pooled(self.student.backbone.stride[s]))
        return level_origins(levels, voxel_of_point, origin)[:2]

    @property
    def _target_level(self) -> int:
        """The level `forward` scores: up_cast_level below the last encoder stage's."""
        return len(self.student.backbone.stride) - self.up_cast_level


def model_options(model: dict) -> dict:
    """A Sonata-v1m1 model config with every constructor default filled in (what the task reads)."""
    defaults = {name: p.default for name, p in inspect.signature(Sonata).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **{k: v for k, v in model.items() if k != "type"}}


def level_origins(levels: list, voxel_of_point: torch.Tensor, origin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(view of each voxel of levels[-1], mean `origin` of its points (float32), each point's voxel of
    levels[-1]), `levels` from level 0 down, each pooled level's `parent` mapping the finer level's voxels."""
    points = torch.bincount(voxel_of_point, minlength=levels[0].num_voxels).to(torch.float64)
    sums = points.new_zeros(levels[0].num_voxels, 3).index_add_(0, voxel_of_point, origin.to(torch.float64))
    point_voxel = voxel_of_point
    for level_up in levels[1:]:
        sums = sums.new_zeros(level_up.num_voxels, 3).index_add_(0, level_up.parent, sums)
        points = points.new_zeros(level_up.num_voxels).index_add_(0, level_up.parent, points)
        point_voxel = level_up.parent.index_select(0, point_voxel)
    return levels[-1].batch, (sums / points.unsqueeze(1)).to(torch.float32), point_voxel
