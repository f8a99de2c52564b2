"""What goes into trainer.dcp and how it comes back, including the data cursor mapping.

trainer.dcp holds: the optimizer state (keyed by parameter name through DCP's state-dict API, so
it reshards), the LR scheduler, the trainer state (step, epoch, cursor, best metric) with the
facts needed to map the cursor (global batch, data length and hash, world size, workers), and
`rng.rank<r>` with the RNG states of each rank. Nothing in it is unpickled when it is loaded
(safe_dcp.py): scheduler, trainer and RNG states are packed into uint8 tensors.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from pimm.checkpoint import safe_dcp
from pimm.checkpoint.layout import TRAINER, WEIGHTS, Checkpoint, CheckpointError, verify
from pimm.checkpoint.manager import clone_to_cpu
from pimm.distributed.env import all_reduce_max

log = logging.getLogger("pimm")


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


def cursor_facts(trainer) -> dict:
    """What the saved cursor means: it maps to a new topology only if these (but world/workers) match."""
    return {
        "global_batch_size": trainer.plan.global_batch_size,
        "num_samples": len(trainer.train_set),
        "data_hash": trainer.train_set.info["content_hash"],
        "world_size": trainer.env.world_size,
        "workers_per_rank": trainer.plan.workers_per_rank,
    }


def capture(trainer) -> tuple[dict | None, dict]:
    """CPU copies of (full model state on rank 0 else None, trainer.dcp state of this rank)."""
    full = trainer.strategy.full_model_state(trainer.module)
    model_state = clone_to_cpu(full) if trainer.env.is_main else None
    trainer_blob = {"state": asdict(trainer.state), "cursor": cursor_facts(trainer)}
    scheduler = f"the state of the LR scheduler {type(trainer.scheduler).__name__}"
    dcp_state = {
        "optimizer": clone_to_cpu(get_optimizer_state_dict(trainer.module, trainer.optimizer)),
        "scheduler": safe_dcp.pack(trainer.scheduler.state_dict(), scheduler),
        "trainer": safe_dcp.pack(trainer_blob, "the trainer state"),
        f"rng.rank{trainer.env.rank}": safe_dcp.pack(rng_states(trainer.env.device), "the RNG states"),
    }
    return model_state, dcp_state


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


def restore(trainer, ckpt: Checkpoint, strict: bool) -> str:
    """Load `ckpt` into the trainer; returns the cursor outcome: restored | remapped | epoch_restarted."""
    # the ranks share the hashing: rank r checks every world_size-th file
    _agreed(lambda: verify(ckpt.path, trainer.env.rank, trainer.env.world_size), ckpt, trainer.env)
    path = ckpt.path / WEIGHTS
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: {exc}") from exc
    trainer.strategy.load_full_model_state(trainer.module, weights, strict=strict)

    path = ckpt.path / TRAINER
    metadata = safe_dcp.read_metadata(path)
    saved_world = sum(1 for k in metadata.state_dict_metadata if k.startswith("rng.rank"))
    rng_key = f"rng.rank{trainer.env.rank}"
    same_world = saved_world == trainer.env.world_size
    packed = ["scheduler", "trainer", *([rng_key] if same_world else [])]
    template = {key: safe_dcp.packed_template(metadata, key, path) for key in packed}
    template["optimizer"] = get_optimizer_state_dict(trainer.module, trainer.optimizer)
    try:
        safe_dcp.load(template, path, trainer.checkpoints.group)
    except safe_dcp.UnsafeCheckpoint:
        raise
    except CheckpointError as exc:
        if strict:
            raise
        log.warning("resume_strict_state=False: trainer state in %s unreadable (%s); weights only", ckpt.path, exc)
        return "epoch_restarted"
    unpacked = _agreed(  # rng.rank<r> is read by rank r alone
        lambda: {key: safe_dcp.unpack(template[key], f"the entry {key} of {path}") for key in packed},
        ckpt, trainer.env,
    )
    for part, load in (
        ("optimizer", lambda: set_optimizer_state_dict(trainer.module, trainer.optimizer, template["optimizer"])),
        ("scheduler", lambda: trainer.scheduler.load_state_dict(unpacked["scheduler"])),
    ):
        try:
            load()
        except Exception as exc:
            if strict:
                raise CheckpointError(f"the {part} state in {path} does not fit: {exc}") from exc
            log.warning("resume_strict_state=False: %s state not restored (%s)", part, exc)

    blob = unpacked["trainer"]
    saved, facts = blob["state"], blob["cursor"]
    trainer.state.step = saved["step"]
    trainer.state.epoch = saved["epoch"]
    trainer.state.best_metric = saved["best_metric"]
    trainer.state.samples_in_epoch = saved["samples_in_epoch"]
    now = cursor_facts(trainer)
    reasons = [
        f"{key} changed ({facts[key]} -> {now[key]})"
        for key in ("global_batch_size", "num_samples", "data_hash")
        if facts[key] != now[key]
    ]
    if not strict:
        reasons.append("resume_strict_state=False")
    if same_world and facts["workers_per_rank"] == now["workers_per_rank"]:
        set_rng_states(unpacked[rng_key], trainer.env.device)
    if reasons:
        if trainer.state.samples_in_epoch:
            log.warning(
                "data cursor not restored (%s): epoch %d restarts from its beginning; the %d events of that "
                "epoch consumed before the checkpoint may be seen twice",
                "; ".join(reasons), trainer.state.epoch + 1, trainer.state.samples_in_epoch,
            )
        trainer.state.samples_in_epoch = 0
        return "epoch_restarted"
    if facts["world_size"] == now["world_size"] and facts["workers_per_rank"] == now["workers_per_rank"]:
        return "restored"
    log.info(
        "data cursor remapped: world size %d -> %d, workers/rank %d -> %d; the global order continues at "
        "event %d of epoch %d with nothing replayed or skipped",
        facts["world_size"], now["world_size"], facts["workers_per_rank"], now["workers_per_rank"],
        trainer.state.samples_in_epoch, trainer.state.epoch + 1,
    )
    return "remapped"
