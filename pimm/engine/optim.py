"""Optimizers and LR schedules from config dicts (`dict(type="AdamW", lr=...)`)."""

from __future__ import annotations

import torch

from pimm import names
from pimm.registry import Registry

OPTIMIZERS = Registry("optimizer")
for _name in names.OPTIMIZERS:
    OPTIMIZERS.register(getattr(torch.optim, _name))

SCHEDULERS = Registry("scheduler")
for _name in names.SCHEDULERS:
    SCHEDULERS.register(getattr(torch.optim.lr_scheduler, _name))

# the schedule length is derived from epochs x steps per epoch, never typed twice in a config
SCHEDULE_LENGTH_KEY = {"OneCycleLR": "total_steps", "CosineAnnealingLR": "T_max"}


def build_optimizer(cfg: dict, params) -> torch.optim.Optimizer:
    return OPTIMIZERS.build(cfg, params)


def build_scheduler(cfg: dict | None, optimizer: torch.optim.Optimizer, total_steps: int):
    """Build the per-step LR schedule; None means a constant learning rate."""
    if cfg is None:
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    cfg = dict(cfg)
    length_key = SCHEDULE_LENGTH_KEY.get(cfg.get("type"))
    if length_key and cfg.get(length_key) is None:
        cfg[length_key] = total_steps
    if cfg.get("type") == "OneCycleLR" and cfg.get("max_lr") is None:
        cfg["max_lr"] = [group["lr"] for group in optimizer.param_groups]
    return SCHEDULERS.build(cfg, optimizer)
