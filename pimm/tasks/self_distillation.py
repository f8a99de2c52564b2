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

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
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
