"""pimm's event file format ("pimm-events", version 1): the one owner of its names, version, class
names, chunking and detector size, of writing it (`write_event_file`) and of checking it
(`check_layout`, `validate_event_file`, `select_events`).

Layout: flat datasets `coord` (N,3) float32, `energy` (N,) float32, `segment` (N,) uint8 (absent in
an unlabelled file, which only prediction reads) and `offsets` (E+1,) int64, event i being rows
offsets[i]:offsets[i+1], coordinates in [0, DETECTOR_SIZE)^3; attributes `format`,
`format_version`, `num_events` and `content_hash` (required), `class_names` (a JSON list) and the
writer's provenance (pimm's generator: `generator`, `generator_version`, `seed`).

The generator (`pimm.data.synth`) writes through this module; the launcher's checks
(`pimm.data.event_file.validate_data`) and the torch reader (`pimm.data.dataset.LArTPCDataset`)
read through it, without torch. Every point is read once per file (labels in range, coordinates
and energies finite) and what the checks need is cached beside the file (`pimm.data.index_cache`):
a second launch reads no point.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pimm.data import index_cache
from pimm.data.hdf5 import H5_ERRORS, open_read
from pimm.data.index_cache import CHECKED_COLUMNS, NONFINITE_TODO
from pimm.errors import DataError
from pimm.files import atomic_path

FORMAT = "pimm-events"
FORMAT_VERSION = 1
CLASS_NAMES = ("shower", "track", "michel", "delta", "low_energy")  # PILArNet-M's five semantic classes
DETECTOR_SIZE = 256.0  # coordinates lie in [0, DETECTOR_SIZE)^3, one unit a ~3 mm voxel pitch
CHUNK_ROWS = 4096  # measured fastest for random event reads (vs 1k/16k/64k); lzf saved only 3%, so none
REQUIRED_ATTRS = ("format", "format_version", "num_events", "content_hash")
POINT_DATASETS = ("coord", "energy", "segment")  # one row per point
DTYPES = {"coord": np.dtype("<f4"), "energy": np.dtype("<f4"), "segment": np.dtype("u1"), "offsets": np.dtype("<i8")}
# name -> (ndim, trailing shape, numpy kind) a valid file must have (a reader accepts any dtype of that kind)
SHAPES = {
    "coord": (2, (3,), "f"),
    "energy": (1, (), "f"),
    "segment": (1, (), "u"),
    "offsets": (1, (), "i"),
}
_KIND_NAMES = {"f": "a floating-point type", "u": "an unsigned integer type", "i": "a signed integer type"}
_SCAN_ROWS = 256 * CHUNK_ROWS  # 1M points (17 MiB of coord, energy, label) per read: whole chunks
_WRITE_ROWS = 8 * CHUNK_ROWS  # the writer buffers this many points, then writes whole chunks


def synth_command(path: str | Path = "PATH") -> str:
    """The CLI command that (re)generates an event file at `path`, for error messages."""
    return f"`pimm data synth --out {path} --events N --seed S`"


def event_file_error(path: Path, problem: str, todo: str | None = None) -> DataError:
    """A DataError naming the file, what is wrong with it and what to do (default: regenerate it)."""
    return DataError(f"event file {path}: {problem}; {todo or f'regenerate it with {synth_command(path)}'}")


# ----------------------------------------------------------------------------- writing


_HASHED = ("coord", "energy", "segment", "offsets")  # the arrays content_hash covers, in order


class _ContentHasher:
    """Streams the four arrays' raw little-endian bytes into one sha256 per array.

    content_hash = sha256(sha256(coord) || sha256(energy) || sha256(segment) || sha256(offsets)),
    the inner digests being raw 32-byte digests of each array's C-order bytes. Per-array
    streams let the writer hash rows as it writes them, in any interleaving.
    """

    def __init__(self) -> None:
        self._h = {name: hashlib.sha256() for name in _HASHED}

    def update(self, name: str, array: np.ndarray) -> None:
        self._h[name].update(np.ascontiguousarray(array, dtype=DTYPES[name]).data)

    def hexdigest(self) -> str:
        return hashlib.sha256(b"".join(self._h[name].digest() for name in _HASHED)).hexdigest()


def write_event_file(path: str | Path, events: Iterable[dict[str, np.ndarray]], attrs: dict[str, Any] | None = None
                     ) -> Path:
    """Write `events` (dicts of coord (N,3), energy (N,) and segment (N,) arrays) as a pimm event file
    at `path`; `attrs` is the writer's provenance (generator, generator_version, seed), stored beside
    the format's own attributes. The file appears complete in one rename with the permissions the
    umask gives (`pimm.files.atomic_path`), or not at all. Returns the path; OSError when it cannot
    be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hasher = _ContentHasher()
    offsets = [0]
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        arrays = {name: f.create_dataset(name, shape=(0, *SHAPES[name][1]), maxshape=(None, *SHAPES[name][1]),
                                         dtype=DTYPES[name], chunks=(CHUNK_ROWS, *SHAPES[name][1]))
                  for name in POINT_DATASETS}
        pending: dict[str, list[np.ndarray]] = {name: [] for name in POINT_DATASETS}

        def flush() -> None:
            for name, d in arrays.items():
                block = np.concatenate(pending[name]).astype(DTYPES[name], copy=False)
                written = d.shape[0]
                d.resize(written + len(block), axis=0)
                d[written:] = block
                hasher.update(name, block)
                pending[name] = []

        for event in events:
            for name in POINT_DATASETS:
                pending[name].append(event[name])
            offsets.append(offsets[-1] + len(event["segment"]))
            if offsets[-1] - arrays["segment"].shape[0] >= _WRITE_ROWS:  # write whole chunks at a time
                flush()
        if pending["segment"]:
            flush()
        offsets_array = np.asarray(offsets, dtype=DTYPES["offsets"])
        f.create_dataset("offsets", data=offsets_array)
        hasher.update("offsets", offsets_array)
        f.attrs.update(attrs or {})
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["num_events"] = len(offsets) - 1
        f.attrs["class_names"] = json.dumps(list(CLASS_NAMES))
        f.attrs["content_hash"] = hasher.hexdigest()
    return path


def compute_content_hash(path: str | Path) -> str:
    """Recompute the content hash of an event file from its stored arrays (see `_ContentHasher`)."""
    hasher = _ContentHasher()
    with open_read(path) as f:
        for name in _HASHED:
            d = f[name]
            for lo in range(0, d.shape[0], _SCAN_ROWS):
                hasher.update(name, d[lo : lo + _SCAN_ROWS])
    return hasher.hexdigest()


# ----------------------------------------------------------------------------- checking and reading


def check_layout(path: str | Path, labels: bool = True) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """Check that `path` is a pimm event file by its layout (attributes, version, datasets, shapes,
    offsets), reading no point; return (identity {path, size_bytes, num_events, content_hash,
    format_version}, offsets array, class names). With `labels=False` (prediction) a file without
    a `segment` dataset is valid too. DataError saying what is wrong; leaves no file open."""
    given = Path(path)
    path = given.absolute()
    if not path.exists():
        where = "" if given.is_absolute() else (
            f" (a relative data path is relative to the current directory {Path.cwd()})"
        )
        raise event_file_error(path, f"no such file{where}",
                               f"generate it with {synth_command(given)}, or fix the path")
    if not path.is_file():
        raise event_file_error(
            path,
            "is not a regular file (a directory?)",
            f"pass the .h5 file itself, or create one with {synth_command()}",
        )
    size = path.stat().st_size
    try:
        f = open_read(path)
    except H5_ERRORS as exc:
        raise event_file_error(path, f"not a readable HDF5 file ({size} bytes; truncated or corrupt?): {exc}") from exc
    try:
        with f:
            missing = [a for a in REQUIRED_ATTRS if a not in f.attrs]
            if missing:
                raise event_file_error(path, f"not a pimm event file: missing attributes {missing}")
            fmt = f.attrs["format"]
            fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
            if fmt != FORMAT:
                raise event_file_error(path, f"not a pimm event file: format is {fmt!r}, expected {FORMAT!r}")
            version = int(f.attrs["format_version"])
            if version != FORMAT_VERSION:
                raise event_file_error(
                    path,
                    f"format_version {version} is not supported (this pimm reads version {FORMAT_VERSION})",
                    f"use the pimm that wrote it or regenerate it with {synth_command(path)}",
                )
            num_events = int(f.attrs["num_events"])
            has_labels = "segment" in f
            for name, (ndim, tail, kind) in SHAPES.items():
                if name == "segment" and not has_labels:
                    continue
                if name not in f:
                    raise event_file_error(path, f"not a pimm event file: dataset '{name}' is missing")
                d = f[name]
                if not isinstance(d, h5py.Dataset) or d.ndim != ndim or d.shape[1:] != tail:
                    expected = "(N, " + ", ".join(map(str, tail)) + ")" if tail else "(N,)"
                    raise event_file_error(path, f"dataset '{name}' has shape {getattr(d, 'shape', None)}, "
                                           f"expected {expected}")
                if d.dtype.kind != kind:
                    raise event_file_error(
                        path,
                        f"dataset '{name}' has dtype {d.dtype}, expected {_KIND_NAMES[kind]} ({DTYPES[name].name})",
                    )
            if not has_labels and labels:  # a data file otherwise: say what it lacks for this use
                raise event_file_error(path, "has no labels (no 'segment' dataset); evaluation needs labelled "
                                       "events", "give a labelled file, or get predictions without metrics with "
                                       "`pimm predict`")
            rows = f["coord"].shape[0]
            columns = ("coord", "energy", "segment") if has_labels else ("coord", "energy")
            for name in columns[1:]:
                if f[name].shape[0] != rows:
                    raise event_file_error(path, f"dataset '{name}' has {f[name].shape[0]} rows but 'coord' has "
                                           f"{rows}")
            if num_events < 1:
                raise event_file_error(path, f"the file has no events (num_events={num_events}, {rows} point rows)",
                                       f"write one with at least one event, e.g. {synth_command(path)} with N >= 1")
            offsets = np.asarray(f["offsets"][:], dtype=np.int64)
            if len(offsets) != num_events + 1:
                raise event_file_error(path, f"'offsets' has {len(offsets)} entries, expected num_events + 1 = "
                                       f"{num_events + 1}")
            if offsets[0] != 0 or offsets[-1] != rows or np.any(np.diff(offsets) < 0):
                raise event_file_error(
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
    except H5_ERRORS as exc:
        raise event_file_error(path, f"unreadable ({type(exc).__name__}: {exc}); the file is truncated or "
                               "corrupt") from exc
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
    also covers which ones (a resume checks it). `labels=False`: see `check_layout`."""
    info, offsets, class_names = check_layout(path, labels)
    path = Path(info["path"])
    index = _points_index(path, offsets, info["content_hash"])
    if num_classes is not None and labels:
        _check_labels(path, offsets, index, num_classes, ignore_index)
    bad = index["nonfinite_events"]
    events = np.arange(info["num_events"], dtype=np.int64)
    info.update(events_in_files=info["num_events"], nonfinite_dropped=len(bad), skip_nonfinite=bool(skip_nonfinite))
    if len(bad) and not skip_nonfinite:
        event, point, column, value = index["nonfinite_first"].tolist()
        raise event_file_error(path, f"event {int(event)} has a non-finite {CHECKED_COLUMNS[int(column)]} ({value}) "
                               f"at point {int(point)} of the event; {len(bad)} of {info['num_events']} events have "
                               "non-finite coordinates or energies", NONFINITE_TODO)
    if len(bad):
        events = np.setdiff1d(events, bad)
        if not len(events):
            raise event_file_error(path, f"every one of its {len(bad)} events has a non-finite coordinate or "
                                   "energy", "fix the file or regenerate it")
        selection = {"content_hash": info["content_hash"], "nonfinite_dropped": bad.tolist()}
        info.update(num_events=len(events),
                    content_hash=hashlib.sha256(json.dumps(selection).encode()).hexdigest())
    return info, offsets, class_names, events


_POINTS_INDEX_VERSION = 1
_POINTS_INDEX_KEYS = ("nonfinite_events", "nonfinite_first", "label_values", "label_first_rows")


def _points_index(path: Path, offsets: np.ndarray, content_hash: str) -> dict[str, np.ndarray]:
    """What the launch checks need from every point of an event file (`_scan_points`), cached
    beside it (`pimm.data.index_cache`, as PILArNet shards' indexes are) while its size, mtime
    and content hash are unchanged: a second launch reads no point."""
    st = path.stat()
    stamp = np.array([_POINTS_INDEX_VERSION, st.st_size, st.st_mtime_ns], np.int64)
    key = (FORMAT, str(path), *stamp.tolist())
    index = index_cache.in_memory(key)
    if index is None:
        cached = index_cache.load_arrays(path, ("stamp", "content_hash", *_POINTS_INDEX_KEYS))
        fresh = cached is not None and np.array_equal(cached["stamp"], stamp)
        if fresh and str(cached["content_hash"]) == content_hash:
            index = {k: cached[k] for k in _POINTS_INDEX_KEYS}
    if index is None:
        index = _scan_points(path, offsets)
        index_cache.store(path, key, {"stamp": stamp, "content_hash": np.array(content_hash), **index}, index)
    return index


def _scan_points(path: Path, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """One pass over every point -> {nonfinite_events: sorted indices of the events with a
    non-finite coordinate or energy, nonfinite_first: (event, point, CHECKED_COLUMNS index,
    value) of the first such value (empty when none), label_values and label_first_rows: each
    label value present and the first row that has it}.

    Reads blocks of whole chunks with numpy: files may hold tens of millions of points."""
    bad_rows, first, labels = [], np.zeros(0), {}
    try:
        with open_read(path) as f:
            coord_ds, energy_ds = f["coord"], f["energy"]
            segment_ds = f.get("segment")  # None: an unlabelled file (prediction)
            for lo in range(0, coord_ds.shape[0], _SCAN_ROWS):
                if segment_ds is not None:
                    segment = segment_ds[lo : lo + _SCAN_ROWS]
                    present = (np.flatnonzero(np.bincount(segment)) if segment.dtype.itemsize <= 2
                               else np.unique(segment))  # bincount is fastest, but sized by the largest value
                    for value in present[[int(v) not in labels for v in present]]:
                        labels[int(value)] = lo + int(np.argmax(segment == value))
                coord, energy = coord_ds[lo : lo + _SCAN_ROWS], energy_ds[lo : lo + _SCAN_ROWS]
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
    except H5_ERRORS as exc:
        raise event_file_error(path, f"unreadable points ({type(exc).__name__}: {exc}); the file is truncated or "
                               "corrupt") from exc
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
    raise event_file_error(
        path,
        f"event {event} has label {label}, outside 0..{num_classes - 1} "
        f"(data.num_classes={num_classes}; point {row - int(offsets[event])} of the event, row {row})",
        "set data.num_classes (and model.num_classes) to cover every label, or use a file "
        f"written for {num_classes} classes",
    )


def describe(path: str | Path) -> dict:
    """Summary of an event file after `validate_event_file`: {path, num_events, num_points, seed,
    content_hash, class_counts}."""
    info = validate_event_file(path)
    counts = np.zeros(len(CLASS_NAMES), dtype=np.int64)
    try:
        with open_read(info["path"]) as f:
            seg = f["segment"]
            num_points = int(seg.shape[0])
            seed = int(f.attrs["seed"]) if "seed" in f.attrs else None
            for lo in range(0, num_points, _SCAN_ROWS):
                counts += np.bincount(seg[lo : lo + _SCAN_ROWS], minlength=len(CLASS_NAMES))[: len(CLASS_NAMES)]
    except H5_ERRORS as exc:
        raise event_file_error(Path(info["path"]), f"unreadable ({type(exc).__name__}: {exc})") from exc
    return {
        "path": info["path"],
        "num_events": info["num_events"],
        "num_points": num_points,
        "seed": seed,
        "content_hash": info["content_hash"],
        "class_counts": {name: int(c) for name, c in zip(CLASS_NAMES, counts)},
    }
