"""Identify and check pimm event files without importing torch (the launcher uses this); `validate_data`
also dispatches PILArNet-M shards to `pimm.data.pilarnet_file`.

Every point is read once per file (labels in range, coordinates and energies finite) and what the
checks need is cached beside the file in `<file>.pimm-index.npz`, like a PILArNet shard's index:
a second launch reads no point."""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pimm.data.pilarnet_file import (
    CHECKED_COLUMNS,
    NONFINITE_TODO,
    _memory_index,
    index_path,
    open_pilarnet,
    store_index,
)
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
_LABEL_SCAN_ROWS = 256 * CHUNK_ROWS  # 1M points (17 MiB of coord, energy, label) per read: whole chunks
# files are written once and moved into place, so readers need no HDF5 file locks (which fail on
# some parallel file systems)
_OPEN_KW = {"mode": "r", "locking": False}
_H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError)  # what h5py raises on bad files
log = logging.getLogger("pimm")


def _fail(path: Path, problem: str, todo: str | None = None) -> DataError:
    """A DataError naming the file, what is wrong with it and what to do (default: regenerate it)."""
    return DataError(f"event file {path}: {problem}; {todo or f'regenerate it with {synth_command(path)}'}")


def _read_index(path: str | Path, labels: bool = True) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """Validate an event file; return (identity dict, offsets array, class names). With
    `labels=False` (prediction) a file without a `segment` dataset is valid too. Closes the file."""
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
            has_labels = "segment" in f
            for name, (ndim, tail, kind) in _REQUIRED_DATASETS.items():
                if name == "segment" and not has_labels:
                    continue
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
            if not has_labels and labels:  # a data file otherwise: say what it lacks for this use
                raise _fail(path, "has no labels (no 'segment' dataset); evaluation needs labelled events",
                            "give a labelled file, or get predictions without metrics with `pimm predict`")
            rows = f["coord"].shape[0]
            columns = ("coord", "energy", "segment") if has_labels else ("coord", "energy")
            for name in columns[1:]:
                if f[name].shape[0] != rows:
                    raise _fail(path, f"dataset '{name}' has {f[name].shape[0]} rows but 'coord' has {rows}")
            if num_events < 1:
                raise _fail(path, f"the file has no events (num_events={num_events}, {rows} point rows)",
                            f"write one with at least one event, e.g. {synth_command(path)} with N >= 1")
            offsets = np.asarray(f["offsets"][:], dtype=np.int64)
            if len(offsets) != num_events + 1:
                raise _fail(path, f"'offsets' has {len(offsets)} entries, expected num_events + 1 = {num_events + 1}")
            if offsets[0] != 0 or offsets[-1] != rows or np.any(np.diff(offsets) < 0):
                raise _fail(
                    path,
                    f"'offsets' is inconsistent with the data (starts at {offsets[0]}, ends at {offsets[-1]}, "
                    f"{rows} rows, must start at 0, never decrease and end at the row count)",
                )
            if rows:
                # touch the last chunk of each array: catches data lost after the metadata was written
                for name in columns:
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


def validate_event_file(path: str | Path, num_classes: int | None = None, ignore_index: int = -1,
                        skip_nonfinite: bool = False, labels: bool = True) -> dict[str, Any]:
    """Check that `path` is a readable pimm event file whose coordinates and energies are all
    finite; return {path, size_bytes, num_events, content_hash, format_version, ...}. With
    `num_classes`, also check that every label is in 0..num_classes-1 or is `ignore_index`. With
    `skip_nonfinite`, events with a non-finite value are left out instead (`select_events`).
    With `labels=False` (prediction) labels are neither required nor checked.
    Raises DataError saying what is wrong. Leaves no file open."""
    return select_events(path, skip_nonfinite, num_classes, ignore_index, labels)[0]


def select_events(path: str | Path, skip_nonfinite: bool, num_classes: int | None = None, ignore_index: int = -1,
                  labels: bool = True) -> tuple[dict[str, Any], np.ndarray, list[str], np.ndarray]:
    """(info, offsets, class names, stored indices of the events used) of a pimm event file, after
    one pass over its points (`_scan_points`). An event with a non-finite coordinate or energy is a
    DataError naming the file, event and column, or with `skip_nonfinite` is left out: info's
    num_events counts the events used, nonfinite_dropped those left out, and its content_hash then
    also covers which ones (a resume checks it). `labels=False`: see `_read_index`."""
    info, offsets, class_names = _read_index(path, labels)
    path = Path(info["path"])
    index = _points_index(path, offsets, info["content_hash"])
    if num_classes is not None and labels:
        _check_labels(path, offsets, index, num_classes, ignore_index)
    bad = index["nonfinite_events"]
    events = np.arange(info["num_events"], dtype=np.int64)
    info.update(events_in_files=info["num_events"], nonfinite_dropped=len(bad), skip_nonfinite=bool(skip_nonfinite))
    if len(bad) and not skip_nonfinite:
        event, point, column, value = index["nonfinite_first"].tolist()
        raise _fail(path, f"event {int(event)} has a non-finite {CHECKED_COLUMNS[int(column)]} ({value}) at point "
                    f"{int(point)} of the event; {len(bad)} of {info['num_events']} events have non-finite "
                    "coordinates or energies", NONFINITE_TODO)
    if len(bad):
        events = np.setdiff1d(events, bad)
        if not len(events):
            raise _fail(path, f"every one of its {len(bad)} events has a non-finite coordinate or energy",
                        "fix the file or regenerate it")
        selection = {"content_hash": info["content_hash"], "nonfinite_dropped": bad.tolist()}
        info.update(num_events=len(events),
                    content_hash=hashlib.sha256(json.dumps(selection).encode()).hexdigest())
    return info, offsets, class_names, events


def dropped_note(info: dict[str, Any]) -> str | None:
    """The line that says how many events `skip_nonfinite` left out of a data set (None: none)."""
    if not info.get("nonfinite_dropped"):
        return None
    return (f"data {info['path']}: dropped {info['nonfinite_dropped']} of {info['events_in_files']} events with "
            f"non-finite values (skip_nonfinite=true); {info['num_events']} events are used")


def validate_data(dataset: dict, num_classes: int | None = None, ignore_index: int = -1) -> dict[str, Any]:
    """Check the data a dataset config (`dict(type=..., path=..., ...)`) names, by its layout;
    return its identity ({path, size_bytes, num_events, content_hash, ...}; num_events after any
    event selection). Labels must be classes or `ignore_index` (task.ignore_index). Raises
    DataError or ConfigError saying what is wrong. Leaves no file open."""
    skip_nonfinite = bool(dataset.get("skip_nonfinite", False))
    if dataset.get("type") == "PILArNetDataset":
        selection = ("split", "revision", "label", "min_points", "energy_threshold", "remove_low_energy_scatters",
                     "min_points_after_cut", "pid_unlabelled_as_none")
        info, _, _ = open_pilarnet(dataset["path"], num_classes=num_classes, ignore_index=ignore_index,
                                   skip_nonfinite=skip_nonfinite, **{k: dataset[k] for k in selection if k in dataset})
    else:
        info = validate_event_file(dataset["path"], num_classes=num_classes, ignore_index=ignore_index,
                                   skip_nonfinite=skip_nonfinite)
    note = dropped_note(info)
    if note:
        log.warning("pimm: %s", note)
    return info


_POINTS_INDEX_VERSION = 1
_CACHE_ERRORS = (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile)


def _points_index(path: Path, offsets: np.ndarray, content_hash: str) -> dict[str, np.ndarray]:
    """What the launch checks need from every point of an event file (`_scan_points`), cached
    beside it in `<file>.pimm-index.npz` (as PILArNet shards' indexes are) while its size, mtime
    and content hash are unchanged: a second launch reads no point."""
    st = path.stat()
    stamp = np.array([_POINTS_INDEX_VERSION, st.st_size, st.st_mtime_ns], np.int64)
    key = ("pimm-events", str(path), *stamp.tolist())
    index = _memory_index.get(key)
    if index is None:
        try:
            with np.load(index_path(path), allow_pickle=False) as z:
                if np.array_equal(z["stamp"], stamp) and str(z["content_hash"]) == content_hash:
                    index = {k: z[k] for k in _POINTS_INDEX_KEYS}
        except _CACHE_ERRORS:
            pass  # none yet, or a corrupt, older or foreign one: build it
    if index is None:
        index = _scan_points(path, offsets)
        store_index(path, key, {"stamp": stamp, "content_hash": np.array(content_hash), **index}, index)
    return index


_POINTS_INDEX_KEYS = ("nonfinite_events", "nonfinite_first", "label_values", "label_first_rows")


def _scan_points(path: Path, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """One pass over every point -> {nonfinite_events: sorted indices of the events with a
    non-finite coordinate or energy, nonfinite_first: (event, point, CHECKED_COLUMNS index,
    value) of the first such value (empty when none), label_values and label_first_rows: each
    label value present and the first row that has it}.

    Reads blocks of whole chunks with numpy: files may hold tens of millions of points."""
    bad_rows, first, labels = [], np.zeros(0), {}
    try:
        with h5py.File(path, **_OPEN_KW) as f:
            coord_ds, energy_ds = f["coord"], f["energy"]
            segment_ds = f.get("segment")  # None: an unlabelled file (prediction)
            for lo in range(0, coord_ds.shape[0], _LABEL_SCAN_ROWS):
                if segment_ds is not None:
                    segment = segment_ds[lo : lo + _LABEL_SCAN_ROWS]
                    present = (np.flatnonzero(np.bincount(segment)) if segment.dtype.itemsize <= 2
                               else np.unique(segment))  # bincount is fastest, but sized by the largest value
                    for value in present[[int(v) not in labels for v in present]]:
                        labels[int(value)] = lo + int(np.argmax(segment == value))
                coord, energy = coord_ds[lo : lo + _LABEL_SCAN_ROWS], energy_ds[lo : lo + _LABEL_SCAN_ROWS]
                finite = np.isfinite(coord)
                bad = ~(finite.all(axis=1) & np.isfinite(energy))
                if not bad.any():
                    continue
                rows = np.flatnonzero(bad)
                bad_rows.append(rows + lo)
                if not first.size:
                    r = int(rows[0])
                    columns = np.flatnonzero(~finite[r])
                    column, value = (columns[0], coord[r, columns[0]]) if len(columns) else (3, energy[r])
                    event = int(np.searchsorted(offsets, lo + r, side="right")) - 1
                    first = np.array([event, lo + r - int(offsets[event]), column, value], np.float64)
    except _H5_ERRORS as exc:
        raise _fail(path, f"unreadable points ({type(exc).__name__}: {exc}); the file is truncated or corrupt") from exc
    rows = np.concatenate(bad_rows) if bad_rows else np.zeros(0, np.int64)
    return {"nonfinite_events": np.unique(np.searchsorted(offsets, rows, side="right") - 1).astype(np.int64),
            "nonfinite_first": first, "label_values": np.array(list(labels), np.int64),
            "label_first_rows": np.array(list(labels.values()), np.int64)}


def _check_labels(path: Path, offsets: np.ndarray, index: dict[str, np.ndarray], num_classes: int,
                  ignore_index: int = -1) -> None:
    """DataError naming the first event with a label >= num_classes that is not `ignore_index`
    (labels are unsigned)."""
    values, rows = index["label_values"], index["label_first_rows"]
    outside = (values >= num_classes) & (values != ignore_index)
    if not outside.any():
        return
    label, row = min(zip(rows[outside].tolist(), values[outside].tolist()))[::-1]
    event = int(np.searchsorted(offsets, row, side="right")) - 1
    raise _fail(
        path,
        f"event {event} has label {label}, outside 0..{num_classes - 1} "
        f"(data.num_classes={num_classes}; point {row - int(offsets[event])} of the event, row {row})",
        "set data.num_classes (and model.num_classes) to cover every label, or use a file "
        f"written for {num_classes} classes",
    )
