"""One owner for checkpoints: structured save (weights.pth + DCP trainer state), asynchronous
writing, promotion to `last`, keep-last-k, and finding the checkpoints to resume from.

Save protocol (every rank calls `save` at the same step):
  1. the caller hands over CPU copies of the state (the only part that blocks training);
  2. a background thread writes trainer.dcp/ with torch.distributed.checkpoint over a dedicated
     gloo group (so it never interleaves with the training collectives; each rank fsyncs its
     files), and rank 0 writes weights.pth, then `.complete` (the manifest, written once every
     file it names is fsynced), then renames the directory into `last` and fsyncs model/;
  3. the previous `last` becomes `step_<N>`; older ones beyond keep_last are renamed to
     `.trash-<name>` (never resumed from) and then deleted.
A crash at any point leaves the previous complete checkpoint untouched; a complete staging
directory left by a crash before its rename is finished (or removed) by the next resume.
"""

from __future__ import annotations

import contextlib
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from pimm.checkpoint.layout import (
    LAST,
    STAGING_PREFIX,
    TRAINER,
    TRASH_PREFIX,
    WEIGHTS,
    Checkpoint,
    CheckpointError,
    is_real_dir,
    newest_complete,
    read_manifest,
    resumable,
    verify,
    write_manifest,
)
from pimm.checkpoint.weights import save
from pimm.distributed.env import broadcast_from_rank0
from pimm.files import fsync, os_error_reason, storage_error

log = logging.getLogger("pimm")
# single-process runs save without a process group on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def clone_to_cpu(tree):
    """A fresh CPU copy of every tensor in a nested dict/list."""
    return Stager().stage(tree)


class Stager:
    """CPU copies of the state for an asynchronous write, into buffers kept from the previous
    save (warm pages: no allocation or page faults on the training thread after the first save;
    pinned when the source is on a GPU, so the copies run as DMA). DTensor shards (FSDP2) are
    copied shard by shard and rewrapped with their mesh and placements, so DCP writes each rank's
    own shard. The caller must not stage while a write of the previous copies is in flight."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, tree, name: str = ""):
        staged = self._copy(tree, (name,))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def _copy(self, tree, path: tuple):
        if isinstance(tree, DTensor):
            local = self._copy(tree.to_local(), (*path, "local"))
            return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False,
                                      shape=tree.shape, stride=tree.stride())
        if isinstance(tree, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != tree.shape or buffer.dtype != tree.dtype:
                pin = tree.device.type == "cuda"
                buffer = self._buffers[path] = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=pin)
            return buffer.copy_(tree.detach(), non_blocking=True)
        if isinstance(tree, dict):
            return {k: self._copy(v, (*path, k)) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._copy(v, (*path, i)) for i, v in enumerate(tree))
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
        kill_after_manifest_at_step: int | None = None,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"checkpoint_keep_last must be >= 1, got {keep_last}")
        self.model_dir = model_dir
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.async_save = async_save
        # fault injection for tests: rank 0 dies before a write's manifest, or between it and the rename to `last`
        self._kill_at = kill_during_save_at_step
        self._kill_after_manifest_at = kill_after_manifest_at_step
        # a group of its own: the writer thread's collectives never meet the training ones
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._stager = Stager()
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None
        self.last_blocking_s = 0.0
        self.last_write_s = 0.0

    # -- saving ----------------------------------------------------------------------------

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

    def stage(self, tree, name: str):
        """CPU copies of `tree` for `save` (waits for the write in flight: it reads the buffers)."""
        self.wait()
        return self._stager.stage(tree, name)

    def wait(self) -> None:
        """Block until the write in flight (if any) is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"checkpoint write failed: {error}") from error

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # reported by wait() on the training thread
            self._error = exc

    def _write(self, staging: Path, step: int, model_state: dict | None, trainer_state: dict) -> None:
        """Write and promote one checkpoint. When that fails, rank 0 removes the unfinished directory
        (which frees the space it took); a full disk or a failed DCP write (every rank's errors with
        their tracebacks) becomes one line: CheckpointError naming the step, the directory, the reason."""
        try:
            self._write_and_promote(staging, step, model_state, trainer_state)
        except (Exception, CheckpointException) as exc:  # DCP's gathered errors are a BaseException
            if self.rank == 0:  # every rank is past its DCP writes: the collective reported the failure to all
                shutil.rmtree(staging, ignore_errors=True)
            if storage_error(exc) is None and not isinstance(exc, CheckpointException):
                raise
            raise CheckpointError(f"cannot write the checkpoint of step {step} to {staging}: {_why(exc)}") from exc

    def _write_and_promote(self, staging: Path, step: int, model_state: dict | None, trainer_state: dict) -> None:
        start = time.perf_counter()
        writer = dcp.FileSystemWriter(staging / TRAINER, sync_files=True)  # each rank fsyncs its files
        dcp.save(trainer_state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
        if self.rank == 0:
            save(model_state, staging / WEIGHTS)
            if self._kill_at == step:
                os.kill(os.getpid(), 9)  # fault injection: die in the middle of a checkpoint write
            write_manifest(staging, step)
            if self._kill_after_manifest_at == step:
                os.kill(os.getpid(), 9)
            self._promote(staging, step)
        self.last_write_s = time.perf_counter() - start

    def _promote(self, staging: Path, step: int) -> None:
        last = self.model_dir / LAST
        if last.exists():
            try:
                older = self.model_dir / f"step_{int(read_manifest(last)['step']):08d}"
                if older.exists():
                    self._discard(older)  # a superseded copy of the same step
                os.replace(last, older)
            except CheckpointError:
                self._discard(last)
        os.replace(staging, last)
        fsync(self.model_dir)
        older = sorted(self.model_dir.glob("step_*"), reverse=True)
        for path in older[self.keep_last - 1 :]:
            self._discard(path)
        log.info("checkpoint of step %d complete: %s", step, last)

    def _discard(self, path: Path) -> None:
        """Delete a checkpoint directory so that no crash leaves it half deleted under its name:
        rename it to .trash-<name> (which nothing resumes from) first."""
        if not is_real_dir(path):  # a link or file planted under a checkpoint's name: removed, never followed
            _remove(path)
            return
        trash = self.model_dir / f"{TRASH_PREFIX}{path.name}"
        _remove(trash)  # a leftover of the same name
        os.replace(path, trash)
        fsync(self.model_dir)
        _remove(trash)  # what is left is removed at the next resume

    # -- resuming --------------------------------------------------------------------------

    def resume_candidates(self) -> list[Checkpoint]:
        """The complete checkpoints to resume from, newest first, as rank 0 sees them (every rank
        calls this and gets the same list). Rank 0 first deletes .trash-* leftovers and finishes
        the writes a crash interrupted. CheckpointError on every rank when only incomplete
        checkpoints exist."""
        found: list[tuple[str, int]] = []
        error = None
        if self.rank == 0:
            try:
                self._finish_interrupted_writes()
                complete, incomplete = resumable(self.model_dir)
                for path in incomplete:
                    log.warning("Incomplete checkpoint directory %s skipped", path)
                found = [(str(c.path), c.step) for c in complete]
            except (CheckpointError, OSError) as exc:
                error = str(exc)
        found, error = broadcast_from_rank0((found, error))
        if error is not None:
            raise CheckpointError(error)
        return [Checkpoint(Path(path), step) for path, step in found]

    def _finish_interrupted_writes(self) -> None:
        """Rank 0: a staging directory with a valid manifest (a crash came between `.complete` and
        the rename) becomes `last` when it is newer than every checkpoint, else it is removed, as
        is any incomplete one; .trash-* leftovers of an interrupted delete are removed."""
        for trash in self.model_dir.glob(TRASH_PREFIX + "*"):
            log.warning("removing %s (a checkpoint whose deletion was interrupted)", trash)
            _remove(trash)
        newest_checkpoint = newest_complete(self.model_dir)
        newest = newest_checkpoint.step if newest_checkpoint else -1
        for staging in sorted(self.model_dir.glob(STAGING_PREFIX + "*")):  # oldest step first
            if not is_real_dir(staging):  # pimm writes only folders here: a link is removed, never followed
                log.warning("removing %s (a %s, not a checkpoint write of pimm's)", staging,
                            "symbolic link" if staging.is_symlink() else "file")
                _remove(staging)
                continue
            try:
                step = int(verify(staging)["step"])
            except CheckpointError as exc:
                log.warning("removing the unfinished checkpoint write %s (%s)", staging, exc)
                self._discard(staging)
                continue
            if step > newest:
                log.warning("finishing the checkpoint write of step %d that a crash interrupted: %s", step, staging)
                self._promote(staging, step)
                newest = step
            else:
                log.warning(
                    "removing %s: a finished write of step %d, not newer than the checkpoint of step %d",
                    staging, step, newest,
                )
                self._discard(staging)

    def set_aside(self, bad: list[Path]) -> None:
        """Rank 0 renames unusable checkpoints to corrupt-<name> (kept for inspection, never resumed)."""
        if self.rank != 0:
            return
        for path in bad:
            target = self.model_dir / f"corrupt-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(path, target)
            log.warning("unusable checkpoint %s moved to %s", path, target)
        if bad:
            fsync(self.model_dir)


def _remove(path: Path) -> None:
    """Remove `path` without following it: a symbolic link or file is unlinked (what it points to
    stays), a folder deleted with its contents; nothing there is no error."""
    if is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _why(exc: BaseException) -> str:
    """The reason of a failed write in a few words: the disk's ('no space left on device'), else
    the first line of the error (DCP gathers every rank's errors with their tracebacks)."""
    full = storage_error(exc)
    if full is not None:
        return os_error_reason(full)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = next(iter(failures.items()))
        exc = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]
