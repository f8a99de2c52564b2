"""Execution strategies behind one interface: the trainer never branches on a strategy's name.

A strategy takes the plain model and returns the module the training step calls; it also
says which module evaluation should call (evaluation runs a different number of batches on
each rank, so it must not trigger collectives inside forward).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pimm.distributed.env import DistEnv
from pimm.errors import ConfigError
from pimm.names import PARALLEL_STRATEGIES

log = logging.getLogger("pimm")


class Strategy:
    """The interface: wrap the plain model, name the module evaluation calls, move full states."""

    name = "base"

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        raise NotImplementedError

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        raise NotImplementedError

    def full_model_state(self, wrapped: nn.Module) -> dict:
        """The whole model's state_dict as the bare model names it (called on every rank)."""
        return self.eval_module(wrapped).state_dict()

    def load_full_model_state(self, wrapped: nn.Module, state: dict, strict: bool = True) -> None:
        """Load a bare-model state_dict (called on every rank with the same state)."""
        self.eval_module(wrapped).load_state_dict(state, strict=strict)


class SingleProcess(Strategy):
    """World size one: the plain model, no wrapper."""

    name = "single"

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return model.to(env.device)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        return wrapped


class DDP(Strategy):
    """One process per device; gradients all-reduced by DistributedDataParallel."""

    name = "ddp"

    def __init__(self, find_unused_parameters: bool = False, sync_bn: bool = False) -> None:
        self.find_unused_parameters = find_unused_parameters
        self.sync_bn = sync_bn

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        if self.sync_bn:
            if env.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
                log.info("sync_bn: BatchNorm layers converted to SyncBatchNorm")
            else:
                log.warning("sync_bn=True ignored: SyncBatchNorm needs CUDA, this run is on %s", env.device.type)
        model = model.to(env.device)
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=device_ids, find_unused_parameters=self.find_unused_parameters
        )

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        # the bare module: DDP's forward may broadcast buffers, a collective that
        # would hang when ranks evaluate different numbers of batches
        return wrapped.module


def build_strategy(cfg: dict, env: DistEnv):
    """Pick the strategy for this run from `parallel`, `find_unused_parameters`, `sync_bn`."""
    parallel = cfg.get("parallel") or {}
    requested = parallel.get("strategy", "ddp")
    if env.world_size == 1:
        return SingleProcess()
    if requested == "ddp":
        return DDP(bool(cfg.get("find_unused_parameters", False)), bool(cfg.get("sync_bn", False)))
    raise ConfigError(f"unknown parallel.strategy '{requested}'; valid strategies: {', '.join(PARALLEL_STRATEGIES)}")


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA); numpy/python randomness in pimm is drawn from explicit generators."""
    torch.manual_seed(seed)
