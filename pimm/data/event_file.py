"""Identify and check pimm event files without importing torch (the launcher uses this); `validate_data`
also dispatches PILArNet-M shards to `pimm.data.pilarnet_file`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pimm.data.pilarnet_file import open_pilarnet
from pimm.data.synth import _DTYPES, CHUNK_ROWS, CLASS_NAMES, FORMAT, FORMAT_VERSION, synth_command
from pimm.errors import DataError

_REQUIRED_ATTRS = ("format", "format_version", "num_events", "content_hash")
# name -> (ndim, trailing shape, numpy kind) a valid file must have; the writer's dtypes are in synth._DTYPES
_REQUIRED_DATASETS = {
    "coord": (2, (3,), "f"),
    "energy": (1, (), "f"),
    "segment": (1, (), "u"),
    "offsets": (1, (), "i"),
}
_KIND_NAMES = {"f": "a floating-point type", "u": "an unsigned integer type", "i": "a signed integer type"}
_LABEL_SCAN_ROWS = 256 * CHUNK_ROWS  # 1M labels (1 MiB of uint8) per read: whole chunks, bounded memory
# files are written once and moved into place, so readers need no HDF5 file locks (which fail on
# some parallel file systems)
_OPEN_KW = {"mode": "r", "locking": False}
_H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError)  # what h5py raises on bad files


def _fail(path: Path, problem: str, todo: str | None = None) -> DataError:
    """A DataError naming the file, what is wrong with it and what to do (default: regenerate it)."""
    return DataError(f"event file {path}: {problem}; {todo or f'regenerate it with {synth_command(path)}'}")


def _read_index(path: str | Path) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """Validate an event file; return (identity dict, offsets array, class names). Closes the file."""
    given = Path(path)
    path = given.absolute()
    if not path.exists():
        where = "" if given.is_absolute() else (
            f" (a relative data path is relative to the current directory {Path.cwd()})"
        )
        raise _fail(path, f"no such file{where}", f"generate it with {synth_command(given)}, or fix the path")
    if not path.is_file():
        raise _fail(
            path,
            "is not a regular file (a directory?)",
            f"pass the .h5 file itself, or create one with {synth_command()}",
        )
    size = path.stat().st_size
    try:
        f = h5py.File(path, **_OPEN_KW)
    except _H5_ERRORS as exc:
        raise _fail(path, f"not a readable HDF5 file ({size} bytes; truncated or corrupt?): {exc}") from exc
    try:
        with f:
            missing = [a for a in _REQUIRED_ATTRS if a not in f.attrs]
            if missing:
                raise _fail(path, f"not a pimm event file: missing attributes {missing}")
            fmt = f.attrs["format"]
            fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
            if fmt != FORMAT:
                raise _fail(path, f"not a pimm event file: format is {fmt!r}, expected {FORMAT!r}")
            version = int(f.attrs["format_version"])
            if version != FORMAT_VERSION:
                raise _fail(
                    path,
                    f"format_version {version} is not supported (this pimm reads version {FORMAT_VERSION})",
                    f"use the pimm that wrote it or regenerate it with {synth_command(path)}",
                )
            num_events = int(f.attrs["num_events"])
            for name, (ndim, tail, kind) in _REQUIRED_DATASETS.items():
                if name not in f:
                    raise _fail(path, f"not a pimm event file: dataset '{name}' is missing")
                d = f[name]
                if not isinstance(d, h5py.Dataset) or d.ndim != ndim or d.shape[1:] != tail:
                    expected = "(N, " + ", ".join(map(str, tail)) + ")" if tail else "(N,)"
                    raise _fail(path, f"dataset '{name}' has shape {getattr(d, 'shape', None)}, expected {expected}")
                if d.dtype.kind != kind:
                    raise _fail(
                        path,
                        f"dataset '{name}' has dtype {d.dtype}, expected {_KIND_NAMES[kind]} ({_DTYPES[name].name})",
                    )
            rows = f["coord"].shape[0]
            for name in ("energy", "segment"):
                if f[name].shape[0] != rows:
                    raise _fail(path, f"dataset '{name}' has {f[name].shape[0]} rows but 'coord' has {rows}")
            offsets = np.asarray(f["offsets"][:], dtype=np.int64)
            if len(offsets) != num_events + 1:
                raise _fail(path, f"'offsets' has {len(offsets)} entries, expected num_events + 1 = {num_events + 1}")
            if num_events < 1 or offsets[0] != 0 or offsets[-1] != rows or np.any(np.diff(offsets) < 0):
                raise _fail(
                    path,
                    f"'offsets' is inconsistent with the data (starts at {offsets[0]}, ends at {offsets[-1]}, "
                    f"{rows} rows, must start at 0, never decrease and end at the row count)",
                )
            if rows:
                # touch the last chunk of each array: catches data lost after the metadata was written
                for name in ("coord", "energy", "segment"):
                    f[name][rows - 1]
            raw_names = f.attrs.get("class_names", json.dumps(list(CLASS_NAMES)))
            class_names = json.loads(raw_names.decode() if isinstance(raw_names, bytes) else raw_names)
            content_hash = f.attrs["content_hash"]
            content_hash = content_hash.decode() if isinstance(content_hash, bytes) else str(content_hash)
    except DataError:
        raise
    except _H5_ERRORS as exc:
        raise _fail(path, f"unreadable ({type(exc).__name__}: {exc}); the file is truncated or corrupt") from exc
    info = {
        "path": str(path),
        "size_bytes": size,
        "num_events": num_events,
        "content_hash": content_hash,
        "format_version": version,
    }
    return info, offsets, class_names


def validate_event_file(path: str | Path, num_classes: int | None = None, ignore_index: int = -1) -> dict[str, Any]:
    """Check that `path` is a readable pimm event file; return {path, size_bytes, num_events,
    content_hash, format_version}. With `num_classes`, also check that every label is in
    0..num_classes-1 or is `ignore_index`. Raises DataError saying what is wrong. Leaves no file open."""
    info, offsets, _ = _read_index(path)
    if num_classes is not None:
        _check_labels(Path(info["path"]), offsets, num_classes, ignore_index)
    return info


def validate_data(dataset: dict, num_classes: int | None = None, ignore_index: int = -1) -> dict[str, Any]:
    """Check the data a dataset config (`dict(type=..., path=..., ...)`) names, by its layout;
    return its identity ({path, size_bytes, num_events, content_hash, ...}; num_events after any
    event selection). Labels must be classes or `ignore_index` (task.ignore_index). Raises
    DataError or ConfigError saying what is wrong. Leaves no file open."""
    if dataset.get("type") == "PILArNetDataset":
        selection = ("split", "revision", "label", "min_points", "energy_threshold", "remove_low_energy_scatters")
        if dataset.get("pid_unlabelled_as_none") and dataset.get("label") == "pid":
            ignore_index = -1  # the reader turns the file's -1 into class "none": nothing is left unlabelled
        info, _, _ = open_pilarnet(dataset["path"], num_classes=num_classes, ignore_index=ignore_index,
                                   **{k: dataset[k] for k in selection if k in dataset})
        return info
    return validate_event_file(dataset["path"], num_classes=num_classes, ignore_index=ignore_index)


def _check_labels(path: Path, offsets: np.ndarray, num_classes: int, ignore_index: int = -1) -> None:
    """DataError naming the first event with a label >= num_classes that is not `ignore_index`
    (labels are unsigned).

    Reads `segment` in blocks of whole chunks with numpy: files may hold tens of millions of points."""
    try:
        with h5py.File(path, **_OPEN_KW) as f:
            segment = f["segment"]
            for lo in range(0, segment.shape[0], _LABEL_SCAN_ROWS):
                block = segment[lo : lo + _LABEL_SCAN_ROWS]
                outside = (block >= num_classes) & (block != ignore_index) if block.size else block
                if not outside.any():
                    continue
                first = int(np.flatnonzero(outside)[0])
                row = lo + first
                event = int(np.searchsorted(offsets, row, side="right")) - 1
                raise _fail(
                    path,
                    f"event {event} has label {int(block[first])}, outside 0..{num_classes - 1} "
                    f"(data.num_classes={num_classes}; point {row - int(offsets[event])} of the event, row {row})",
                    "set data.num_classes (and model.num_classes) to cover every label, or use a file "
                    f"written for {num_classes} classes",
                )
    except _H5_ERRORS as exc:
        raise _fail(path, f"unreadable labels ({type(exc).__name__}: {exc}); the file is truncated or corrupt") from exc
