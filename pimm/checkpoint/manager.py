"""One owner for checkpoints: structured save (weights.pth + DCP trainer state), asynchronous
writing, promotion to `last`, keep-last-k, and finding the newest usable checkpoint to resume.

Save protocol (every rank calls `save` at the same step):
  1. the caller hands over CPU copies of the state (the only part that blocks training);
  2. a background thread writes trainer.dcp/ with torch.distributed.checkpoint over a dedicated
     gloo group (so it never interleaves with the training collectives), and rank 0 writes
     weights.pth, then `.complete` (the manifest), then renames the directory into `last`;
  3. the previous `last` becomes `step_<N>`; older ones beyond keep_last are removed.
A crash at any point leaves the previous complete checkpoint untouched.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pimm.checkpoint.layout import (
    LAST,
    STAGING_PREFIX,
    TRAINER,
    WEIGHTS,
    Checkpoint,
    CheckpointError,
    read_manifest,
    resumable,
    write_manifest,
)

log = logging.getLogger("pimm")
# single-process runs save without a process group on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def clone_to_cpu(tree):
    """A CPU copy of every tensor in a nested dict/list (so training can go on while it is written)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: clone_to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_to_cpu(v) for v in tree)
    return tree


class CheckpointManager:
    def __init__(
        self,
        model_dir: Path,
        rank: int,
        world_size: int,
        keep_last: int = 2,
        async_save: bool = True,
        kill_during_save_at_step: int | None = None,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"checkpoint_keep_last must be >= 1, got {keep_last}")
        self.model_dir = model_dir
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.async_save = async_save
        self._kill_at = kill_during_save_at_step  # fault injection for tests
        # a group of its own: the writer thread's collectives never meet the training ones
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None
        self.last_blocking_s = 0.0
        self.last_write_s = 0.0

    # -- saving ----------------------------------------------------------------------------

    def clean_stale_staging(self) -> None:
        """Rank 0 removes half-written directories left by a crash (call before the first save)."""
        if self.rank == 0 and self.model_dir.is_dir():
            for path in self.model_dir.glob(STAGING_PREFIX + "*"):
                if not (path / ".complete").exists():
                    log.warning("removing the incomplete checkpoint write %s (interrupted earlier)", path)
                    shutil.rmtree(path, ignore_errors=True)

    def save(self, step: int, model_state: dict | None, trainer_state: dict, blocking: bool = False) -> None:
        """Write a checkpoint of `step`. `model_state` (rank 0 only) and `trainer_state` must already be
        CPU copies; returns once the write has started (or finished when blocking / not async)."""
        start = time.perf_counter()
        self.wait()
        staging = self.model_dir / f"{STAGING_PREFIX}step_{step:08d}"
        args = (staging, step, model_state, trainer_state)
        if self.async_save and not blocking:
            self._thread = threading.Thread(target=self._write_guarded, args=args, name="pimm-ckpt", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
        self.last_saved_step = step
        self.last_blocking_s = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the write in flight (if any) is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"checkpoint write failed: {error}") from error

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # reported by wait() on the training thread
            self._error = exc

    def _write(self, staging: Path, step: int, model_state: dict | None, trainer_state: dict) -> None:
        start = time.perf_counter()
        dcp.save(trainer_state, checkpoint_id=staging / TRAINER, process_group=self.group, no_dist=self.group is None)
        if self.rank == 0:
            torch.save(model_state, staging / WEIGHTS)
            if self._kill_at == step:
                os.kill(os.getpid(), 9)  # fault injection: die in the middle of a checkpoint write
            write_manifest(staging, step)
            self._promote(staging, step)
        self.last_write_s = time.perf_counter() - start

    def _promote(self, staging: Path, step: int) -> None:
        last = self.model_dir / LAST
        if last.exists():
            try:
                older = self.model_dir / f"step_{int(read_manifest(last)['step']):08d}"
                shutil.rmtree(older, ignore_errors=True)  # a superseded copy of the same step
                os.replace(last, older)
            except CheckpointError:
                shutil.rmtree(last)
        os.replace(staging, last)
        older = sorted(self.model_dir.glob("step_*"), reverse=True)
        for path in older[self.keep_last - 1 :]:
            shutil.rmtree(path, ignore_errors=True)
        log.info("checkpoint of step %d complete: %s", step, last)

    # -- resuming --------------------------------------------------------------------------

    def set_aside(self, bad: list[Path]) -> None:
        """Rank 0 renames unusable checkpoints to corrupt-<name> (kept for inspection, never resumed)."""
        if self.rank != 0:
            return
        for path in bad:
            target = self.model_dir / f"corrupt-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(path, target)
            log.warning("unusable checkpoint %s moved to %s", path, target)

    def resumable(self) -> list[Checkpoint]:
        """Complete checkpoints, newest first; CheckpointError when only incomplete ones exist."""
        complete, incomplete = resumable(self.model_dir)
        for path in incomplete:
            log.warning("Incomplete checkpoint directory %s skipped", path)
        return complete
