"""The pieces of Sonata-style self-distillation whose results must not depend on how many processes
ran it: Sinkhorn-Knopp teacher targets over the global batch, the EMA teacher update, and schedules
that are functions of the global step.

* `sinkhorn_knopp` normalises the teacher's prototype scores over every sample of the optimizer step:
  all micro-batches of this rank (pass them together, before any student backward) and every rank
  (sums all-reduced over `group`). The published code (DeepLearnPhysics/pimm
  `pimm/models/sonata/sonata_v1m1_base.py`, `sinkhorn_knopp`) all-reduces over the ranks of one
  forward, so with gradient accumulation each micro-batch is normalised alone and the targets change
  with the number of GPUs; here 1 rank, N ranks and 1 rank x N micro-batches give the same targets
  within float rounding. It also subtracts the global maximum before the exponential (the published
  code does not), which changes nothing mathematically (the first step divides by the total) and keeps
  low temperatures finite.
* `ema_update`: teacher = m * teacher + (1 - m) * student, parameter by parameter.
* `cosine_schedule(step, ...)`: the published `CosineScheduler(...).get(step)` (`pimm/utils/scheduler.py`):
  a linear warm-up from `start` to `base` over `warmup` steps, then a half cosine from `base` to `final`
  until `total`, `final` after. A pure function of the global step, so a resume (at any world size)
  continues every schedule where it stopped; the published hooks re-derive their position from
  `start_epoch * len(train_loader)`, which rewinds a mid-epoch resume to the epoch's start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pimm.data.collate import split_events
from pimm.data.multi_view import MultiViewSettings, multi_view
from pimm.distributed.env import all_reduce_sum
from pimm.tasks.base import Meter, Task, TaskOutput
from pimm.tasks.metrics import metrics_from_confusion


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group == _NO_GROUP:
        return tensor
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


@torch.no_grad()
def sinkhorn_knopp(scores: list[torch.Tensor], temperature: float, iterations: int = 3,
                   group=None) -> list[torch.Tensor]:
    """Teacher targets (soft assignments to K prototypes) of the samples of one optimizer step.

    `scores`: this rank's micro-batches of teacher logits, each (n_i, K); returns the targets in the
    same pieces, each row summing to 1. Each iteration gives every prototype the same total weight over
    all samples of all micro-batches of all ranks of `group`, then every sample total weight 1/n."""
    sizes = [len(s) for s in scores]
    logits = torch.cat([s.float() for s in scores]) / temperature  # (n_local, K)
    prototypes = logits.shape[1]
    top = logits.max() if len(logits) else logits.new_tensor(-math.inf)
    top = _all_reduce(top.clone(), dist.ReduceOp.MAX, group)
    q = torch.exp(logits - top).t()  # (K, n_local)
    totals = _all_reduce(torch.stack([q.new_tensor(float(q.shape[1])), q.sum()]), dist.ReduceOp.SUM, group)
    n, total = totals[0], totals[1]
    q = q / total
    for _ in range(iterations):
        per_prototype = _all_reduce(q.sum(dim=1, keepdim=True), dist.ReduceOp.SUM, group)
        q = q / per_prototype / prototypes
        q = q / q.sum(dim=0, keepdim=True) / n
    return list((q * n).t().split(sizes))


@torch.no_grad()
def ema_update(teacher: list[torch.Tensor], student: list[torch.Tensor], momentum: float) -> None:
    """teacher <- momentum * teacher + (1 - momentum) * student, in place, tensor by tensor."""
    torch._foreach_mul_(teacher, momentum)
    torch._foreach_add_(teacher, student, alpha=1.0 - momentum)


def cosine_schedule(step: int, total: int, base: float, final: float, start: float = 0.0, warmup: int = 0) -> float:
    """The value at global step `step` (0-based) of the published CosineScheduler(base, final, total,
    start, warmup): linear from `start` to `base` over steps 0..warmup-1 (both ends included), then
    final + (base - final) * (1 + cos(pi * i / (total - warmup))) / 2 at i = step - warmup; `final`
    from `total` on."""
    if step >= total:
        return float(final)
    if step < warmup:
        return float(start) if warmup == 1 else float(start + (base - start) * step / (warmup - 1))
    i, length = step - warmup, total - warmup
    return float(final + 0.5 * (base - final) * (1.0 + math.cos(math.pi * i / length)))


# ----------------------------------------------------------------------------- the task


def step_values(options: dict, position: int, total: int) -> dict[str, float]:
    """Every schedule of the Sonata-v1m1 `options` (a model config with its defaults) at 0-based global step
    `position` of `total`: mask_size, mask_ratio, teacher_temp and mask_jitter warm up from their start to
    their base and stay; momentum follows a half cosine from momentum_base to momentum_final (the published
    before_train / before_step, sonata_v1m1_base.py:195-282)."""
    def warm(name: str, final: str | None = None) -> float:
        return cosine_schedule(position, total, base=options[f"{name}_base"], final=options[final or f"{name}_base"],
                               start=options[f"{name}_start"], warmup=int(total * options[f"{name}_warmup_ratio"]))

    jitter = options["mask_jitter"]
    if jitter is None:  # published: start -> start during the warm-up, then a cosine to base
        jitter = cosine_schedule(position, total, base=options["mask_jitter_start"], final=options["mask_jitter_base"],
                                 start=options["mask_jitter_start"],
                                 warmup=int(total * options["mask_jitter_warmup_ratio"]))
    return {"mask_size": warm("mask_size"), "mask_ratio": warm("mask_ratio"), "teacher_temp": warm("teacher_temp"),
            "mask_jitter": float(jitter),
            "momentum": cosine_schedule(position, total, base=options["momentum_base"],
                                        final=options["momentum_final"])}


def grid_patch_mask(coord: np.ndarray, size: float, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """One view's mask (published generate_mask): the view's points grouped in cubic patches of edge `size`
    from its smallest corner; int(patches * ratio) patches drawn at random are masked."""
    cells = np.floor((coord - coord.min(axis=0)) / size).astype(np.int64)
    _, patch = np.unique(cells, axis=0, return_inverse=True)
    patches = int(patch.max()) + 1 if len(patch) else 0
    masked = rng.permutation(patches)[:int(patches * ratio)]
    return np.isin(patch.reshape(-1), masked)


@dataclass
class StepViews:
    """The views of one micro-batch: the teacher's (every global view as cut) and the student's (the global views
    masked and jittered, then the local views), each a batch of views for Sonata.forward."""

    teacher: dict[str, torch.Tensor]
    student: dict[str, torch.Tensor]
    num_events: int


def build_views(batch: dict, options: dict, values: dict, seed: int, step: int) -> StepViews:
    """Cut every event of a collated batch into its views, from its feature columns (x, y, z as coordinates,
    log_energy as energy: the published views are cut in normalised coordinates), each event's draws keyed by
    (seed, step, event id) so that they are the same at any world size, split or resume."""
    g, n_local = int(options["num_global_view"]), int(options["num_local_view"])
    settings = MultiViewSettings(global_views=g, local_views=n_local, grid_size=float(options["grid_size"]))
    feat = batch["feat"].cpu().numpy().astype(np.float64)
    ends = batch["offset"].tolist()
    segment = batch["segment"].cpu().numpy() if "segment" in batch else None
    names = ("t_coord", "t_feat", "t_origin", "t_sizes", "t_segment", "s_coord", "s_feat", "s_origin", "s_mask",
             "s_sizes", "l_coord", "l_feat", "l_origin", "l_sizes")
    parts: dict[str, list] = {k: [] for k in names}
    event_ids = batch["event_id"].tolist()
    for event_id, lo, hi in zip(event_ids, [0, *ends[:-1]], ends):
        rng = np.random.default_rng([seed, step, int(event_id)])
        views = multi_view(feat[lo:hi, :3], feat[lo:hi, 3], rng, settings)
        starts = [0, *views["global_offset"].tolist()]
        for v in range(g):
            a, b = starts[v], starts[v + 1]
            coord, energy = views["global_coord"][a:b], views["global_energy"][a:b]
            origin = views["global_origin_coord"][a:b]
            mask = grid_patch_mask(coord, values["mask_size"], values["mask_ratio"], rng)
            jittered = coord.astype(np.float64).copy()
            if values["mask_jitter"] > 0:  # published: clipped above only, at twice the jitter
                noise = rng.normal(scale=values["mask_jitter"], size=(int(mask.sum()), 3))
                jittered[mask] += np.minimum(noise, 2 * values["mask_jitter"])
            for prefix, xyz in (("t", coord), ("s", jittered)):
                parts[f"{prefix}_coord"].append(xyz)
                parts[f"{prefix}_feat"].append(np.column_stack([xyz, energy]))
                parts[f"{prefix}_origin"].append(origin)
                parts[f"{prefix}_sizes"].append(b - a)
            parts["s_mask"].append(mask)
            if segment is not None:
                parts["t_segment"].append(segment[lo:hi][views["global_index"][a:b]])
        starts = [0, *views["local_offset"].tolist()]
        for v in range(n_local):
            a, b = starts[v], starts[v + 1]
            parts["l_coord"].append(views["local_coord"][a:b])
            parts["l_feat"].append(np.column_stack([views["local_coord"][a:b], views["local_energy"][a:b]]))
            parts["l_origin"].append(views["local_origin_coord"][a:b])
            parts["l_sizes"].append(b - a)

    def cat(name: str, dtype=torch.float32) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts[name])).to(dtype)

    per_event = g + n_local
    ids = torch.tensor(event_ids, dtype=torch.int64)
    teacher = {"coord": cat("t_coord"), "feat": cat("t_feat"), "origin": cat("t_origin"),
               **({"segment": cat("t_segment", torch.int64)} if segment is not None else {}),
               "offset": torch.tensor(parts["t_sizes"]).cumsum(0),
               "view_id": (ids.unsqueeze(1) * per_event + torch.arange(g)).flatten()}
    student = {"coord": torch.cat([cat("s_coord"), cat("l_coord")]), "feat": torch.cat([cat("s_feat"), cat("l_feat")]),
               "origin": torch.cat([cat("s_origin"), cat("l_origin")]),
               "offset": torch.tensor(parts["s_sizes"] + parts["l_sizes"]).cumsum(0),
               "view_id": torch.cat([(ids.unsqueeze(1) * per_event + torch.arange(g)).flatten(),
                                     (ids.unsqueeze(1) * per_event + g + torch.arange(n_local)).flatten()]),
               "point_mask": torch.cat([torch.from_numpy(np.concatenate(parts["s_mask"])),
                                        torch.zeros(sum(parts["l_sizes"]), dtype=torch.bool)]),
               # the head of each view: 0 (mask_head) for the masked global views, 1 (unmask_head) for the local
               "head_of_view": torch.cat([torch.zeros(len(ids) * g, dtype=torch.int64),
                                          torch.ones(len(ids) * n_local, dtype=torch.int64)])}
    return StepViews(teacher, student, len(ids))


def match_by_origin(student_view: torch.Tensor, student_origin: torch.Tensor, teacher_view_of: torch.Tensor,
                    teacher_view: torch.Tensor, teacher_origin: torch.Tensor, cell: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (student voxel, teacher voxel) whose mean origin falls in the same cell of edge `cell`, the
    teacher voxel taken from view teacher_view_of[student view] (-1: none). Where several teacher voxels
    share a cell, the first in storage order. Exact and without CUDA-only ops (the published matching is a
    k-nearest-neighbour query within match_max_r)."""
    wanted = teacher_view_of[student_view]
    chosen = (wanted >= 0).nonzero().squeeze(1)
    s_cells = torch.floor(student_origin[chosen].double() / cell).long()
    t_cells = torch.floor(teacher_origin.double() / cell).long()
    low = torch.minimum(s_cells.min(0).values if len(s_cells) else t_cells.min(0).values, t_cells.min(0).values)
    s_cells, t_cells = s_cells - low, t_cells - low
    span = int(max(int(s_cells.max()) if len(s_cells) else 0, int(t_cells.max()))) + 1

    def key(view: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        return ((view * span + cells[:, 0]) * span + cells[:, 1]) * span + cells[:, 2]

    t_key = key(teacher_view, t_cells)
    order = torch.argsort(t_key, stable=True)
    sorted_keys = t_key[order]
    s_key = key(wanted[chosen], s_cells)
    place = torch.searchsorted(sorted_keys, s_key).clamp(max=max(len(sorted_keys) - 1, 0))
    hit = sorted_keys[place] == s_key if len(sorted_keys) else torch.zeros_like(s_key, dtype=torch.bool)
    return chosen[hit], order[place[hit]]


LOSSES = (("mask", "mask_head", "mask_loss_weight"), ("roll_mask", "mask_head", "roll_mask_loss_weight"),
          ("unmask", "unmask_head", "unmask_loss_weight"))


class SelfDistillation(Task):
    """Sonata-style self-distillation of a Sonata-v1m1 model (the module docstring says what is exact).

    Per optimizer step: `begin_step` sets every schedule from the global step; `prepare_step` cuts each
    micro-batch's events into views, runs the teacher on the global views of every micro-batch, matches the
    student's voxels to the teacher's by origin and normalises the matched teacher scores with Sinkhorn-Knopp
    over the whole step (all micro-batches, all ranks); `forward_loss` runs the student and takes per event the
    mean over its views of each loss; `after_optimizer_step` moves the teacher by EMA."""

    best_metric = "loss"
    higher_is_better = False

    def __init__(self, model_options: dict, seed: int = 0, num_classes: int = 0, class_names=None,
                 loss=None) -> None:
        self.options = dict(model_options)
        self.seed = int(seed)
        self.values = step_values(self.options, 0, 1)
        self.eval_values = step_values(self.options, 1, 1)  # every schedule at its end
        self.step = 0
        g = int(self.options["num_global_view"])
        self.weights = {kind: float(self.options[weight]) for kind, _, weight in LOSSES}
        self.probe_classes = int(self.options.get("probe_classes") or 0)
        self.class_names = list(class_names or [str(i) for i in range(self.probe_classes)])[:self.probe_classes]
        if g < 2:
            self.weights["roll_mask"] = 0.0

    def begin_step(self, step: int, total_steps: int) -> None:
        self.step = int(step)
        self.values = step_values(self.options, step - 1, max(int(total_steps), 1))

    @torch.no_grad()
    def prepare_step(self, model: nn.Module, micro_batches: list[dict], device: torch.device,
                     global_targets: bool = True) -> list[dict]:
        # evaluation: the schedules' final values and step 0's draws, so that a validation loss is comparable
        # across steps and `pimm test` gives it again
        values, step = (self.values, self.step) if global_targets else (self.eval_values, 0)
        prepared, rows = [], {kind: [] for kind in self.weights}
        for micro in micro_batches:
            views = build_views(micro, self.options, values, self.seed, step)
            t = {k: v.to(device) for k, v in views.teacher.items()}
            s = {k: v.to(device) for k, v in views.student.items()}
            teacher = model(t["coord"], t["feat"], t["offset"], t["origin"], view_id=t["view_id"], part="teacher")
            probe = {}
            if self.probe_classes and "segment" in t:
                probe = {"probe_feat": teacher.feat,
                         "probe_label": majority_label(teacher.point_voxel, t["segment"], len(teacher.feat),
                                                       self.probe_classes),
                         "probe_event": teacher.view // int(self.options["num_global_view"])}
            s_view, s_origin = _unwrapped(model).view_voxels(s["coord"], s["offset"], s["origin"])
            item = {**{f"student_{k}": v for k, v in s.items()}, "offset": micro["offset"].to(device),
                    "event_id": micro["event_id"].to(device), **probe}
            g, n_local, b = int(self.options["num_global_view"]), int(self.options["num_local_view"]), views.num_events
            views_total = b * (g + n_local)
            index = torch.arange(views_total, device=device)
            is_global = index < b * g
            event_of_view = torch.where(is_global, index // g, (index - b * g) // max(n_local, 1))
            item["view_event"] = event_of_view
            teacher_of = {
                "mask": torch.where(is_global, index, -1),
                "roll_mask": torch.where(is_global, (index // g) * g + (g - 1 - index % g), -1),
                "unmask": torch.where(is_global, -1, event_of_view * g),
            }
            for kind, head, _ in LOSSES:
                if self.weights[kind] <= 0:
                    continue
                s_idx, t_idx = match_by_origin(s_view, s_origin, teacher_of[kind], teacher.view, teacher.origin,
                                               float(self.options["match_max_r"]))
                item[f"{kind}_index"] = s_idx
                rows[kind].append(teacher.scores[head].index_select(0, t_idx).float())
            prepared.append(item)
        for kind, scores in rows.items():
            if not scores:
                continue
            if global_targets:
                targets = sinkhorn_knopp(scores, values["teacher_temp"])
            else:  # evaluation: each micro-batch alone, no collective (ranks evaluate different numbers)
                targets = [sinkhorn_knopp([s], values["teacher_temp"], group=_NO_GROUP)[0] for s in scores]
            for item, target in zip(prepared, targets):
                item[f"{kind}_target"] = target
        return prepared

    def forward_loss(self, module: nn.Module, batch: dict) -> TaskOutput:
        if "student_coord" not in batch:  # evaluation: no step prepared it; each event on its own
            device = batch["feat"].device
            parts = [self.prepare_step(module, [one], device, global_targets=False)[0]
                     for one in split_events(batch, len(batch["offset"]))]
            outputs = [self._student_loss(module, part) for part in parts]
            event_losses = torch.cat([o.event_losses for o in outputs])
            probes = [o.prediction for o in outputs if o.prediction is not None]
            probe = {key: torch.cat([p[key] for p in probes]) for key in ("probe_logits", "probe_label")} \
                if probes else None
            return TaskOutput(event_losses.mean(), event_losses, probe)
        return self._student_loss(module, batch)

    def _student_loss(self, module: nn.Module, batch: dict) -> TaskOutput:
        out = module(batch["student_coord"], batch["student_feat"], batch["student_offset"], batch["student_origin"],
                     view_id=batch["student_view_id"], point_mask=batch["student_point_mask"], part="student",
                     head_of_view=batch["student_head_of_view"], probe_feat=batch.get("probe_feat"))
        num_events = len(batch["offset"])
        num_views = len(batch["view_event"])
        event_losses = out.view.new_zeros(num_events, dtype=torch.float32)
        temperature = float(self.options["student_temp"])
        for kind, head, _ in LOSSES:
            if self.weights[kind] <= 0:
                continue
            index, target = batch[f"{kind}_index"], batch[f"{kind}_target"]
            logp = F.log_softmax(out.scores[head].index_select(0, index).float() / temperature, dim=-1)
            per_voxel = -(target * logp).sum(-1)
            view = out.view.index_select(0, index)
            view_sum = per_voxel.new_zeros(num_views).index_add_(0, view, per_voxel)
            view_count = torch.bincount(view, minlength=num_views).to(per_voxel.dtype)
            matched = view_count > 0
            view_mean = torch.where(matched, view_sum / view_count.clamp(min=1), torch.zeros_like(view_sum))
            event = batch["view_event"]
            event_sum = view_mean.new_zeros(num_events).index_add_(0, event, view_mean)
            event_views = view_mean.new_zeros(num_events).index_add_(0, event, matched.to(view_mean.dtype))
            event_losses = event_losses + self.weights[kind] * event_sum / event_views.clamp(min=1)
        if "probe" not in out.scores:
            return TaskOutput(event_losses.mean(), event_losses, None)
        logits, label = out.scores["probe"], batch["probe_label"]
        labelled = label >= 0
        per_voxel = F.cross_entropy(logits.float(), label.clamp(min=0), reduction="none") * labelled
        events = batch["probe_event"]
        probe_sum = per_voxel.new_zeros(num_events).index_add_(0, events, per_voxel)
        probe_count = per_voxel.new_zeros(num_events).index_add_(0, events, labelled.to(per_voxel.dtype))
        # the probe's loss trains the probe alone (its features are detached); it is part of each event's loss
        event_losses = event_losses + probe_sum / probe_count.clamp(min=1)
        return TaskOutput(event_losses.mean(), event_losses, {"probe_logits": logits.detach(), "probe_label": label})

    @torch.no_grad()
    def after_optimizer_step(self, model: nn.Module) -> None:
        model = _unwrapped(model)
        ema_update([_local(p) for p in model.teacher.parameters()],
                   [_local(p.detach()) for p in model.student.parameters()], self.values["momentum"])

    def make_meter(self, device: torch.device) -> Meter:
        return LossMeter(device, self.probe_classes)

    def summary(self, result: dict) -> str:
        probe = f" probe mIoU {result['probe_miou']:.4f}" if "probe_miou" in result else ""
        return f"loss {result['loss']:.4f}{probe} ({int(result['events'])} events)"


def majority_label(point_voxel: torch.Tensor, label: torch.Tensor, num_voxels: int, num_classes: int) -> torch.Tensor:
    """(V,) each voxel's most common label among its points in 0..num_classes-1 (ties: the smaller), -1 if none."""
    known = (label >= 0) & (label < num_classes)
    votes = torch.bincount(point_voxel[known] * num_classes + label[known], minlength=num_voxels * num_classes)
    votes = votes.view(num_voxels, num_classes)
    return torch.where(votes.sum(1) > 0, votes.argmax(1), torch.full_like(votes[:, 0], -1))


_NO_GROUP = "no group"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), a plain tensor as it is: the EMA is elementwise, shard by shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def _unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


class LossMeter(Meter):
    """The mean event loss over every rank's events (a float64 sum and a count, all-reduced), and with a probe
    its confusion over the voxels of the teacher's views (int64, all-reduced): probe_miou, probe_iou."""

    def __init__(self, device: torch.device, probe_classes: int = 0) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        self.classes = probe_classes
        self.confusion = torch.zeros(probe_classes * probe_classes, dtype=torch.int64, device=device)

    def update(self, output: TaskOutput, batch: dict) -> None:
        self.sums += torch.stack([output.event_losses.detach().double().sum(),
                                  torch.tensor(float(output.event_losses.numel()), dtype=torch.float64,
                                               device=self.sums.device)])
        if output.prediction is not None:
            label, pred = output.prediction["probe_label"], output.prediction["probe_logits"].argmax(1)
            known = label >= 0
            self.confusion.index_add_(0, label[known] * self.classes + pred[known],
                                      torch.ones_like(label[known]))

    def compute(self) -> dict:
        all_reduce_sum(self.sums)
        result = {"loss": float(self.sums[0]) / max(float(self.sums[1]), 1.0), "events": int(self.sums[1])}
        if self.classes:
            all_reduce_sum(self.confusion)
            probe = metrics_from_confusion(self.confusion.view(self.classes, -1).cpu(), 0.0, result["events"])
            result.update(probe_miou=probe["miou"], probe_iou=probe["iou"], probe_accuracy=probe["accuracy"],
                          confusion=probe["confusion"])
        return result
