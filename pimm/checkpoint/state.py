"""What goes into trainer.dcp and how it comes back, including the data cursor mapping.

trainer.dcp holds: the optimizer state (keyed by parameter name through DCP's state-dict API, so
it reshards), the LR scheduler, the trainer state (step, epoch, cursor, best metric) with the
facts needed to map the cursor (global batch, data length and hash, world size, workers), and
`rng.rank<r>` with the RNG states of each rank.
"""

from __future__ import annotations

import logging
import pickle
import random
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from pimm.checkpoint.layout import TRAINER, WEIGHTS, Checkpoint, CheckpointError, verify
from pimm.checkpoint.manager import clone_to_cpu
from pimm.distributed.env import all_reduce_max

log = logging.getLogger("pimm")


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


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
    dcp_state = {
        "optimizer": clone_to_cpu(get_optimizer_state_dict(trainer.module, trainer.optimizer)),
        "scheduler": pickle.dumps(trainer.scheduler.state_dict()),
        "trainer": pickle.dumps(trainer_blob),
        f"rng.rank{trainer.env.rank}": pickle.dumps(rng_states()),
    }
    return model_state, dcp_state


def _agree_verified(ckpt: Checkpoint, env) -> None:
    """Ranks share the verification of the files; all raise if any rank found a bad one."""
    problem = None
    try:
        verify(ckpt.path, env.rank, env.world_size)
    except CheckpointError as exc:
        problem = exc
        log.warning("%s", exc)
    failed = all_reduce_max(torch.tensor([1.0 if problem else 0.0], device=env.device))
    if problem is not None:
        raise problem
    if failed.item():
        raise CheckpointError(f"checkpoint {ckpt.path} failed verification on another rank (see its log)")


def restore(trainer, ckpt: Checkpoint, strict: bool) -> str:
    """Load `ckpt` into the trainer; returns the cursor outcome: restored | remapped | epoch_restarted."""
    _agree_verified(ckpt, trainer.env)
    path = ckpt.path / WEIGHTS
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: {exc}") from exc
    trainer.strategy.load_full_model_state(trainer.module, weights, strict=strict)

    reader = dcp.FileSystemReader(str(ckpt.path / TRAINER))
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    saved_world = sum(1 for k in saved_keys if k.startswith("rng.rank"))
    rng_key = f"rng.rank{trainer.env.rank}"
    optimizer_template = get_optimizer_state_dict(trainer.module, trainer.optimizer)
    template = {"optimizer": optimizer_template, "scheduler": b"", "trainer": b""}
    same_world = saved_world == trainer.env.world_size
    if same_world:
        template[rng_key] = b""
    try:
        group = trainer.checkpoints.group
        dcp.load(template, storage_reader=reader, process_group=group, no_dist=group is None)
    except Exception as exc:
        if strict:
            detail = f"{type(exc).__name__}: {str(exc)[:400]}"
            raise CheckpointError(f"cannot read {ckpt.path / TRAINER}: {detail}") from exc
        log.warning("resume_strict_state=False: trainer state in %s unreadable (%s); weights only", ckpt.path, exc)
        return "epoch_restarted"
    for part, load in (
        ("optimizer", lambda: set_optimizer_state_dict(trainer.module, trainer.optimizer, template["optimizer"])),
        ("scheduler", lambda: trainer.scheduler.load_state_dict(pickle.loads(template["scheduler"]))),
    ):
        try:
            load()
        except Exception as exc:
            if strict:
                raise CheckpointError(f"the {part} state in {ckpt.path / TRAINER} does not fit: {exc}") from exc
            log.warning("resume_strict_state=False: %s state not restored (%s)", part, exc)

    blob = pickle.loads(template["trainer"])
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
        set_rng_states(pickle.loads(template[rng_key]))
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
