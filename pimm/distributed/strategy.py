"""Execution strategies behind one interface: the trainer never branches on a strategy's name.

A strategy takes the plain model and returns the module the training step calls; it also
says which module evaluation should call and whether that module's forward is a collective
(FSDP2 all-gathers parameters in forward, so every rank must run as many evaluation forwards
as the others: `lockstep_eval`), how to turn gradient synchronisation off for the micro-steps of
gradient accumulation, and how to move full (unsharded) model states in and out.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pimm.distributed.env import DistEnv, return_freed_memory_to_os
from pimm.errors import ConfigError
from pimm.models import build_model
from pimm.names import PARALLEL_STRATEGIES

log = logging.getLogger("pimm")


def import_data_parallel_wrappers() -> None:
    """Import what DDP's and FSDP2's constructors import on first use (torch._dynamo, about 0.6 CPU-s): pimm's
    torchrun imports it before it forks the ranks of a multi-rank run (pimm.launch.forked_rank), once for all."""
    # deferred: a one-rank run (SingleProcess) never needs it
    import torch._dynamo  # noqa: F401


class Strategy:
    """The interface: wrap the plain model, name the module evaluation calls, move full states."""

    name = "base"
    lockstep_eval = False  # True: the evaluation forward is a collective (pad ranks that run out)
    host_allocator: str | None = None  # what wrap() set for the host allocator (provenance); None: defaults

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        raise NotImplementedError

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        raise NotImplementedError

    def no_gradient_sync(self, wrapped: nn.Module):
        """A context for the backward passes of all but the last micro-step of an accumulated step."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to the global gradient norm (over all shards); returns that norm as a plain tensor."""
        return torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm)

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

    def no_gradient_sync(self, wrapped: nn.Module):
        return wrapped.no_sync()


class FSDP2(Strategy):
    """Parameters, gradients and optimizer state sharded over the ranks with
    `torch.distributed.fsdp.fully_shard` on a 1-D mesh: each module whose class is named in
    `wrap_classes` first, then the root. On CUDA, `mixed_precision` computes in bfloat16 with
    float32 gradient reduction (the sharded parameters stay float32)."""

    name = "fsdp2"
    lockstep_eval = True

    def __init__(self, wrap_classes: list[str], reshard_after_forward: bool = True,
                 mixed_precision: bool = False) -> None:
        self.wrap_classes = list(wrap_classes)
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        # deferred: torch.distributed.fsdp takes most of a second to import; FSDP2 runs only
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if env.device.type == "cpu":  # before the gathers allocate: freed gathered parameters leave the RSS
            self.host_allocator = return_freed_memory_to_os()
        model = model.to(env.device)
        check_wrap_classes(model, self.wrap_classes)
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        options = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.mixed_precision and env.device.type == "cuda":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif self.mixed_precision:
            log.warning("parallel.mixed_precision ignored: bf16 parameters need CUDA, this run is on %s",
                        env.device.type)
        wrapped = [m for m in model.modules() if type(m).__name__ in self.wrap_classes and m is not model]
        for module in wrapped:
            fully_shard(module, **options)
        fully_shard(model, **options)
        log.info("fsdp2: %d %s module(s) sharded, then the root, over %d ranks", len(wrapped),
                 "/".join(self.wrap_classes), env.world_size)
        return model

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        return wrapped  # the sharded module: its forward all-gathers, so evaluation runs in lockstep

    def no_gradient_sync(self, wrapped: nn.Module):
        @contextlib.contextmanager
        def unsynced():
            wrapped.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                wrapped.set_requires_gradient_sync(True)

        return unsynced()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_model_state(self, wrapped: nn.Module) -> dict:
        """Gathered on every rank (a collective), kept on rank 0 only (others get {})."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # deferred: FSDP2

        return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_model_state(self, wrapped: nn.Module, state: dict, strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # deferred: FSDP2

        set_model_state_dict(wrapped, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def check_wrap_classes(model: nn.Module, wrap_classes: list[str]) -> None:
    """Every class named in parallel.wrap_classes occurs in the model (the launcher checks this on
    a model built on the meta device, before any process starts)."""
    names = {type(m).__name__ for m in model.modules()}
    unknown = [c for c in wrap_classes if c not in names]
    if unknown:
        raise ConfigError(
            f"parallel.wrap_classes names {unknown}, which {type(model).__name__} does not contain; its module "
            f"classes are: {', '.join(sorted(names))}"
        )


def check_strategy_fits(cfg: dict) -> None:
    """The launcher's check of an FSDP2 config against its model (imports torch: FSDP2 runs only)."""
    parallel = cfg.get("parallel") or {}
    if parallel.get("strategy") != "fsdp2":
        return
    with torch.device("meta"):
        check_wrap_classes(build_model(cfg["model"]), parallel.get("wrap_classes") or ["Block"])


def build_strategy(cfg: dict, env: DistEnv):
    """Pick the strategy for this run from `parallel`, `find_unused_parameters`, `sync_bn`."""
    parallel = cfg.get("parallel") or {}
    requested = parallel.get("strategy", "ddp")
    if env.world_size == 1:
        return SingleProcess()
    if requested == "ddp":
        return DDP(bool(cfg.get("find_unused_parameters", False)), bool(cfg.get("sync_bn", False)))
    if requested == "fsdp2":
        return FSDP2(parallel.get("wrap_classes") or ["Block"], bool(parallel.get("reshard_after_forward", True)),
                     bool(parallel.get("mixed_precision", False)))
    raise ConfigError(f"unknown parallel.strategy '{requested}'; valid strategies: {', '.join(PARALLEL_STRATEGIES)}")


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA); numpy/python randomness in pimm is drawn from explicit generators."""
    torch.manual_seed(seed)
