"""The on-disk layout of checkpoints and how a complete one is recognised.

    <run>/model/last/          weights.pth  trainer.dcp/  .complete   (newest)
    <run>/model/step_<N>/      older complete checkpoints (keep_last in all)
    <run>/model/.tmp-step_<N>/ a checkpoint being written (never resumed from as such)
    <run>/model/.trash-<name>/ a checkpoint being deleted (never resumed from)
    <run>/model/model_best.pth  the best weights so far; model_best.json: its step, metric, value, sha256
    <run>/model/iter_<step>.pth  weight snapshots (save_iter_snapshots)

`.complete` is written last and holds a manifest: the format, the step and the size and sha256
of weights.pth and of every file in trainer.dcp/, so truncation or corruption is found before
loading. Every file it names is fsynced before it is written (see FORMAT.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pimm.errors import PimmError
from pimm.files import fsync, write_atomic

WEIGHTS = "weights.pth"
TRAINER = "trainer.dcp"
COMPLETE = ".complete"
LAST = "last"
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
BEST = "model_best.pth"
BEST_RECORD = "model_best.json"  # written after model_best.pth: {"step", "metric", "value", "sha256"}
FORMAT = 3  # 3: the model in trainer.dcp too (sharded under FSDP2); 2: no pickle anywhere in trainer.dcp
READABLE_FORMATS = (2, 3)  # format 1, unmarked, pickled the trainer state


class CheckpointError(PimmError):
    """A checkpoint cannot be used; the message names the directory or file."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(ckpt_dir: Path) -> list[Path]:
    return [ckpt_dir / WEIGHTS, *sorted((ckpt_dir / TRAINER).iterdir())]


def write_manifest(ckpt_dir: Path, step: int) -> None:
    """Write `.complete` (the last file of a checkpoint), once every file it names is on disk."""
    files = {}
    for path in _files(ckpt_dir):
        fsync(path)
        files[str(path.relative_to(ckpt_dir))] = [path.stat().st_size, sha256_file(path)]
    fsync(ckpt_dir / TRAINER)
    write_atomic(ckpt_dir / COMPLETE, json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def read_manifest(ckpt_dir: Path) -> dict:
    """The manifest of a complete checkpoint; CheckpointError('Incomplete checkpoint directory ...')."""
    if not (ckpt_dir / COMPLETE).is_file():
        raise CheckpointError(
            f"Incomplete checkpoint directory {ckpt_dir}: no {COMPLETE} marker (the write never finished)"
        )
    for name in (WEIGHTS, TRAINER):
        if not (ckpt_dir / name).exists():
            raise CheckpointError(f"Incomplete checkpoint directory {ckpt_dir}: {name} is missing")
    try:
        return json.loads((ckpt_dir / COMPLETE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Incomplete checkpoint directory {ckpt_dir}: unreadable {COMPLETE} ({exc})") from exc


def verify(ckpt_dir: Path, rank: int = 0, world_size: int = 1) -> dict:
    """Check files against the manifest (rank r checks every world_size-th file, so the ranks share
    the reading); CheckpointError names the first bad file, or the format when it is not readable."""
    manifest = read_manifest(ckpt_dir)
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is in format {manifest.get('format', 1)}, this pimm reads formats "
            f"{' and '.join(map(str, READABLE_FORMATS))} only (format 1 stored pickled state, which can run code "
            "when loaded); start a new run from its "
            f"weights with --train.weight {ckpt_dir / WEIGHTS}"
        )
    for i, (name, (size, digest)) in enumerate(sorted(manifest["files"].items())):
        if i % world_size != rank:
            continue
        path = ckpt_dir / name
        if not path.is_file() or path.stat().st_size != size:
            seen = f"{path.stat().st_size} bytes" if path.is_file() else "no file"
            raise CheckpointError(f"corrupt checkpoint file {path}: expected {size} bytes, found {seen}")
        if sha256_file(path) != digest:
            raise CheckpointError(f"corrupt checkpoint file {path}: its sha256 does not match {ckpt_dir / COMPLETE}")
    return manifest


def candidates(model_dir: Path) -> tuple[list[Checkpoint], list[Path]]:
    """(complete checkpoints newest first, incomplete checkpoint directories) among `last` and
    `step_*` under `model_dir`; staging and trash directories are never candidates."""
    complete: list[Checkpoint] = []
    incomplete: list[Path] = []
    if not model_dir.is_dir():
        return complete, incomplete
    for path in model_dir.iterdir():
        if not path.is_dir() or not (path.name == LAST or path.name.startswith("step_")):
            continue
        try:
            complete.append(Checkpoint(path, int(read_manifest(path)["step"])))
        except CheckpointError:
            incomplete.append(path)
    # `last` first among equal steps: it is the canonical name
    complete.sort(key=lambda c: (c.step, c.path.name == LAST), reverse=True)
    return complete, sorted(incomplete)


def newest_complete(model_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint among `candidates`, None when there is none."""
    complete, _ = candidates(model_dir)
    return complete[0] if complete else None


def is_real_dir(path: Path) -> bool:
    """A folder itself, not a symbolic link to one: pimm writes only folders under `model/`."""
    return path.is_dir() and not path.is_symlink()


def finished_writes(model_dir: Path) -> list[Checkpoint]:
    """Staging directories whose manifest was written (a crash came between `.complete` and the rename to
    `last`), newest first. A resume finishes the newest of them first when it is newer than every complete
    checkpoint (CheckpointManager._finish_interrupted_writes); links are never followed."""
    finished = []
    for path in model_dir.glob(STAGING_PREFIX + "*") if model_dir.is_dir() else ():
        if not is_real_dir(path):
            continue
        try:
            finished.append(Checkpoint(path, int(read_manifest(path)["step"])))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return sorted(finished, key=lambda c: c.step, reverse=True)


def newest_resumable(model_dir: Path) -> Checkpoint | None:
    """The checkpoint a resume goes on from: the newest complete one, or a finished write newer than it (the
    resume renames it `last` first); None when there is neither."""
    newest = newest_complete(model_dir)
    finished = finished_writes(model_dir)
    if finished and (newest is None or finished[0].step > newest.step):
        return finished[0]
    return newest


def resumable(model_dir: Path) -> tuple[list[Checkpoint], list[Path]]:
    """(complete checkpoints newest first, incomplete checkpoint directories). Raises
    CheckpointError('Incomplete checkpoint directory ...') when only incomplete ones exist."""
    complete, incomplete = candidates(model_dir)
    if not complete and incomplete:
        detail = "; ".join(_why_incomplete(p) for p in incomplete)
        raise CheckpointError(f"Incomplete checkpoint directory: no complete checkpoint to resume from ({detail})")
    return complete, incomplete


def _why_incomplete(path: Path) -> str:
    try:
        read_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    return str(path)
