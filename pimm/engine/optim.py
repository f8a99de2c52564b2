"""Optimizers and LR schedules from config dicts (`dict(type="AdamW", lr=...)`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch

from pimm import names
from pimm.errors import ConfigError
from pimm.models import build_model
from pimm.registry import Registry
from pimm.tasks.self_distillation import cosine_schedule

OPTIMIZERS = Registry("optimizer")
for _name in names.OPTIMIZERS:
    OPTIMIZERS.register(getattr(torch.optim, _name))

SCHEDULERS = Registry("scheduler")
for _name in names.SCHEDULERS:
    SCHEDULERS.register(getattr(torch.optim.lr_scheduler, _name))

# the schedule length is derived from epochs x steps per epoch, never typed twice in a config
SCHEDULE_LENGTH_KEY = {"OneCycleLR": "total_steps", "CosineAnnealingLR": "T_max"}


GROUP_OPTIONS = ("params", "lr_scale", "weight_decay")  # the keys of a param_groups entry


def matches(name: str, patterns: str) -> bool:
    """Does a parameter name match one of the `|`-separated fnmatch patterns ("*norm*|*bias")?"""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns.split("|"))


def freeze_parameters(model: torch.nn.Module, freeze: list[str] | None) -> list[str]:
    """Set requires_grad=False on the parameters (bare-model names) matching any `freeze` pattern;
    returns their names. ConfigError for a pattern that matches no parameter."""
    named = dict(model.named_parameters())
    frozen = []
    for pattern in freeze or []:
        hits = [n for n in named if matches(n, pattern)]
        if not hits:
            raise ConfigError(f"freeze entry {pattern!r} matches no parameter of the model (names such as "
                              f"{', '.join(list(named)[:3])}); fix the pattern or remove it")
        frozen += [n for n in hits if n not in frozen]
    for name in frozen:
        named[name].requires_grad_(False)
    return frozen


def parameter_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], optimizer_cfg: dict,
                     param_groups: list[dict] | None) -> list[dict]:
    """The optimizer's groups of the trainable parameters: each goes to the first `param_groups`
    entry whose pattern matches its name, else to the default group (first, when it has any).
    A group's lr is optimizer.lr x lr_scale; weight_decay, when given, replaces optimizer's.
    ConfigError for an entry that matches no trainable parameter."""
    base_lr = optimizer_cfg.get("lr", 1e-3)
    entries = list(param_groups or [])
    members: list[list] = [[] for _ in range(len(entries) + 1)]  # [default, entry 0, entry 1, ...]
    frozen_hits = [0] * len(entries)
    for name, param in named_parameters:
        index = next((i for i, e in enumerate(entries) if matches(name, e["params"])), None)
        if not param.requires_grad:
            if index is not None:
                frozen_hits[index] += 1
            continue
        members[0 if index is None else index + 1].append((name, param))
    groups = []
    if members[0]:
        groups.append({"params": [p for _, p in members[0]], "names": "default", "lr_scale": 1.0})
    for i, entry in enumerate(entries):
        if not members[i + 1]:
            why = (f"only frozen ones ({frozen_hits[i]}, see freeze)" if frozen_hits[i]
                   else "none (or only ones an earlier entry took)")
            raise ConfigError(f"param_groups[{i}] (params={entry['params']!r}) matches no trainable parameter: "
                              f"it matches {why}; fix the pattern or remove the entry")
        scale = float(entry.get("lr_scale", 1.0))
        group = {"params": [p for _, p in members[i + 1]], "names": entry["params"], "lr_scale": scale,
                 "lr": base_lr * scale}
        if entry.get("weight_decay") is not None:
            group["weight_decay"] = float(entry["weight_decay"])
        groups.append(group)
    if not groups:
        raise ConfigError("freeze leaves no trainable parameter: nothing to train; freeze fewer parameters")
    return groups


def check_parameter_patterns(cfg: dict) -> None:
    """Before any process starts: freeze and param_groups patterns against the parameter names of
    the model `cfg` builds on the meta device (no memory, no init); ConfigError as in a rank."""
    with torch.device("meta"):
        model = build_model(cfg["model"])
    freeze_parameters(model, cfg.get("freeze"))
    parameter_groups(model.named_parameters(), cfg["optimizer"], cfg.get("param_groups"))


def group_facts(optimizer: torch.optim.Optimizer, lr: float) -> list[dict]:
    """Per optimizer group: its pattern, parameter tensors and elements, lr and weight decay."""
    return [{"params": g.get("names", "default"), "tensors": len(g["params"]),
             "elements": sum(p.numel() for p in g["params"]), "lr": lr * g.get("lr_scale", 1.0),
             "weight_decay": g.get("weight_decay")} for g in optimizer.param_groups]


def build_optimizer(cfg: dict, params) -> torch.optim.Optimizer:
    """`params`: parameters, or groups as from parameter_groups.

    A config that names neither `fused` nor `foreach` gets torch's fused implementation (the same update,
    one kernel over every parameter; torch's own default is a Python loop over them on CPU, the fused one
    is 6x faster there for the 146 tensors of the benchmark's detector). Naming either keeps torch's choice."""
    implementation = {} if "fused" in cfg or "foreach" in cfg else {"fused": True}
    return OPTIMIZERS.build(cfg, params, **implementation)


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """What computes the update: 'fused', 'foreach', or 'torch default' (neither named: torch's loop over the
    parameters on CPU, its foreach on CUDA). Read it after a resume: the groups are then the checkpoint's."""
    group = optimizer.param_groups[0]
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "torch default"


class WeightDecaySchedule:
    """The published WeightDecayScheduler (DeepLearnPhysics/pimm pimm/engines/hooks/misc.py) as a function of
    the global step: before step s (1-based) every group whose configured weight decay is > 0 takes
    cosine_schedule(s - 1, ratio x total, its own value, final); the others keep 0. A resume at any world
    size continues it where it stopped (the published hook re-derives its position from the epoch)."""

    def __init__(self, cfg: dict, optimizer: torch.optim.Optimizer, total_steps: int) -> None:
        self.final = float(cfg["final"])
        self.total = max(int(total_steps * float(cfg.get("ratio", 1.0))), 1)
        # the config's values (read before a checkpoint's param groups are loaded)
        self.base = [float(group["weight_decay"]) for group in optimizer.param_groups]

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        for group, base in zip(optimizer.param_groups, self.base):
            if base > 0:
                group["weight_decay"] = cosine_schedule(step - 1, self.total, base=base, final=self.final)


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
    elif cfg.get("type") == "OneCycleLR" and isinstance(cfg["max_lr"], (int, float)):
        cfg["max_lr"] = [cfg["max_lr"] * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
    return SCHEDULERS.build(cfg, optimizer)
