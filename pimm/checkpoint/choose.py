"""Which weights of a run `--checkpoint last|best|step_N` names (`pimm export`, `pimm test`,
`pimm predict`), and holding them while a training may still write the run.

A training rotates its checkpoints while it runs: `last` becomes `step_<N>`, old ones are
deleted, model_best.pth is replaced. `hold_weights` takes the weights of one complete checkpoint
into a file of the reader's own (a hard link, which no rotation changes; a copy across file
systems) and checks that file against the checkpoint's record of it (the manifest's or
model_best.json's sha256): the weights, their step and their hash then come from one checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pimm.checkpoint.layout import (
    BEST,
    BEST_RECORD,
    COMPLETE,
    LAST,
    READABLE_FORMATS,
    WEIGHTS,
    CheckpointError,
    candidates,
    read_manifest,
    sha256_file,
    verify,
)
from pimm.errors import PimmError

_STEP = re.compile(r"step_(\d+)")
_HOLD_TRIES = 8  # a training replaces a checkpoint every few seconds at most: a few tries find one that stays
_CORRUPT_AFTER = 3  # the same file not matching the same record this often (0.15 s apart at least) is damaged


def _best_record(run_dir: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((run_dir / "model" / BEST_RECORD).read_text())
        if isinstance(record, dict):
            return record
    return {}


def _best_step(run_dir: Path) -> int | None:
    """The step model_best.pth was saved at: model/model_best.json says so; runs from before that
    file: the first validation with the highest mIoU (the trainer replaces it only on a strictly
    better one); None without either."""
    with contextlib.suppress(TypeError, KeyError, ValueError):
        return int(_best_record(run_dir)["step"])
    best, step = -math.inf, None
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        miou = rec.get("miou")
        if rec.get("kind") == "val" and isinstance(miou, int | float) and miou > best:
            best, step = miou, rec.get("step")
    return step


def default_checkpoint(run_dir: Path) -> str:
    """What `--checkpoint` means when it is not given: best when the run has a model_best.pth, else last."""
    return "best" if (run_dir / "model" / BEST).is_file() else "last"


def _available(run_dir: Path) -> str:
    """'available: ...' for messages: every checkpoint, snapshot and best file of the run."""
    model_dir = run_dir / "model"
    complete, incomplete = candidates(model_dir)
    snapshots = _snapshots(model_dir)
    available = [f"last (step {c.step})" if c.path.name == LAST else f"step_{c.step}" for c in complete]
    available += [f"step_{n} ({p.name})" for n, p in sorted(snapshots.items())
                  if n not in {c.step for c in complete}]
    available += [f"best ({BEST})"] if (model_dir / BEST).is_file() else []
    listing = ", ".join(available) or "none"
    if incomplete:
        listing += f"; incomplete, not usable: {', '.join(p.name for p in incomplete)}"
    return f"available: {listing}"


def _snapshots(model_dir: Path) -> dict[int, Path]:
    return {int(p.stem.removeprefix("iter_")): p for p in model_dir.glob("iter_*.pth")
            if p.stem.removeprefix("iter_").isdigit()}


class _Moved(Exception):
    """The chosen checkpoint was renamed or deleted by a training before it was held."""


def _checkpoint(run_dir: Path, which: str,
                between_renames: bool = False) -> tuple[Path | None, Path | None, int | None]:
    """(complete checkpoint directory, or else a weights file, of `which`, its step); PimmError naming
    what is available when there is none. between_renames (a reader of a run a training may write):
    _Moved when `last` is missing but other complete checkpoints are there, so that the caller looks again."""
    model_dir = run_dir / "model"
    if which == "best":
        best = model_dir / BEST
        if not best.is_file():
            raise PimmError(f"--checkpoint best: {best} does not exist (no validation improved the mIoU yet); "
                            f"{_available(run_dir)}")
        return None, best, _best_step(run_dir)
    complete, incomplete = candidates(model_dir)
    step = _STEP.fullmatch(which)
    if which == LAST:
        chosen = [c for c in complete if c.path.name == LAST]
        broken = [p for p in incomplete if p.name == LAST]
        if not chosen and not broken and complete and between_renames:
            raise _Moved  # a training replaces `last` by two renames (last -> step_N, staging -> last)
    elif step:
        n = int(step.group(1))
        chosen = [c for c in complete if c.step == n]
        broken = [p for p in incomplete if _STEP.fullmatch(p.name) and int(p.name.removeprefix("step_")) == n]
        snapshot = _snapshots(model_dir).get(n)
        if not chosen and snapshot is not None:
            return None, snapshot, n
    else:
        raise PimmError(f"--checkpoint {which!r} is not last, best or step_N; {_available(run_dir)}")
    if not chosen:
        if broken:
            raise PimmError(f"checkpoint {broken[0]} is incomplete (its write never finished: no .complete marker or "
                            f"a file missing); choose a complete one ({_available(run_dir)})")
        raise PimmError(f"no checkpoint {which!r} in {model_dir}; {_available(run_dir)}")
    return chosen[0].path, None, chosen[0].step


def choose_weights(run_dir: Path, which: str) -> tuple[Path, int | None]:
    """(weights file, its step) of `--checkpoint which` (last, best or step_N) of a run, verified;
    PimmError naming the available ones otherwise. Used by `pimm export` (a finished run: nothing
    rotates it; a reader of a run that may be training holds the weights instead: hold_weights)."""
    directory, weights, step = _checkpoint(run_dir, which)
    if directory is None:
        return weights, step
    try:
        verify(directory)  # sizes and sha256 of weights.pth against the manifest
    except PimmError as exc:
        raise PimmError(f"{exc}; choose another checkpoint ({_available(run_dir)})") from exc
    return directory / WEIGHTS, step


@dataclass(frozen=True)
class HeldWeights:
    """Weights of one complete checkpoint of a run, held in a file that no training changes."""

    path: Path  # the held file: what the ranks load
    source: Path  # the file it was taken from (RUN/model/last/weights.pth, model_best.pth, ...)
    step: int | None
    sha256: str


def recorded_weights(run_dir: Path, which: str) -> tuple[Path, int | None, str | None]:
    """(weights file, its step, the sha256 its checkpoint records: None where none is recorded) of
    `--checkpoint which` as the run's files say now, reading no weights; PimmError naming what is
    available when there is no such checkpoint."""
    for attempt in range(_HOLD_TRIES):
        with contextlib.suppress(_Moved):
            return _recorded(run_dir, which)
        time.sleep(0.05 * (attempt + 1))
    raise _changing(run_dir, which)


def _recorded(run_dir: Path, which: str) -> tuple[Path, int | None, str | None]:
    """recorded_weights, once: _Moved when the checkpoint went away while it was read."""
    directory, weights, step = _checkpoint(run_dir, which, between_renames=True)
    if directory is None:
        record = _best_record(run_dir) if weights.name == BEST else {}
        return weights, step, record.get("sha256") if isinstance(record.get("sha256"), str) else None
    try:
        manifest = read_manifest(directory)
    except CheckpointError:
        if directory.is_dir() and (directory / COMPLETE).is_file():
            raise  # an unreadable manifest
        raise _Moved from None  # rotated away after it was chosen
    if manifest.get("format") not in READABLE_FORMATS:
        verify(directory)  # the one message for an unreadable format
    size_sha = (manifest.get("files") or {}).get(WEIGHTS)
    if not (isinstance(size_sha, list) and len(size_sha) == 2):
        raise CheckpointError(f"Incomplete checkpoint directory {directory}: its manifest names no {WEIGHTS}")
    return directory / WEIGHTS, int(manifest["step"]), str(size_sha[1])


def _take(source: Path, into: Path) -> None:
    """`into` becomes the file `source` is now: a hard link (a later rename or delete of `source` leaves
    it as it is), else a copy (another file system, or links not allowed). _Moved when `source` is gone."""
    with contextlib.suppress(FileNotFoundError):
        into.unlink()
    try:
        os.link(source, into)
    except FileNotFoundError:
        raise _Moved from None
    except OSError:
        try:
            shutil.copyfile(source, into)
        except FileNotFoundError:
            raise _Moved from None


def hold_weights(run_dir: Path, which: str, into: Path) -> HeldWeights:
    """The weights `--checkpoint which` names, held at `into` (see the module docstring), with the step
    and sha256 of the checkpoint they come from. A checkpoint that a training rotates away or replaces
    while it is taken is taken again (the newest `which` then); PimmError when none can be chosen,
    CheckpointError when a file that stays the same keeps not matching its record (a corrupt file)."""
    seen, repeats = None, 0
    for attempt in range(_HOLD_TRIES):
        try:
            source, step, expected = _recorded(run_dir, which)
            taken = (source, step, expected, _file_key(source))
            _take(source, into)
        except _Moved:
            time.sleep(0.05 * (attempt + 1))
            continue
        digest = sha256_file(into)
        if expected is None or digest == expected:
            return HeldWeights(into, source, step, digest)
        into.unlink()
        repeats = repeats + 1 if taken == seen else 1
        seen = taken
        if repeats == _CORRUPT_AFTER:  # the same file and record each time: not a write in flight
            raise CheckpointError(f"corrupt checkpoint file {source}: its sha256 does not match its checkpoint's "
                                  f"record; choose another checkpoint ({_available(run_dir)})")
        time.sleep(0.05 * (attempt + 1))  # replaced while it was taken, or its record not yet: again
    raise _changing(run_dir, which)


def _file_key(path: Path) -> tuple[int, int, int]:
    """What tells a replaced file from the one before: inode, size, modification time."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _Moved from None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _changing(run_dir: Path, which: str) -> PimmError:
    if which == LAST and not (run_dir / "model" / LAST).exists():
        return PimmError(f"no checkpoint 'last' in {run_dir / 'model'} (a training stopped between the two renames "
                         f"that replace it: its resume restores it); name another ({_available(run_dir)})")
    return PimmError(f"--checkpoint {which}: the run's checkpoints changed {_HOLD_TRIES} times while pimm took one "
                     f"(a training writes {run_dir / 'model'} right now); try again, or name an older checkpoint "
                     f"that stays ({_available(run_dir)})")
