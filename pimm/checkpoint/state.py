"""What a checkpoint holds, as stateful components, and how they come back.

The trainer hands the checkpoint its components (torchtitan's pattern): each has `state_dict()`
and `load_state_dict()`, and trainer.dcp is one DCP save of `{name: component.state_dict()}`:

- `model`: the model through DCP's state-dict API (`get_model_state_dict`): sharded DTensors
  under FSDP2, full tensors under DDP and a single process, keyed by the bare model's parameter
  names either way, so a checkpoint of one strategy or world size loads into another (DCP
  reshards). weights.pth beside it is the full state dict (`full_state_dict()`), for
  `torch.load` into the bare model, warm starts and export;
- `optimizer`: likewise through `get_optimizer_state_dict`;
- `scheduler`, `trainer` (step, epoch, cursor, best metric and the facts that say whether the
  cursor maps to a new topology), `rng.rank<r>`: packed into uint8 tensors (safe_dcp.pack), so
  nothing in the checkpoint is unpickled when it is loaded (safe_dcp.py).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from pimm.checkpoint import safe_dcp
from pimm.checkpoint.layout import TRAINER, WEIGHTS, Checkpoint, CheckpointError, verify
from pimm.distributed.env import all_reduce_max

log = logging.getLogger("pimm")


# -- the components ----------------------------------------------------------------------------

class ModelState:
    def __init__(self, strategy, module: torch.nn.Module) -> None:
        self.strategy, self.module = strategy, module

    def state_dict(self) -> dict:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.module, state)

    def full_state_dict(self) -> dict:
        """The unsharded state dict (a collective under FSDP2: call on every rank)."""
        return self.strategy.full_model_state(self.module)

    def load_full_state_dict(self, state: dict, strict: bool = True) -> None:
        self.strategy.load_full_model_state(self.module, state, strict=strict)


class OptimizerState:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state)


class Packed:
    """A component whose state is plain Python data, stored as one uint8 tensor."""

    def __init__(self, what: str, get: Callable[[], object], put: Callable[[object], None]) -> None:
        self.what, self._get, self._put = what, get, put

    def state_dict(self) -> torch.Tensor:
        return safe_dcp.pack(self._get(), self.what)

    def load_state_dict(self, packed: torch.Tensor) -> None:
        self.apply(safe_dcp.unpack(packed, self.what))

    def apply(self, value) -> None:
        self._put(value)


def rng_states(device: torch.device) -> dict:
    """This rank's RNG states (CUDA: its own device only) in types a safe load accepts."""
    name, keys, *rest = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), *rest),  # MT19937 keys are uint32
        "python": random.getstate(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(states["python"])
    if "cuda" in states and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"], device)


class TrainProgress:
    """Step, epoch, cursor and best metric, with the facts that say whether the saved cursor
    maps to the current topology; loading keeps the saved facts for `cursor_outcome`."""

    def __init__(self, state, facts: Callable[[], dict]) -> None:
        self.state, self._facts = state, facts
        self.saved_facts: dict | None = None

    def state_dict(self) -> dict:
        return {"state": asdict(self.state), "cursor": self._facts()}

    def load_state_dict(self, blob: dict) -> None:
        saved = blob["state"]
        for key in ("step", "epoch", "best_metric", "samples_in_epoch"):
            setattr(self.state, key, saved[key])
        self.saved_facts = blob["cursor"]


def checkpoint_components(trainer) -> dict:
    """The trainer's checkpointed components by entry name (what trainer.dcp holds). None of them
    refers back to the trainer (no reference cycle keeps it, and its loader workers, alive)."""
    env, plan, train_set = trainer.env, trainer.plan, trainer.train_set
    progress = TrainProgress(trainer.state, lambda: cursor_facts(plan, train_set, env))
    return {
        "model": ModelState(trainer.strategy, trainer.module),
        "optimizer": OptimizerState(trainer.module, trainer.optimizer),
        "scheduler": Packed(f"the state of the LR scheduler {type(trainer.scheduler).__name__}",
                            trainer.scheduler.state_dict, trainer.scheduler.load_state_dict),
        "trainer": Packed("the trainer state", progress.state_dict, progress.load_state_dict),
        f"rng.rank{env.rank}": Packed("the RNG states", lambda: rng_states(env.device),
                                      lambda states: set_rng_states(states, env.device)),
        "_progress": progress,  # not saved: holds what the trainer entry loaded
    }


def cursor_facts(plan, train_set, env) -> dict:
    """What the saved cursor means: it maps to a new topology only if these (but world/workers) match."""
    return {
        "global_batch_size": plan.global_batch_size,
        "num_samples": len(train_set),
        "data_hash": train_set.info["content_hash"],
        "world_size": env.world_size,
        "workers_per_rank": plan.workers_per_rank,
    }


def saved(components: dict) -> dict:
    return {name: c for name, c in components.items() if not name.startswith("_")}


# -- save and restore --------------------------------------------------------------------------

def capture(components: dict, is_main: bool, stage) -> tuple[dict | None, dict]:
    """(full model state on rank 0 else None, trainer.dcp state of this rank), both staged to CPU
    by `stage` (the only part of an asynchronous save that blocks training)."""
    dcp_state = stage({name: c.state_dict() for name, c in saved(components).items()}, "trainer")
    model = dcp_state["model"]
    if not any(isinstance(v, DTensor) for v in model.values()):
        return (model if is_main else None), dcp_state  # unsharded: weights.pth is the same state
    full = components["model"].full_state_dict()  # gathered from the shards (every rank takes part)
    return (stage(full, "weights") if is_main else None), dcp_state


def _agreed(action, ckpt: Checkpoint, env):
    """`action()` on every rank; all raise if it raised CheckpointError on any rank, so that every
    rank moves on to the same next checkpoint."""
    problem = result = None
    try:
        result = action()
    except CheckpointError as exc:
        problem = exc
        log.warning("%s", exc)
    failed = all_reduce_max(torch.tensor([1.0 if problem else 0.0], device=env.device))
    if problem is not None:
        raise problem
    if failed.item():
        raise CheckpointError(f"checkpoint {ckpt.path} failed on another rank (see its log)")
    return result


def restore(components: dict, ckpt: Checkpoint, env, group, facts_now: dict, strict: bool) -> str:
    """Load `ckpt` into the components; returns the cursor outcome: restored | remapped | epoch_restarted."""
    # the ranks share the hashing: rank r checks every world_size-th file
    _agreed(lambda: verify(ckpt.path, env.rank, env.world_size), ckpt, env)
    path = ckpt.path / TRAINER
    metadata = safe_dcp.read_metadata(path)
    saved_world = sum(1 for k in metadata.state_dict_metadata if k.startswith("rng.rank"))
    rng_key = f"rng.rank{env.rank}"
    same_world = saved_world == env.world_size
    model_in_dcp = any(k.startswith("model.") for k in metadata.state_dict_metadata)
    if not model_in_dcp or not strict:  # format 2 kept the model in weights.pth only
        _load_weights(components["model"], ckpt, strict)
    packed = ["scheduler", "trainer", *([rng_key] if same_world else [])]
    template = {key: safe_dcp.packed_template(metadata, key, path) for key in packed}
    tensors = ["optimizer", *(["model"] if model_in_dcp and strict else [])]
    for key in tensors:
        template[key] = components[key].state_dict()
    try:
        safe_dcp.load(template, path, group)
    except safe_dcp.UnsafeCheckpoint:
        raise
    except CheckpointError as exc:
        if strict:
            raise
        log.warning("resume_strict_state=False: trainer state in %s unreadable (%s); weights only", ckpt.path, exc)
        return "epoch_restarted"
    unpacked = _agreed(  # rng.rank<r> is read by rank r alone
        lambda: {key: safe_dcp.unpack(template[key], f"the entry {key} of {path}") for key in packed}, ckpt, env,
    )
    for part in tensors:
        try:
            components[part].load_state_dict(template[part])
        except Exception as exc:
            if strict:
                raise CheckpointError(f"the {part} state in {path} does not fit: {exc}") from exc
            log.warning("resume_strict_state=False: %s state not restored (%s)", part, exc)
    try:
        components["scheduler"].apply(unpacked["scheduler"])
    except Exception as exc:
        if strict:
            raise CheckpointError(f"the scheduler state in {path} does not fit: {exc}") from exc
        log.warning("resume_strict_state=False: scheduler state not restored (%s)", exc)
    components["trainer"].apply(unpacked["trainer"])
    progress = components["_progress"]
    facts = progress.saved_facts
    reasons = [
        f"{key} changed ({facts[key]} -> {facts_now[key]})"
        for key in ("global_batch_size", "num_samples", "data_hash")
        if facts[key] != facts_now[key]
    ]
    if not strict:
        reasons.append("resume_strict_state=False")
    if same_world and facts["workers_per_rank"] == facts_now["workers_per_rank"]:
        components[rng_key].apply(unpacked[rng_key])
    state = progress.state
    if reasons:
        if state.samples_in_epoch:
            log.warning(
                "data cursor not restored (%s): epoch %d restarts from its beginning; the %d events of that "
                "epoch consumed before the checkpoint may be seen twice",
                "; ".join(reasons), state.epoch + 1, state.samples_in_epoch,
            )
        state.samples_in_epoch = 0
        return "epoch_restarted"
    if facts["world_size"] == facts_now["world_size"] and facts["workers_per_rank"] == facts_now["workers_per_rank"]:
        return "restored"
    log.info(
        "data cursor remapped: world size %d -> %d, workers/rank %d -> %d; the global order continues at "
        "event %d of epoch %d with nothing replayed or skipped",
        facts["world_size"], facts_now["world_size"], facts["workers_per_rank"], facts_now["workers_per_rank"],
        state.samples_in_epoch, state.epoch + 1,
    )
    return "remapped"


def _load_weights(model: ModelState, ckpt: Checkpoint, strict: bool) -> None:
    path = ckpt.path / WEIGHTS
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: {exc}") from exc
    model.load_full_state_dict(weights, strict=strict)
