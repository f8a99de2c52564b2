"""The published query detectors ("detector-v1m1", "detector-v1m2"): a backbone's per-point features read by learned
queries.

`model = dict(type="detector-v1m1", num_classes=..., full_in_channels=..., backbone=dict(type="PT-v3m2", ...),
...)` is the published config, pasted as it is (DeepLearnPhysics/pimm configs/panda/panseg/
detector-v1m1-pt-v3m2-ft-{pid,vtx}-*.py; the class: pimm/models/panda_detector/detector_v1m1.py `Detector`).
Parameter names are the published ones: `backbone.*` (PT-v3m2), `decoder.*` (pimm.models.query_detector's
QueryDetector, and `decoder.stuff_head` with use_stuff_head), so published detector weights load by name.

pimm's call `model(coord, feat, offset, event_id=None, segment=None)` grid-samples the points as
DefaultSegmentorV2 does (grid_size, grid_origin), runs the backbone, and takes per voxel the decoder's
output, or with enc_mode every encoder level up-cast and concatenated (full_in_channels wide). With
use_stuff_head a point-wise classifier (stuff vs thing) picks the voxels the queries attend to: those
with stuff probability < 0.5, or in training with train_filter_use_gt the true non-stuff ones (segment).
Mask logits are computed per voxel and given to every point of that voxel; voxels left out as stuff get
-1e4. In eval mode the output also holds each event's post-processed instances (thresholds from the
config, published names: conf_threshold, mask_threshold, stuff_threshold, nms_sigma, min_points).

`model = dict(type="detector-v1m2", ..., predict_iou=False)` is the published momentum detector
(pimm/models/panda_detector/detector_v1m2_momentum.py, recipes detector-v1m2-pt-v3m2-ft-pid-*.py): the same model
plus the published momentum regressor (decoder.momentum_regressor: an MLP of each query and its class logits ->
one value, log10 p with the recipes' MomentumTransform) and, with predict_iou, the IoU head (decoder.iou_pred: the
sigmoid of an MLP of each query), whose prediction multiplies each query's post-processing score. pimm's own
momentum_head (detector-v1m1) is not an option of detector-v1m2.

What pimm does differently: an event whose every voxel is predicted stuff keeps its most thing-like voxel
(published: an assertion error); attention-mask annealing, nms_pre and nms_max are
refused at any value but the published recipes' (off); dropout and drop_path in the decoder likewise (0).
`weight_init` is pimm's own: "trunc_normal" (the default) starts the decoder and the stuff head as published,
"fan_in" as torch builds them (pimm.models.weight_init); the backbone has its own `weight_init`.
`query_type="anchored"` and `anchor_length` are pimm's own (published: "learned" only): queries anchored at
farthest-point-sampled voxels, each mask logit lowered with the squared distance to the query's anchor
(pimm.models.query_detector). `connect_radius` and `connect_min_points` are pimm's own too (published: nothing after
the post-processing): query_detector.connected_pieces, an instance cut where its points are apart and the thing
points no instance took made instances, after the published post-processing; connect_radius=None (the default) is off.
`connect_collinear` (pimm's, needs connect_radius) then joins touching instances of one class that lie on one line.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from pimm.config.validate import check_model_arguments
from pimm.models.point_seg_net import cluster_mean
from pimm.models.point_transformer_v3m2 import PointTransformerV3, grid_sample, point_features
from pimm.models.query_detector import (
    ANCHOR_LENGTH,
    PADDING_BIAS,
    DecoderOutput,
    EventInstances,
    EventPrediction,
    QueryDetector,
    connected_pieces,
    instances_from_queries,
    padded_slots,
)
from pimm.models.weight_init import initialise

# the other published options with no effect here: enable_flash, upcast_attention, upcast_softmax (attention is
# SDPA, in the autocast dtype) and attn_mask_anneal_steps / _warmup_steps / _progressive_delay (no annealing)


@dataclass
class DetectorOutput:
    """One forward over a batch: the decoder's batched predictions (mask logits over each event's points,
    PADDING_BIAS for points the queries did not attend), the stuff logit per point (with use_stuff_head) and,
    in eval mode, each event's instances."""

    decoder: DecoderOutput
    stuff_logits: torch.Tensor | None  # (N,)
    instances: list[EventInstances] | None = None

    @property
    def events(self) -> list[EventPrediction]:
        """One EventPrediction per event (views of the batched predictions)."""
        return self.decoder.events


class Detector(nn.Module):
    """Backbone + query decoder (module docstring). Defaults are the published class's."""

    def __init__(self, num_classes: int, full_in_channels: int, hidden_channels: int = 256, num_heads: int = 16,
                 num_queries: int = 32, backbone: dict | None = None, criteria: list | None = None, depth: int = 3,
                 mlp_ratio: float = 4.0, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, drop_path: float = 0.0,
                 layer_scale: float | None = None, pre_norm: bool = True, enable_flash: bool = True,
                 upcast_attention: bool = False, upcast_softmax: bool = False, pos_emb: bool = True,
                 attn_mask_anneal: bool = False, attn_mask_anneal_steps: int = 10000,
                 attn_mask_warmup_steps: int = 0, attn_mask_progressive: bool = False,
                 attn_mask_progressive_delay: int = 0, query_type: str = "learned", use_stuff_head: bool = False,
                 stuff_classes: list[int] | None = None, supervise_attn_mask: bool = True,
                 train_filter_use_gt: bool = False, mlp_point_proj: bool = False, stuff_threshold: float = 0.5,
                 mask_threshold: float = 0.5, conf_threshold: float = 0.5, nms_kernel: str = "gaussian",
                 nms_sigma: float = 2.0, nms_pre: int = -1, nms_max: int = -1, min_points: int = 2,
                 fill_uncovered: bool = False, momentum_head: bool = False, vertex_head: bool = False,
                 grid_size: float = 1.0, grid_origin: float = 0.0, weight_init: str = "trunc_normal",
                 anchor_length: float = ANCHOR_LENGTH, connect_radius: float | None = None,
                 connect_min_points: int = 20, connect_collinear: float | None = None) -> None:
        super().__init__()
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        check_model_arguments("detector-v1m1", arguments)
        self._build(arguments)

    def _build(self, a: dict, momentum_regressor: bool = False, predict_iou: bool = False) -> None:
        """The modules and settings from the checked constructor arguments `a`."""
        hidden_channels, full_in_channels = a["hidden_channels"], a["full_in_channels"]
        self.backbone = PointTransformerV3(**{k: v for k, v in a["backbone"].items() if k != "type"})
        self.decoder = QueryDetector(full_in_channels, a["num_classes"], num_queries=a["num_queries"],
                                     hidden_channels=hidden_channels, num_heads=a["num_heads"], depth=a["depth"],
                                     mlp_ratio=a["mlp_ratio"], qkv_bias=a["qkv_bias"], point_position=a["pos_emb"],
                                     mlp_point_proj=a["mlp_point_proj"], momentum_head=a.get("momentum_head", False),
                                     vertex_head=a["vertex_head"], momentum_regressor=momentum_regressor,
                                     predict_iou=predict_iou, weight_init=a["weight_init"],
                                     query_type=a["query_type"], anchor_length=a["anchor_length"])
        if a["use_stuff_head"]:  # detector_v1m1.py:684-689, named as published: decoder.stuff_head.{0,2}
            self.decoder.stuff_head = nn.Sequential(nn.Linear(full_in_channels, hidden_channels), nn.ReLU(),
                                                    nn.Linear(hidden_channels, 1))
            initialise(self.decoder.stuff_head, a["weight_init"])  # detector_v1m1.py:691 starts it with the rest
        self.num_classes = int(a["num_classes"])
        self.stuff_classes = tuple(int(c) for c in a["stuff_classes"] or [])
        self.use_stuff_head = bool(a["use_stuff_head"])
        self.train_filter_use_gt = bool(a["train_filter_use_gt"])
        self.criteria = a["criteria"]  # the published losses: pimm's task computes them (task.loss)
        self.postprocess = dict(score_threshold=float(a["conf_threshold"]), mask_threshold=float(a["mask_threshold"]),
                                min_points=int(a["min_points"]), nms_sigma=float(a["nms_sigma"]),
                                stuff_classes=self.stuff_classes, fill_uncovered=bool(a["fill_uncovered"]))
        self.stuff_threshold = float(a["stuff_threshold"])
        radius = a["connect_radius"]
        collinear = a["connect_collinear"]
        self.connect = None if radius is None else dict(radius=float(radius), min_points=int(a["connect_min_points"]),
                                                        collinear=None if collinear is None else float(collinear))
        self.grid_size, self.grid_origin = float(a["grid_size"]), float(a["grid_origin"])

    def forward(self, coord: torch.Tensor, feat: torch.Tensor, offset: torch.Tensor,
                event_id: torch.Tensor | None = None, segment: torch.Tensor | None = None) -> DetectorOutput:
        num_events = len(offset)
        level, voxel_of_point, counts = grid_sample(coord, offset, self.grid_size, self.grid_origin)
        voxel_input = cluster_mean(feat, voxel_of_point, counts).to(feat.dtype)
        result = self.backbone.forward_levels(voxel_input, level, event_id)
        voxel_feat = point_features(result, self.backbone.enc_mode)
        # the decoder's point positions are the x, y, z feature columns (names.FEATURE_COLUMNS): normalised and
        # augmented as the published point.coord that pos_emb reads (detector_v1m1.py:807), not in grid units
        voxel_position = voxel_input[:, :3]
        stuff_logits = None
        attend = torch.ones(len(voxel_feat), dtype=torch.bool, device=feat.device)
        if self.use_stuff_head:
            stuff_logits = self.decoder.stuff_head(voxel_feat).squeeze(-1)
            attend = self._thing_voxels(stuff_logits, level.batch, num_events, voxel_of_point, segment)
        voxel_counts = torch.bincount(level.batch[attend], minlength=num_events)
        decoded = self.decoder(voxel_feat, voxel_counts.cumsum(0), voxel_position, rows=attend.nonzero().squeeze(1))
        decoded = self._to_points(decoded, attend, level.batch, voxel_counts, voxel_of_point, offset)
        point_stuff = stuff_logits.index_select(0, voxel_of_point) if stuff_logits is not None else None
        output = DetectorOutput(decoded, point_stuff)
        if not self.training:
            output.instances = self.instances(output, coord)
        return output

    def _thing_voxels(self, stuff_logits: torch.Tensor, voxel_event: torch.Tensor, num_events: int,
                      voxel_of_point: torch.Tensor, segment: torch.Tensor | None) -> torch.Tensor:
        """(V,) bool: the voxels the queries attend to, at least one per event."""
        if self.training and self.train_filter_use_gt and segment is not None and self.stuff_classes:
            stuff_point = torch.isin(segment, torch.tensor(self.stuff_classes, device=segment.device))
            # a voxel is stuff when its every point is
            thing = torch.zeros(len(stuff_logits), dtype=torch.bool, device=segment.device)
            thing.index_fill_(0, voxel_of_point[~stuff_point], True)
        else:
            thing = stuff_logits.detach().sigmoid() < 0.5  # detector_v1m1.py:976
        # an event with no thing voxel keeps its most thing-like one: the decoder needs a point per event
        most_thing = torch.full((num_events,), torch.inf, device=stuff_logits.device).scatter_reduce(
            0, voxel_event, stuff_logits.detach().float(), "amin")
        has_thing = torch.zeros(num_events, dtype=torch.bool, device=thing.device)
        has_thing.index_fill_(0, voxel_event[thing], True)
        fallback = ~has_thing[voxel_event] & (stuff_logits.detach().float() == most_thing[voxel_event])
        return thing | fallback

    @staticmethod
    def _to_points(decoded: DecoderOutput, attend: torch.Tensor, voxel_event: torch.Tensor,
                   attended_counts: torch.Tensor, voxel_of_point: torch.Tensor, offset: torch.Tensor) -> DecoderOutput:
        """Mask logits over each event's attended voxels -> over its points (PADDING_BIAS where the point's
        voxel was not attended), every event and layer in one gather."""
        width = decoded.final.mask_logits.shape[-1]  # the padding column appended below
        attended_start = attended_counts.cumsum(0) - attended_counts
        column = torch.where(attend, attend.long().cumsum(0) - 1 - attended_start[voxel_event], width)
        point_counts = torch.diff(offset, prepend=offset.new_zeros(1))
        slot, _ = padded_slots(point_counts.tolist(), offset.device)
        point_column = torch.cat([column.index_select(0, voxel_of_point), column.new_full((1,), width)])[slot]

        def to_points(mask_logits: torch.Tensor) -> torch.Tensor:
            padded = torch.cat([mask_logits, mask_logits.new_full((*mask_logits.shape[:2], 1), PADDING_BIAS)], -1)
            return padded.gather(2, point_column.unsqueeze(1).expand(-1, padded.shape[1], -1))

        layers = [dataclasses.replace(layer, mask_logits=to_points(layer.mask_logits)) for layer in decoded.layers]
        return DecoderOutput(layers, point_counts.tolist())

    @torch.no_grad()
    def instances(self, output: DetectorOutput, coord: torch.Tensor,
                  connect: bool | dict = True) -> list[EventInstances]:
        """Each event's post-processed instances; points whose stuff probability is >= stuff_threshold
        are stuff (in no mask; instance -1, class the first stuff class, score the stuff probability). Then
        query_detector.connected_pieces on the points' coordinates coord (N, 3): with `connect` True, as the
        model's connect_* options say (nothing with connect_radius None); False: not at all (the published
        post-processing alone); a dict: with those arguments (radius, min_points, collinear)."""
        result, start = [], 0
        for prediction in output.events:
            layer = prediction.final
            size = layer.mask_logits.shape[1]
            stuff_prob = stuff = None
            if output.stuff_logits is not None and self.stuff_classes:
                stuff_prob = output.stuff_logits[start:start + size].float().sigmoid()
                stuff = stuff_prob >= self.stuff_threshold
            found = instances_from_queries(layer.class_logits, layer.mask_logits, **self.postprocess,
                                           thing=None if stuff is None else ~stuff, predicted_iou=layer.iou)
            if stuff is not None:
                found.instance[stuff] = -1
                found.point_class[stuff] = self.stuff_classes[0]
                found.score[stuff] = stuff_prob[stuff]
            pieces = self.connect if connect is True else connect or None
            if pieces is not None:
                found = connected_pieces(found, coord[start:start + size], layer.class_logits, layer.mask_logits,
                                         **pieces, stuff_classes=self.stuff_classes,
                                         thing=None if stuff is None else ~stuff)
            start += size
            result.append(found)
        return result


# the detector-v1m1 constructor's defaults, which detector-v1m2 shares
_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(Detector.__init__).parameters.items()
             if parameter.default is not inspect.Parameter.empty}


class MomentumDetector(Detector):
    """The published momentum detector, "detector-v1m2" (module docstring): Detector's arguments but momentum_head,
    plus predict_iou (detector_v1m2_momentum.py:1132), its defaults the published class's."""

    def __init__(self, num_classes: int, full_in_channels: int, predict_iou: bool = False, **options) -> None:
        nn.Module.__init__(self)
        arguments = {**{k: v for k, v in _DEFAULTS.items() if k != "momentum_head"}, **options,
                     "num_classes": num_classes, "full_in_channels": full_in_channels, "predict_iou": predict_iou}
        check_model_arguments("detector-v1m2", arguments)
        self._build(arguments, momentum_regressor=True, predict_iou=bool(predict_iou))
