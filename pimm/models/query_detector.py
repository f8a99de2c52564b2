"""A query detector for panoptic segmentation on the per-point features of any pimm backbone.

Q learned queries per event read the points of their own event through L decoder layers. Each layer
first predicts, from the queries it receives, one mask logit per (query, point) as the dot product of a
query embedding and a point embedding; that prediction, detached, becomes the additive attention bias
log(sigmoid(z) + 1e-6) of the layer's cross-attention (a soft mask: a point the query rejects is
weighted down, never cut off, so no query can lose every point). Then the queries attend to the
points, to each other, and pass an FFN (pre-norm). The class logits (num_classes + 1, the last is
no-object) come from the queries the layer puts out.

Published: DeepLearnPhysics/pimm pimm/models/panda_detector/detector_v1m1.py (decoder, blocks, queries)
and detector_v1m2_momentum.py (its momentum regressor and IoU head, named as published: momentum_regressor.backbone,
iou_pred.mlp); the defaults are configs/panda/panseg/
detector-v1m1-pt-v3m2-ft-pid-dec.py. Parameter names follow the published decoder's (query_feat,
query_embed, pos_emb.{0,2}, blocks.i.{norm1,norm2,norm3,norm_kv,cross_attn,self_attn,mlp,mask_mlp,anneal_progress},
final_norm, cls_pred, full_point_proj), so published decoder weights map by prefix.
What pimm does differently: events are padded to one batch instead of flash-attn varlen (the same
arithmetic); no stuff head (the published pid recipe filters "stuff" points with a point classifier
before the decoder); the vertex head is pimm's (nothing is published for it), and so is momentum_head, the
published regressor under pimm's earlier name (detector-v1m1 checkpoints keep it; detector-v1m2 has momentum_regressor).

query_type="anchored" is pimm's own (published: "learned" only, detector_v1m1.py:750-761). Each event's queries get
an anchor: Q of the points they read, picked by farthest-point sampling (the first point, then each time the point
farthest from those picked). A query starts as its learned embeddings plus its anchor's projected feature and
position embedding, and every layer's mask logit of a point has a spatial term subtracted,
softplus(anchor_scale(q)) * |x - anchor|^2 / anchor_length^2, with the scale the layer reads from the query
(starting at 0.1 for every query). A query can learn to keep to the neighbourhood of its anchor (a small
particle) or to leave it (scale near 0, a long track): two particles of one class far apart are no longer the
same to a query's mask. The anchors are a function of each event's points alone, the same at any batch
composition and rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pimm.errors import ConfigError
from pimm.models.weight_init import initialise
from pimm.names import QUERY_TYPES

# detector_v1m1.py:659 attn_mask_eps=1e-6
ATTENTION_MASK_EPS = 1e-6
# bias of padded (absent) points: exp(-1e4) is 0 in float32 and bfloat16, and it stays finite
PADDING_BIAS = -1e4
# query_type="anchored": every query's anchor scale starts at softplus(bias) = 0.1, so that a point anchor_length
# from the anchor starts 0.1 lower in mask logit, one 4 lengths away 1.6 lower
ANCHOR_SCALE_START = 0.1
# connect_radius: an event's pairs of points within the radius are listed (16 bytes each) up to this many; more is
# refused (a radius far above the points' spacing: 37,000 generated voxels at 12 have 4.9 million pairs)
MAX_CONNECT_PAIRS = 20_000_000
# query_type="anchored": the default length unit of the distance term, 8 voxels of pimm's x, y, z features (2 / 256 a
# voxel); the detectors' default too
ANCHOR_LENGTH = 0.0625


@dataclass
class LayerPrediction:
    """One decoder layer's predictions for one event's Q queries."""

    class_logits: torch.Tensor  # (Q, num_classes + 1), the last is no-object
    mask_logits: torch.Tensor  # (Q, N_event)
    momentum: torch.Tensor | None = None  # (Q,)
    vertex: torch.Tensor | None = None  # (Q, 3)
    iou: torch.Tensor | None = None  # (Q,) the predicted IoU of each query's mask with its instance, in [0, 1]


@dataclass
class EventPrediction:
    """The last layer's predictions (`final`) and those of every earlier layer (`aux`, first to last)."""

    final: LayerPrediction
    aux: list[LayerPrediction]

    @property
    def layers(self) -> list[LayerPrediction]:
        return [*self.aux, self.final]


@dataclass
class BatchLayerPrediction:
    """One decoder layer's predictions for every event of a batch, events padded to one length."""

    class_logits: torch.Tensor  # (B, Q, num_classes + 1)
    mask_logits: torch.Tensor  # (B, Q, P): event b's points are its first counts[b] columns
    momentum: torch.Tensor | None = None  # (B, Q)
    vertex: torch.Tensor | None = None  # (B, Q, 3)
    iou: torch.Tensor | None = None  # (B, Q)

    def event(self, b: int, num_points: int) -> LayerPrediction:
        """Event b's predictions over its own points (views, no copy)."""
        return LayerPrediction(self.class_logits[b], self.mask_logits[b, :, :num_points],
                               None if self.momentum is None else self.momentum[b],
                               None if self.vertex is None else self.vertex[b],
                               None if self.iou is None else self.iou[b])


@dataclass
class DecoderOutput:
    """Every decoder layer's batched predictions (first to last) and each event's point count: what the loss
    reads as it is; `events` gives one EventPrediction per event (views) for post-processing."""

    layers: list[BatchLayerPrediction]
    counts: list[int]  # points of each event; mask_logits columns past them are padding

    @property
    def final(self) -> BatchLayerPrediction:
        return self.layers[-1]

    def event(self, b: int) -> EventPrediction:
        size = self.counts[b]
        return EventPrediction(final=self.final.event(b, size),
                               aux=[layer.event(b, size) for layer in self.layers[:-1]])

    @property
    def events(self) -> list[EventPrediction]:
        return [self.event(b) for b in range(len(self.counts))]

    @classmethod
    def from_events(cls, events: list[EventPrediction]) -> DecoderOutput:
        """Per-event predictions (every event with the same layers and queries) -> one padded batch."""
        counts = [prediction.final.mask_logits.shape[1] for prediction in events]

        def stack(field: str, layer: int) -> torch.Tensor | None:
            values = [getattr(prediction.layers[layer], field) for prediction in events]
            return None if values[0] is None else torch.stack(values)

        layers = []
        for layer in range(len(events[0].layers)):
            masks = [prediction.layers[layer].mask_logits for prediction in events]
            padded = masks[0].new_full((len(masks), masks[0].shape[0], max(counts)), PADDING_BIAS)
            for b, mask in enumerate(masks):
                padded[b, :, :mask.shape[1]] = mask
            layers.append(BatchLayerPrediction(stack("class_logits", layer), padded, stack("momentum", layer),
                                               stack("vertex", layer), stack("iou", layer)))
        return cls(layers, counts)


class MLP(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_channels, hidden_channels)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MomentumRegressor(nn.Module):
    """The published momentum head (detector_v1m2_momentum.py:26-45): an MLP on a query and its class logits
    without no-object -> one value per query (log10 p when the recipe's MomentumTransform made the targets so)."""

    def __init__(self, hidden_channels: int, num_classes: int) -> None:
        super().__init__()
        self.backbone = MLP(hidden_channels + num_classes, hidden_channels, 1)

    def forward(self, q: torch.Tensor, class_logits: torch.Tensor) -> torch.Tensor:
        return self.backbone(torch.cat([q, class_logits[..., :-1]], -1)).squeeze(-1)


class IoUPredictor(nn.Module):
    """The published mask-quality head (detector_v1m2_momentum.py:48-66): an MLP on a query -> the sigmoid, its
    predicted IoU with the instance it is matched to."""

    def __init__(self, hidden_channels: int) -> None:
        super().__init__()
        self.mlp = MLP(hidden_channels, hidden_channels, 1)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.mlp(q).squeeze(-1).sigmoid()


def multi_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """(B, Lq, C) x (B, Lk, C) -> (B, Lq, C); bias (B, Lq, Lk) is added to every head's scores."""
    batch, length_q, channels = q.shape

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, t.shape[1], num_heads, channels // num_heads).transpose(1, 2)

    bias = bias.unsqueeze(1).to(q.dtype) if bias is not None else None
    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias)
    return out.transpose(1, 2).reshape(batch, length_q, channels)


class CrossAttention(nn.Module):
    def __init__(self, channels: int, num_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(channels, channels, bias=qkv_bias)
        self.k_proj = nn.Linear(channels, channels, bias=qkv_bias)
        self.v_proj = nn.Linear(channels, channels, bias=qkv_bias)
        self.proj = nn.Linear(channels, channels)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = multi_head_attention(self.q_proj(q), self.k_proj(k), self.v_proj(v), self.num_heads, bias)
        return self.proj(out)


class SelfAttention(nn.Module):
    """Attention among one event's queries; the positional part enters queries and keys, not values."""

    def __init__(self, channels: int, num_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.channels, self.num_heads = channels, num_heads
        self.q = nn.Linear(channels, channels, bias=qkv_bias)
        self.kv = nn.Linear(channels, 2 * channels, bias=qkv_bias)  # published layout: keys, then values
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k_weight, v_weight = self.kv.weight.split(self.channels)
        k_bias, v_bias = self.kv.bias.split(self.channels) if self.kv.bias is not None else (None, None)
        k = F.linear(x + pos, k_weight, k_bias)
        v = F.linear(x, v_weight, v_bias)
        return self.proj(multi_head_attention(self.q(x + pos), k, v, self.num_heads, None))


class DecoderLayer(nn.Module):
    """Mask prediction, masked cross-attention to the points, self-attention among queries, FFN (pre-norm)."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, anchored: bool = False) -> None:
        super().__init__()
        self.norm_kv = nn.LayerNorm(channels)
        self.mask_mlp = MLP(channels, channels, channels)
        self.norm1 = nn.LayerNorm(channels)
        self.cross_attn = CrossAttention(channels, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(channels)
        self.self_attn = SelfAttention(channels, num_heads, qkv_bias)
        self.norm3 = nn.LayerNorm(channels)
        self.mlp = MLP(channels, int(channels * mlp_ratio), channels)
        # the published block's attention-mask annealing progress (detector_v1m1.py:326), in its checkpoints:
        # always 0 here (pimm does not anneal; validate refuses attn_mask_anneal=True), kept so they load by name
        self.register_buffer("anneal_progress", torch.zeros(()))
        self.anchor_scale = nn.Linear(channels, 1) if anchored else None  # query_type="anchored" (pimm's)

    def forward(self, q: torch.Tensor, q_pos: torch.Tensor, points: torch.Tensor, point_pos: torch.Tensor,
                padding: torch.Tensor,
                anchor_distance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q, q_pos (B, Q, C); points, point_pos (B, P, C); padding (B, P) True where no point; anchor_distance
        (B, Q, P) with query_type="anchored": |x - anchor|^2 / anchor_length^2
        -> (updated queries (B, Q, C), mask logits of the incoming queries (B, Q, P))."""
        points = self.norm_kv(points)
        mask_logits = torch.einsum("bqc,bpc->bqp", self.mask_mlp(q), points)
        if anchor_distance is not None:
            mask_logits = mask_logits.addcmul(F.softplus(self.anchor_scale(q)), anchor_distance, value=-1)
        # detached as published (detector_v1m1.py:447): the mask loss, not the attention, trains mask_mlp
        bias = mask_logits.detach().sigmoid().add_(ATTENTION_MASK_EPS).log_()
        bias.masked_fill_(padding.unsqueeze(1), PADDING_BIAS)
        q_norm = self.norm1(q)
        q = q + self.cross_attn(q_norm + q_pos, points + point_pos, points, bias)
        q = q + self.self_attn(self.norm2(q), q_pos)
        q = q + self.mlp(self.norm3(q))
        return q, mask_logits


class QueryDetector(nn.Module):
    """Per-point features of a batch -> per event, the class and mask logits of Q queries at every layer.

    Defaults are the published particle (pid) detector's; the interaction (vtx) recipe uses
    num_queries=12, num_classes=2, mlp_point_proj=False (detector-v1m1-pt-v3m2-ft-vtx-dec.py:28,32).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        num_queries: int = 32,  # detector-v1m1-pt-v3m2-ft-pid-dec.py:34
        hidden_channels: int = 256,  # pid-dec.py:68
        num_heads: int = 16,  # pid-dec.py:69
        depth: int = 3,  # pid-dec.py:70
        mlp_ratio: float = 4.0,  # pid-dec.py:71
        qkv_bias: bool = True,  # pid-dec.py:72
        point_position: bool = True,  # pid-dec.py:82 pos_emb=True: an MLP of each point's coordinates
        mlp_point_proj: bool = True,  # pid-dec.py:67: MLPs (not Linears) for the point projection and classes
        momentum_head: bool = False,  # pimm's name for the published MomentumRegressor (detector-v1m1 checkpoints)
        vertex_head: bool = False,  # pimm's: nothing published
        momentum_regressor: bool = False,  # detector_v1m2_momentum.py:728, as published: momentum_regressor.backbone
        predict_iou: bool = False,  # detector_v1m2_momentum.py:731-733: iou_pred.mlp
        weight_init: str = "trunc_normal",  # detector_v1m1.py:693-698; pimm.models.weight_init
        query_type: str = "learned",  # detector_v1m1.py:750 ("learned", the only one published); "anchored": pimm's
        anchor_length: float = ANCHOR_LENGTH,  # pimm's
    ) -> None:
        super().__init__()
        if hidden_channels % num_heads:
            raise ValueError(f"hidden_channels={hidden_channels} is not a multiple of num_heads={num_heads}; "
                             "choose num_heads that divides it")
        if num_queries < 1 or depth < 1:
            raise ValueError(f"num_queries={num_queries} and depth={depth} must both be at least 1")
        if query_type not in QUERY_TYPES:
            raise ValueError(f"query_type={query_type!r} is not allowed: use one of {', '.join(QUERY_TYPES)}")
        if not anchor_length > 0:
            raise ValueError(f"anchor_length={anchor_length!r} must be > 0 (a length in the decoder's coordinates)")
        if momentum_head and momentum_regressor:
            raise ValueError("momentum_head and momentum_regressor are the same head under two names (pimm's and the "
                             "published); build the decoder with one of them")
        self.num_classes = num_classes
        self.query_feat = nn.Embedding(num_queries, hidden_channels)
        self.query_embed = nn.Embedding(num_queries, hidden_channels)  # the queries' learned positional part
        # named as published (detector_v1m1.py:623-627): pos_emb.0 and pos_emb.2
        self.pos_emb = (nn.Sequential(nn.Linear(3, hidden_channels), nn.GELU(),
                                      nn.Linear(hidden_channels, hidden_channels)) if point_position else None)
        self.full_point_proj = (MLP(in_channels, hidden_channels, hidden_channels) if mlp_point_proj
                                else nn.Linear(in_channels, hidden_channels))
        self.anchored = query_type == "anchored"
        self.anchor_length = float(anchor_length)
        self.blocks = nn.ModuleList(DecoderLayer(hidden_channels, num_heads, mlp_ratio, qkv_bias, self.anchored)
                                    for _ in range(depth))
        self.final_norm = nn.LayerNorm(hidden_channels)
        self.cls_pred = (MLP(hidden_channels, hidden_channels, num_classes + 1) if mlp_point_proj
                         else nn.Linear(hidden_channels, num_classes + 1))
        # the published regressor reads the query and its class logits (no-object left out)
        self.momentum_head = MLP(hidden_channels + num_classes, hidden_channels, 1) if momentum_head else None
        self.vertex_head = MLP(hidden_channels, hidden_channels, 3) if vertex_head else None
        self.momentum_regressor = MomentumRegressor(hidden_channels, num_classes) if momentum_regressor else None
        self.iou_pred = IoUPredictor(hidden_channels) if predict_iou else None
        initialise(self, weight_init)
        for block in self.blocks if self.anchored else ():
            nn.init.zeros_(block.anchor_scale.weight)
            nn.init.constant_(block.anchor_scale.bias, math.log(math.expm1(ANCHOR_SCALE_START)))

    def forward(self, feat: torch.Tensor, offset: torch.Tensor, coord: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> DecoderOutput:
        """feat (N, in_channels), offset (B,) cumulative point counts, coord (N, 3) (needed with
        point_position) -> every layer's predictions, batched: mask logits over each event's own points.

        rows (long, ascending): the rows of feat and coord the queries read (offset counts them); None: all. The
        projections run on every row and the rows are picked from their outputs: fewer channels to gather."""
        if (self.pos_emb is not None or self.anchored) and coord is None:
            raise ValueError("QueryDetector(point_position=True) and query_type='anchored' need coord (N, 3): pass "
                             "the points' coordinates, or build it with point_position=False and query_type='learned'")
        counts = torch.diff(offset, prepend=offset.new_zeros(1)).tolist()
        read = len(feat) if rows is None else len(rows)
        if read != sum(counts) or min(counts) < 1:
            raise ValueError(f"offset {offset.tolist()} does not split {read} points into events of at "
                             "least one point; offset is the cumulative point count per event")
        slot, padding = padded_slots(counts, feat.device)
        if rows is not None:  # slot's rows of the read points -> rows of feat; padding stays one past the last
            slot = torch.cat([rows, rows.new_full((1,), len(feat))]).index_select(0, slot.flatten()).view_as(slot)
        points = _pad_events(self.full_point_proj(feat), slot)
        point_pos = _pad_events(self.pos_emb(coord.to(feat.dtype)), slot) if self.pos_emb is not None \
            else torch.zeros_like(points)
        batch = len(counts)
        q = self.query_feat.weight.unsqueeze(0).expand(batch, -1, -1)
        q_pos = self.query_embed.weight.unsqueeze(0).expand(batch, -1, -1)
        anchor_distance = None
        if self.anchored:
            position = _pad_events(coord.float(), slot)  # float32 under autocast too: distances of voxels
            anchor = farthest_points(position, padding, q.shape[1])
            q = q + _pick(points, anchor)
            q_pos = q_pos + _pick(point_pos, anchor)
            anchor_distance = torch.cdist(_pick(position, anchor), position).square_().div_(self.anchor_length ** 2)
        layers = []
        for block in self.blocks:
            q, mask_logits = block(q, q_pos, points, point_pos, padding, anchor_distance)
            layers.append(self._heads(q, mask_logits))
        return DecoderOutput(layers, counts)

    def _heads(self, q: torch.Tensor, mask_logits: torch.Tensor) -> BatchLayerPrediction:
        q = self.final_norm(q)
        class_logits = self.cls_pred(q)
        momentum = None
        if self.momentum_head is not None:
            momentum = self.momentum_head(torch.cat([q, class_logits[..., :-1]], -1)).squeeze(-1)
        if self.momentum_regressor is not None:
            momentum = self.momentum_regressor(q, class_logits)
        vertex = self.vertex_head(q) if self.vertex_head is not None else None
        iou = self.iou_pred(q) if self.iou_pred is not None else None
        return BatchLayerPrediction(class_logits, mask_logits, momentum, vertex, iou)


@torch.no_grad()
def farthest_points(position: torch.Tensor, padding: torch.Tensor, count: int) -> torch.Tensor:
    """position (B, P, 3), padding (B, P) True where no point -> (B, count) indices of each event's anchors: its
    first point, then each time the point farthest from those already picked (a point picked again once every
    point is picked: an event of fewer points than count repeats anchors). Padding is never picked. In the
    dtype of `position` whatever autocast says (it would take the products to bfloat16: 8 bits of |x|^2)."""
    with torch.autocast(position.device.type, enabled=False):
        return _farthest_points(position, padding, count)


def _farthest_points(position: torch.Tensor, padding: torch.Tensor, count: int) -> torch.Tensor:
    batch = torch.arange(len(position), device=position.device)
    norm = position.square().sum(-1).unsqueeze(1)  # (B, 1, P): |x - c|^2 = |x|^2 - 2 x.c + |c|^2, one product a pick
    points = position.transpose(1, 2)
    nearest = torch.full(padding.shape, math.inf, dtype=position.dtype, device=position.device)
    nearest.masked_fill_(padding, -1.0)  # below every (squared) distance: never the farthest, never lowered
    picked = torch.zeros(len(position), count, dtype=torch.long, device=position.device)
    current = picked[:, 0]
    for i in range(1, count):
        centre = position[batch, current].unsqueeze(1)  # (B, 1, 3)
        distance = torch.baddbmm(norm, centre, points, alpha=-2).squeeze(1).add_(centre.square().sum(-1))
        torch.minimum(nearest, distance, out=nearest)
        current = nearest.argmax(1)
        picked[:, i] = current
    return picked


def _pick(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (B, P, C), index (B, K) -> (B, K, C): each event's rows at its indices."""
    return values.gather(1, index.unsqueeze(-1).expand(-1, -1, values.shape[-1]))


def padded_slots(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Points packed by event -> (slot (B, P): the packed row of each padded position, N (one past the last
    row) where an event has no point; padding (B, P) bool, True there)."""
    count = torch.tensor(counts, device=device)
    column = torch.arange(max(counts), device=device)
    padding = column >= count.unsqueeze(1)
    slot = (count.cumsum(0) - count).unsqueeze(1) + column
    return slot.masked_fill(padding, int(count.sum())), padding


def _pad_events(values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """(N, C) packed by event -> (B, P, C), zeros after each event's points (one gather each way)."""
    padded = torch.cat([values, values.new_zeros(1, values.shape[1])])
    return padded.index_select(0, slot.flatten()).view(*slot.shape, values.shape[1])


@dataclass
class EventInstances:
    """Post-processed predictions of one event."""

    instance: torch.Tensor  # (N,) long, 0..K-1 by decreasing score, -1 where no instance
    point_class: torch.Tensor  # (N,) long, the instance's class, -1 where no instance
    score: torch.Tensor  # (N,) float, the instance's score, 0 where no instance
    query: torch.Tensor  # (K,) long, the query each instance comes from
    instance_score: torch.Tensor  # (K,) float
    instance_class: torch.Tensor  # (K,) long


@torch.no_grad()
def instances_from_queries(
    class_logits: torch.Tensor,
    mask_logits: torch.Tensor,
    score_threshold: float = 0.5,  # detector_v1m1.py:1070 conf_threshold
    mask_threshold: float = 0.5,  # detector_v1m1.py:1069 (and pid-dec.py:241)
    min_points: int = 2,  # detector_v1m1.py:1075
    nms_sigma: float = 2.0,  # detector_v1m1.py:1072, gaussian matrix NMS
    stuff_classes: tuple[int, ...] = (),
    thing: torch.Tensor | None = None,
    fill_uncovered: bool = False,  # detector_v1m1.py:1076
    predicted_iou: torch.Tensor | None = None,
) -> EventInstances:
    """One event's queries (class_logits (Q, K+1), mask_logits (Q, N)) -> per point instance, class, score.

    As the published postprocess.py does it: a query is a candidate when its most probable class is
    neither no-object nor a stuff class, that probability is >= score_threshold, and its mask
    (sigmoid > mask_threshold) has >= min_points points. Its score is the class probability times the
    mean mask probability over its mask, decayed by gaussian matrix NMS against higher-scored masks of
    the same class; scores below score_threshold are dropped. In decreasing score each instance takes
    the points of its mask that no better instance took, if at least min_points remain. `thing` (N,) bool
    (the points the stuff head calls things) limits every mask before any of this. With fill_uncovered, the
    candidates then, in decreasing score before NMS, each make one more instance of the points of their mask
    still untaken, if at least min_points (postprocess.py: fill_uncovered). `predicted_iou` (Q,) (the IoU head's)
    multiplies each candidate's score before NMS (postprocess.py:197-198).
    """
    num_classes = class_logits.shape[1] - 1
    num_points = mask_logits.shape[1]
    mask_prob = mask_logits.float().sigmoid()
    masks = mask_prob > mask_threshold
    if thing is not None:
        masks &= thing.unsqueeze(0)
    class_prob, label = class_logits.float().softmax(-1).max(-1)
    candidate = (label != num_classes) & (class_prob >= score_threshold) & (masks.sum(1) >= min_points)
    for stuff in stuff_classes:
        candidate &= label != stuff
    query = candidate.nonzero().squeeze(1)
    masks, label = masks[query], label[query]
    mask_score = (mask_prob[query] * masks).sum(1) / masks.sum(1).clamp(min=1)
    combined = class_prob[query] * mask_score
    if predicted_iou is not None:
        combined = combined * predicted_iou.float()[query]
    score = _matrix_nms(masks, label, combined, nms_sigma)
    order = torch.argsort(score, descending=True, stable=True)
    order = order[score[order] >= score_threshold]

    instance = torch.full((num_points,), -1, dtype=torch.long, device=mask_logits.device)
    point_class = torch.full_like(instance, -1)
    point_score = torch.zeros(num_points, device=mask_logits.device)
    kept = []
    for i in order.tolist():
        free = masks[i] & (instance < 0)
        if int(free.sum()) < min_points:
            continue
        instance[free] = len(kept)
        point_class[free] = label[i]
        point_score[free] = score[i]
        kept.append((i, score[i]))
    if fill_uncovered:
        for i in torch.argsort(combined, descending=True, stable=True).tolist():
            free = masks[i] & (instance < 0)
            if int(free.sum()) < min_points:
                continue
            instance[free] = len(kept)
            point_class[free] = label[i]
            point_score[free] = combined[i]
            kept.append((i, combined[i]))
    rows = torch.tensor([i for i, _ in kept], dtype=torch.long, device=mask_logits.device)
    instance_score = torch.stack([s for _, s in kept]) if kept else score[:0]
    return EventInstances(instance, point_class, point_score, query[rows], instance_score, label[rows])


@torch.no_grad()
def connected_pieces(found: EventInstances, coord: torch.Tensor, class_logits: torch.Tensor,
                     mask_logits: torch.Tensor, radius: float, min_points: int, stuff_classes: tuple[int, ...] = (),
                     thing: torch.Tensor | None = None, collinear: float | None = None) -> EventInstances:
    """pimm's own post-processing after the published one (the detectors' connect_radius): a particle's points are
    connected, so an instance is cut where its points are, and thing points no query took are not lost.

    Points are connected when within `radius` of each other (coord (N, 3), the units of the model's input
    coordinates), through points of the same instance (or of no instance). Every instance keeps its largest piece
    and its pieces of fewer than min_points; each other piece becomes an instance of its own (its query, class and
    score). Each piece of at least min_points of the points in no instance that `thing` (N,) bool (the stuff
    head's; None: every point) calls things becomes an instance: of the query with the largest summed mask
    probability over it, that query's most probable class that is neither no-object nor stuff, scored by that
    class's probability times the query's mean mask probability over the piece. With `collinear` (a |cosine| in
    (0, 1)), instances of one class that touch (two of their points within `radius`) and lie on one line are then
    joined (`join_collinear`): a track split between queries is one particle again. Instances are numbered again by
    decreasing score (ties: the published order, then the pieces). ConfigError when the radius puts more than
    MAX_CONNECT_PAIRS pairs of the event's points within reach (counted before any is listed)."""
    # deferred: scipy.spatial and scipy.sparse cost ~0.5 s to import; only this option of evaluation needs them
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    device = found.instance.device
    instance = found.instance.cpu().numpy()
    group = instance.copy()  # the set a point connects within: its instance, or -2 for a free thing point
    free = instance < 0
    if thing is not None:
        free &= thing.cpu().numpy()
    group[free] = -2
    size = len(instance)
    position = coord.detach().double().cpu().numpy()
    tree = cKDTree(position)
    within = (tree.count_neighbors(tree, radius) - size) // 2  # counted without listing them: cheap
    if within > MAX_CONNECT_PAIRS:
        raise ConfigError(f"model.connect_radius={radius:g} puts {within:,} pairs of points within reach in an event "
                          f"of {size:,} points, more than {MAX_CONNECT_PAIRS:,} (memory): lower connect_radius (in "
                          "the units of the points' coordinates: voxels for PILArNet-M, where 12 works) or set it to "
                          "None")
    near = tree.query_pairs(radius, output_type="ndarray")
    pairs = near[(group[near[:, 0]] == group[near[:, 1]]) & (group[near[:, 0]] != -1)]
    graph = coo_matrix((np.ones(len(pairs), dtype=np.int8), (pairs[:, 0], pairs[:, 1])), shape=(size, size))
    _, piece = connected_components(graph, directed=False)
    piece_size = np.bincount(piece, minlength=size)

    queries, scores, classes = found.query.tolist(), found.instance_score.tolist(), found.instance_class.tolist()
    source = instance.copy()  # the instance each point is in after this: published ids, then new ones
    for k in range(len(queries)):
        members = np.unique(piece[instance == k])
        members = members[np.argsort(-piece_size[members], kind="stable")]
        for extra in members[1:][piece_size[members[1:]] >= min_points]:
            source[piece == extra] = len(queries)
            queries.append(queries[k])
            scores.append(scores[k])
            classes.append(classes[k])
    free_pieces = np.unique(piece[free])
    free_pieces = free_pieces[piece_size[free_pieces] >= min_points]
    if len(free_pieces):  # the queries' probabilities only where a piece of untaken points needs them
        mask_prob = mask_logits.float().sigmoid()
        class_prob = class_logits.float().softmax(-1)[:, :-1].clone()
        class_prob[:, list(stuff_classes)] = -1.0
    for extra in free_pieces:
        rows = torch.as_tensor(np.flatnonzero(piece == extra), device=mask_prob.device)
        summed = mask_prob[:, rows].sum(1)
        query = int(summed.argmax())
        probability, label = class_prob[query].max(0)
        source[rows.cpu().numpy()] = len(queries)
        queries.append(query)
        scores.append(float(probability) * float(summed[query]) / len(rows))
        classes.append(int(label))

    if not queries:
        return found
    kept = range(len(queries))
    if collinear is not None:
        source = join_collinear(source, near, position, np.asarray(classes), np.asarray(scores), collinear)
        kept = np.unique(source[source >= 0]).tolist()  # a joined instance's other ids are left without points
    order = sorted(kept, key=lambda k: -scores[k])  # stable: published order, then the pieces
    renumber = np.empty(len(queries), dtype=np.int64)
    renumber[order] = np.arange(len(order))
    new_instance = torch.as_tensor(np.where(source >= 0, renumber[np.maximum(source, 0)], -1), device=device)
    instance_score = torch.tensor([scores[k] for k in order], dtype=torch.float32, device=device)
    instance_class = torch.tensor([classes[k] for k in order], dtype=torch.long, device=device)
    taken = new_instance >= 0
    point_class = found.point_class.clone()
    point_score = found.score.clone()
    point_class[taken] = instance_class[new_instance[taken]]
    point_score[taken] = instance_score[new_instance[taken]]
    return EventInstances(new_instance, point_class, point_score,
                          torch.tensor([queries[k] for k in order], dtype=torch.long, device=device),
                          instance_score, instance_class)


def join_collinear(instance: np.ndarray, near: np.ndarray, position: np.ndarray, instance_class: np.ndarray,
                   score: np.ndarray, min_cosine: float) -> np.ndarray:
    """Per point instance ids (N,) (-1: none) -> the same with instances that touch and lie on one line joined.

    Two instances of one class (instance_class (K,)) touch when a pair of `near` (M, 2) (point rows within reach of
    each other) has a point in each. Each instance of at least 3 points has a centre (the mean of its `position`
    rows (N, 3)) and an axis (the first principal axis of its points); two touching ones are joined when their axes
    and the line between their centres are all within arccos(min_cosine) of each other (|cosine| > min_cosine, either
    direction). Joins chain (a track split in three is one again). A joined instance takes the id of its member of
    highest `score` (K,) (ties: the lower id); the others are left without points."""
    a, b = instance[near[:, 0]], instance[near[:, 1]]
    touch = (a >= 0) & (b >= 0) & (a != b)
    count = len(instance_class)
    code = np.unique(np.minimum(a[touch], b[touch]) * count + np.maximum(a[touch], b[touch]))  # each pair once
    pairs = np.stack([code // count, code % count], 1)
    pairs = pairs[instance_class[pairs[:, 0]] == instance_class[pairs[:, 1]]]
    centre, axis = {}, {}
    for k in np.unique(pairs).tolist():
        points = position[instance == k]
        if len(points) >= 3:
            centre[k] = points.mean(0)
            axis[k] = np.linalg.svd(points - centre[k], full_matrices=False)[2][0]
    root = np.arange(len(instance_class))

    def find(k: int) -> int:
        while root[k] != k:
            root[k] = root[root[k]]
            k = int(root[k])
        return k

    for x, y in pairs.tolist():
        if x not in axis or y not in axis:
            continue
        line = centre[y] - centre[x]
        length = np.linalg.norm(line)
        if length == 0:
            continue
        line = line / length
        if min(abs(axis[x] @ axis[y]), abs(axis[x] @ line), abs(axis[y] @ line)) > min_cosine:
            x, y = find(x), find(y)
            best, other = (x, y) if (-score[x], x) <= (-score[y], y) else (y, x)
            root[other] = best
    joined = np.array([find(k) for k in range(len(instance_class))], dtype=np.int64)
    return np.where(instance >= 0, joined[np.maximum(instance, 0)], -1)


def _matrix_nms(masks: torch.Tensor, label: torch.Tensor, score: torch.Tensor, sigma: float) -> torch.Tensor:
    """Gaussian matrix NMS (SOLOv2): each mask's score decays with its IoU to higher-scored masks of its
    class, compensated by how much those masks were themselves suppressed. Returns the decayed scores."""
    if len(score) == 0:
        return score
    order = torch.argsort(score, descending=True, stable=True)
    m = masks[order].float()
    inter = m @ m.T
    area = m.sum(1)
    iou = inter / (area[:, None] + area[None, :] - inter).clamp(min=1e-6)
    # iou[i, j] for i scored above j, same class only
    iou = (iou * (label[order][:, None] == label[order][None, :])).triu(diagonal=1)
    worst_overlap_of_higher = iou.max(0).values  # how suppressed each mask i is itself
    decay = torch.exp(-sigma * iou**2) / torch.exp(-sigma * worst_overlap_of_higher[:, None] ** 2)
    decayed = torch.empty_like(score)
    decayed[order] = score[order] * decay.min(0).values
    return decayed
