"""Indexes cached beside data files: what a scan of every point found, kept in `<file>.pimm-index.npz`
so a second launch reads no point. Both pimm's event files (`pimm.data.event_format`) and
PILArNet-M shards (`pimm.data.pilarnet_file`) cache their scans here; each owns what its index
holds and when it is still valid (its stamp)."""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from pimm.files import atomic_path, os_error_reason

INDEX_SUFFIX = ".pimm-index.npz"
CHECKED_COLUMNS = ("x coordinate", "y coordinate", "z coordinate", "energy")  # what both scans check to be finite
NONFINITE_TODO = "fix the file, or set data.<split>.skip_nonfinite=true to leave such events out"
LOAD_ERRORS = (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile)  # a missing, corrupt or foreign index
log = logging.getLogger("pimm")

_in_memory: dict[tuple, Any] = {}  # indexes that could not be written beside their file, by key
_warned_dirs: set[str] = set()


def index_path(data: Path) -> Path:
    """Where the index of the data file `data` is cached."""
    return data.with_name(data.name + INDEX_SUFFIX)


def in_memory(key: tuple) -> Any | None:
    """The index this process kept under `key` because it could not write it beside its file."""
    return _in_memory.get(key)


def clear_memory() -> None:
    """Forget the indexes this process kept in memory (a benchmark's cold start)."""
    _in_memory.clear()


def load_arrays(data: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays `keys` of the index cached beside `data`; None when there is none, or it is
    corrupt, older or foreign (a cache is rebuilt, never trusted)."""
    try:
        with np.load(index_path(data), allow_pickle=False) as z:
            return {k: z[k] for k in keys}
    except LOAD_ERRORS:
        return None


def store(data: Path, key: tuple, arrays: dict[str, np.ndarray], index: Any) -> None:
    """Write `arrays` as the index beside the data file `data` in one rename (readers see the old
    index or the whole new one); where that fails keep `index` in this process under `key`, with one
    warning per directory."""
    try:
        # no fsync: a torn cache fails to load and is rebuilt
        with atomic_path(index_path(data), durable=False) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
    except OSError as exc:
        _in_memory[key] = index
        if str(data.parent) not in _warned_dirs:
            _warned_dirs.add(str(data.parent))
            log.warning("pimm: cannot cache event indexes in %s (%s); keeping them in memory, so every "
                        "process reads its data files once more", data.parent, os_error_reason(exc))
