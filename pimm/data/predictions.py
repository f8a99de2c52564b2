"""Prediction files: one HDF5 file per evaluation, written by `pimm test` and `pimm predict`, read
by `pimm show` and by anything else that reads HDF5 (only the gzip and shuffle filters, which every
HDF5 library has).

Layout (format "pimm-predictions"):

- attributes: format, version, num_classes, class_names (JSON list), split, sources (JSON list of
  the data files the events came from), provenance (JSON object from the caller: weights sha256,
  config hash, world size, ...), has_labels, has_scores, has_instances, and `complete`, set last;
- per event, E rows sorted by event_id ascending (look an event up with np.searchsorted):
  `event_id` int64 (the dataset index pimm logs and `pimm show --event` takes), `source` int32
  (index into `sources`), `source_index` int64 (the event's index inside that source), and
  `offset` int64 (E+1): the points of event e are rows offset[e]:offset[e+1];
- per point, P rows, chunked and gzip-compressed: `pred` uint8, `point_index` int32 (the point's
  index among the source event's stored points, since a dataset's point cut may drop some),
  `coord` float32 (P, 3), `segment` int16 truth label (-1: ignored or unlabelled; absent for
  unlabelled data), optional `scores` float16 (P, C) softmax;
- with instances (a panoptic model's predictions), per point `instance` int32 (the predicted
  instance, ids 0..K-1 within an event, -1 none), `instance_score` float16 and, when labelled,
  `true_instance` int32 (-1: stuff); `pred` is then the instance's class (the stuff class on stuff
  points). One row per predicted instance in the group `instances`, rows grouped by event in the
  file's event order: `event_id` int64, `instance` int32, `class` int16, `score` float32, `size`
  int64 (its points), `momentum` float32 and `vertex` float32 (R, 3), NaN where unknown.

`version` is the oldest layout that reads the file whole: 1 without instances (as every file
before them), 2 with them, so a pimm that predates instances refuses such a file instead of
dropping its instances. This pimm reads both.

A writer fills `<path>.partial` and only `close()` moves it to `<path>`, after setting
complete=True, so a killed writer never leaves a file that looks complete. (That name is part of
the format: readers recognise an unfinished writer by it, so the writer keeps it rather than
`pimm.files.atomic_path`'s hidden name; h5py creates the file with 0666 & ~umask, which the
rename keeps, so the file's permissions follow the umask.) Each rank of a
multi-rank evaluation writes its own part; `merge_predictions` streams the parts into one file.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pimm.data.hdf5 import H5_ERRORS, open_read
from pimm.errors import DataError
from pimm.files import atomic_path

FORMAT = "pimm-predictions"
VERSION = 2  # the newest layout: 2 added the instance datasets (see the module docstring)
SEMANTIC_VERSION = 1  # what a file without instances says it is, so that a pimm before instances reads it
READABLE_VERSIONS = (1, 2)
INSTANCE_GROUP = "instances"
PARTIAL_SUFFIX = ".partial"
IGNORE_LABEL = -1
CHUNK_ROWS = 32768  # one event (~4,300 points) touches one or two chunks of each point dataset
# gzip level 1 after byte shuffle: the smallest files of gzip/lzf with or without shuffle on generated
# events (0.65 of raw) at ~2 M points/s, and readable by every HDF5 tool (lzf needs h5py)
_COMPRESSION = {"compression": "gzip", "compression_opts": 1, "shuffle": True}
_FLUSH_ROWS = 8 * CHUNK_ROWS  # the writer buffers this many points, then writes whole chunks
_WINDOW_ROWS = 1 << 20  # points per merge step: bounded memory (~20 MB plus scores)
_EVENT_DATASETS = ("event_id", "source", "source_index", "offset")
# name -> (dtype, trailing shape; "C" = num_classes)
_POINT_DATASETS = {
    "pred": (np.dtype("u1"), ()),
    "point_index": (np.dtype("<i4"), ()),
    "coord": (np.dtype("<f4"), (3,)),
    "segment": (np.dtype("<i2"), ()),
    "scores": (np.dtype("<f2"), ("C",)),
    "instance": (np.dtype("<i4"), ()),
    "instance_score": (np.dtype("<f2"), ()),
    "true_instance": (np.dtype("<i4"), ()),
}
# the per-instance table, datasets under INSTANCE_GROUP: name -> (dtype, trailing shape)
_INSTANCE_DATASETS = {
    "event_id": (np.dtype("<i8"), ()),
    "instance": (np.dtype("<i4"), ()),
    "class": (np.dtype("<i2"), ()),
    "score": (np.dtype("<f4"), ()),
    "size": (np.dtype("<i8"), ()),
    "momentum": (np.dtype("<f4"), ()),
    "vertex": (np.dtype("<f4"), (3,)),
}
_INSTANCE_CHUNK_ROWS = 4096
_TABLE_KEYS = ("instance", "class", "score", "size", "momentum", "vertex")  # instance_table's keys
_TABLE_REQUIRED = ("instance", "class", "score")
_EVENT_DTYPES = {"event_id": np.dtype("<i8"), "source": np.dtype("<i4"), "source_index": np.dtype("<i8"),
                 "offset": np.dtype("<i8")}


def partial_path(path: str | Path) -> Path:
    """Where the writer of `path` writes until it is closed."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL_SUFFIX)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _point_names(has_labels: bool, has_scores: bool, has_instances: bool) -> list[str]:
    """The point datasets of a file with these options, in _POINT_DATASETS order."""
    optional = {"segment": has_labels, "scores": has_scores, "instance": has_instances,
                "instance_score": has_instances, "true_instance": has_instances and has_labels}
    return [n for n in _POINT_DATASETS if optional.get(n, True)]


def _table_path(name: str) -> str:
    return f"{INSTANCE_GROUP}/{name}"


# ----------------------------------------------------------------------------- writing


def _create_file(path: Path, *, num_classes: int, class_names: list[str], split: str, sources: list[str],
                 has_labels: bool, has_scores: bool, provenance: dict[str, Any], has_instances: bool = False,
                 rows: int = 0, instance_rows: int = 0, compress: bool = True) -> h5py.File:
    """A new prediction file at `path` (header attributes, empty resizable point datasets of
    `rows` rows and, with instances, table datasets of `instance_rows` rows), not yet complete;
    `compress=False` for a rank's part, which the merge reads once."""
    f = h5py.File(path, "w", locking=False)  # a private partial file; HDF5 locks fail on some parallel file systems
    f.attrs.update({
        "format": FORMAT, "version": VERSION if has_instances else SEMANTIC_VERSION, "num_classes": int(num_classes),
        "class_names": json.dumps(list(class_names)), "split": str(split),
        "sources": json.dumps([str(s) for s in sources]), "provenance": json.dumps(provenance, sort_keys=True),
        "has_labels": bool(has_labels), "has_scores": bool(has_scores), "has_instances": bool(has_instances),
        "complete": False,
    })
    compression = _COMPRESSION if compress else {}
    for name in _point_names(has_labels, has_scores, has_instances):
        dtype, tail = _POINT_DATASETS[name]
        tail = tuple(num_classes if t == "C" else t for t in tail)
        f.create_dataset(name, shape=(rows, *tail), maxshape=(None, *tail), dtype=dtype,
                         chunks=(CHUNK_ROWS, *tail), **compression)
    if has_instances:
        for name, (dtype, tail) in _INSTANCE_DATASETS.items():
            f.create_dataset(_table_path(name), shape=(instance_rows, *tail), maxshape=(None, *tail), dtype=dtype,
                             chunks=(_INSTANCE_CHUNK_ROWS, *tail), **compression)
    return f


def _finish(f: h5py.File, events: dict[str, np.ndarray], tmp: Path, path: Path) -> None:
    """Write the per-event datasets, mark the file complete (last), close it and move it to `path`."""
    for name in _EVENT_DATASETS:
        f.create_dataset(name, data=np.asarray(events[name], dtype=_EVENT_DTYPES[name]))
    f.attrs["complete"] = True
    f.close()
    os.replace(tmp, path)


class PredictionWriter:
    """Writes one prediction file event by event (see the module docstring for the layout).

    `sources` are the data files the events come from (`add`'s `source` indexes them); `attrs`
    are JSON-able provenance (weights sha256, config hash, world size; `rank` and `world_size`
    let `merge_predictions` check that no rank's part is missing). Use as a context manager, or
    call `close()`: only then does `path` exist. Events may come in any order; a file whose
    events came unsorted is sorted once on close. `compress=False` writes a rank's part without
    gzip (a third of the writing time; the merged file is compressed). `has_instances=True` for a
    panoptic model: every `add` then gives the predicted instances and their table."""

    def __init__(self, path: str | Path, *, num_classes: int, class_names: list[str], split: str,
                 sources: list[str | Path], save_scores: bool = False, has_labels: bool = True,
                 attrs: dict[str, Any] | None = None, compress: bool = True, has_instances: bool = False) -> None:
        if not 1 <= int(num_classes) <= 256:
            raise ValueError(f"num_classes must be 1..256 (predictions are stored as uint8), got {num_classes}")
        if len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names {list(class_names)} for num_classes={num_classes}")
        self.path = Path(path)
        self.num_classes = int(num_classes)
        self.num_sources = len(sources)
        self.save_scores, self.has_labels = bool(save_scores), bool(has_labels)
        self.has_instances = bool(has_instances)
        self._tmp = partial_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _create_file(self._tmp, num_classes=num_classes, class_names=class_names, split=split,
                                  sources=[str(s) for s in sources], has_labels=has_labels, has_scores=save_scores,
                                  provenance=dict(attrs or {}), has_instances=has_instances, compress=compress)
        self._names = _point_names(self.has_labels, self.save_scores, self.has_instances)
        self._pending: dict[str, list[np.ndarray]] = {n: [] for n in self._names}
        self._pending_rows = self._written = 0
        self._table_pending: dict[str, list[np.ndarray]] = {n: [] for n in _INSTANCE_DATASETS}
        self._table_written = 0
        self._events: dict[str, list[int]] = {"event_id": [], "source": [], "source_index": [], "count": []}
        self._seen: set[int] = set()

    def __enter__(self) -> PredictionWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # a failed evaluation leaves no file, not even a partial one
            self.abort()

    def add(self, event_id: int, source: int, source_index: int, pred: np.ndarray, point_index: np.ndarray,
            coord: np.ndarray, segment: np.ndarray | None = None, scores: np.ndarray | None = None,
            instance: np.ndarray | None = None, instance_score: np.ndarray | None = None,
            true_instance: np.ndarray | None = None, instance_table: dict[str, Any] | None = None) -> None:
        """Add one event's points: pred (N,) classes, point_index (N,), coord (N, 3), segment (N,)
        truth (-1: ignored; required when has_labels), scores (N, C) (required when save_scores).
        With has_instances (all required then): instance (N,) predicted instance ids (-1 none),
        instance_score (N,), true_instance (N,) (-1 stuff; exactly when has_labels) and
        instance_table, the event's predicted instances, one entry per instance: "instance" (K,)
        ids, "class" (K,), "score" (K,), optional "size" (K,) (counted from `instance` when left
        out, checked against it when given), "momentum" (K,) and "vertex" (K, 3) (NaN when left out)."""
        event_id = int(event_id)
        if event_id in self._seen:
            raise DataError(f"event {event_id} was added twice to the predictions {self.path}")
        if not 0 <= int(source) < self.num_sources:
            raise ValueError(f"source {source} is not an index into the {self.num_sources} sources")
        pred = np.asarray(pred)
        n = len(pred)
        if pred.ndim != 1 or (n and (pred.min() < 0 or pred.max() >= self.num_classes)):
            raise ValueError(f"pred of event {event_id} must be (N,) classes 0..{self.num_classes - 1}")
        arrays = {"pred": pred, "point_index": np.asarray(point_index), "coord": np.asarray(coord)}
        if (segment is None) == self.has_labels:
            raise ValueError(f"segment must be given exactly when has_labels (has_labels={self.has_labels})")
        if (scores is None) == self.save_scores:
            raise ValueError(f"scores must be given exactly when save_scores (save_scores={self.save_scores})")
        if segment is not None:
            arrays["segment"] = np.asarray(segment)
        if scores is not None:
            arrays["scores"] = np.asarray(scores)
        self._instance_points(event_id, arrays, instance, instance_score, true_instance, instance_table)
        for name, a in arrays.items():
            want = (n, *(self.num_classes if t == "C" else t for t in _POINT_DATASETS[name][1]))
            if a.shape != want:
                raise ValueError(f"{name} of event {event_id} has shape {a.shape}, expected {want}")
        if self.has_instances:  # checked before anything is kept: a refused event leaves no trace
            for name, rows in self._table_rows(event_id, arrays["instance"], instance_table).items():
                self._table_pending[name].append(rows)
        for name, a in arrays.items():
            self._pending[name].append(a.astype(_POINT_DATASETS[name][0], copy=False))
        self._seen.add(event_id)
        for key, value in (("event_id", event_id), ("source", int(source)), ("source_index", int(source_index)),
                           ("count", n)):
            self._events[key].append(value)
        self._pending_rows += n
        if self._pending_rows >= _FLUSH_ROWS:
            self._flush()

    def _instance_points(self, event_id: int, arrays: dict[str, np.ndarray], instance: Any, instance_score: Any,
                         true_instance: Any, instance_table: dict[str, Any] | None) -> None:
        """Check which instance arguments `add` got and put the per-point ones into `arrays`;
        ValueError saying what is wrong."""
        given = {"instance": instance, "instance_score": instance_score, "instance_table": instance_table}
        if not self.has_instances:
            extra = [k for k, v in {**given, "true_instance": true_instance}.items() if v is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} given for event {event_id}, but this writer was made with "
                                 "has_instances=False; pass has_instances=True to PredictionWriter")
            return
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"event {event_id} lacks {', '.join(missing)}: a writer with has_instances=True "
                             "needs instance, instance_score and instance_table for every event")
        if (true_instance is None) == self.has_labels:
            raise ValueError(f"true_instance must be given exactly when has_labels (has_labels={self.has_labels})")
        arrays["instance"], arrays["instance_score"] = np.asarray(instance), np.asarray(instance_score)
        if true_instance is not None:
            arrays["true_instance"] = np.asarray(true_instance)
        for name in ("instance", "true_instance"):
            ids = arrays.get(name)
            if ids is not None and ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < -1):
                raise ValueError(f"{name} of event {event_id} must be integer ids >= 0 or -1 (none), got "
                                 f"{ids.dtype} values from {ids.min()}")

    def _table_rows(self, event_id: int, instance: np.ndarray, table: dict[str, Any]) -> dict[str, np.ndarray]:
        """The per-instance rows of one event, checked against its per-point `instance`."""
        unknown = sorted(set(table) - set(_TABLE_KEYS))
        missing = [k for k in _TABLE_REQUIRED if k not in table]
        if unknown or missing:
            raise ValueError(f"instance_table of event {event_id}: unknown keys {unknown}, missing {missing}; it "
                             f"takes {', '.join(_TABLE_KEYS)} ({', '.join(_TABLE_REQUIRED)} required)")
        ids = np.asarray(table["instance"])
        k = len(ids)
        if ids.ndim != 1 or (k and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0)):
            raise ValueError(f"instance_table['instance'] of event {event_id} must be (K,) integer ids >= 0")
        if len(np.unique(ids)) != k:
            raise ValueError(f"instance_table['instance'] of event {event_id} repeats an id: {ids.tolist()}")
        on_points = np.unique(instance[instance >= 0])
        unlisted = np.setdiff1d(on_points, ids)
        if len(unlisted):
            raise ValueError(f"event {event_id}: points of instance(s) {unlisted.tolist()} have no row in "
                             "instance_table; give a row for every instance id on a point")
        sizes = np.zeros(k, np.int64)
        if k:
            order = np.argsort(ids)
            sizes[order] = np.bincount(np.searchsorted(ids[order], instance[instance >= 0]), minlength=k)
        nan = np.full(k, np.nan, np.float32)
        rows = {"event_id": np.full(k, event_id, np.int64), "instance": ids, "class": np.asarray(table["class"]),
                "score": np.asarray(table["score"]), "size": np.asarray(table.get("size", sizes)),
                "momentum": np.asarray(table.get("momentum", nan)),
                "vertex": np.asarray(table.get("vertex", np.full((k, 3), np.nan, np.float32)))}
        for name, values in rows.items():
            want = (k, *_INSTANCE_DATASETS[name][1])
            if values.shape != want:
                raise ValueError(f"instance_table['{name}'] of event {event_id} has shape {values.shape}, "
                                 f"expected {want} like its 'instance'")
        if k and (rows["class"].min() < 0 or rows["class"].max() >= self.num_classes):
            raise ValueError(f"instance_table['class'] of event {event_id} must be classes 0..{self.num_classes - 1}, "
                             f"got {rows['class'].tolist()}")
        if not np.array_equal(rows["size"], sizes):
            raise ValueError(f"instance_table['size'] of event {event_id} is {rows['size'].tolist()}, but the points "
                             f"of those instances number {sizes.tolist()}; leave 'size' out to have it counted")
        return {name: values.astype(_INSTANCE_DATASETS[name][0], copy=False) for name, values in rows.items()}

    def _flush(self) -> None:
        self._flush_table()
        if not self._pending_rows:
            return
        for name in self._names:
            block = np.concatenate(self._pending[name])
            d = self._file[name]
            d.resize(self._written + len(block), axis=0)
            d[self._written :] = block
            self._pending[name] = []
        self._written += self._pending_rows
        self._pending_rows = 0

    def _flush_table(self) -> None:
        rows = sum(len(block) for block in self._table_pending["event_id"])
        for name in _INSTANCE_DATASETS:
            if rows:
                d = self._file[_table_path(name)]
                d.resize(self._table_written + rows, axis=0)
                d[self._table_written :] = np.concatenate(self._table_pending[name])
            self._table_pending[name] = []
        self._table_written += rows

    def close(self) -> Path:
        """Finish the file and move it into place; returns its path."""
        if self._file is None:
            return self.path
        self._flush()
        ids = np.asarray(self._events["event_id"], np.int64)
        counts = np.asarray(self._events["count"], np.int64)
        events = {"event_id": ids, "source": self._events["source"], "source_index": self._events["source_index"],
                  "offset": np.concatenate([[0], np.cumsum(counts)])}
        f, self._file = self._file, None
        if np.all(np.diff(ids) > 0):
            _finish(f, events, self._tmp, self.path)
            return self.path
        # unsorted: keep the rows as they came, then copy them in event_id order
        f.attrs["complete"] = False
        for name in _EVENT_DATASETS:
            f.create_dataset(name, data=np.asarray(events[name], dtype=_EVENT_DTYPES[name]))
        f.close()
        unsorted = self._tmp.with_name(self._tmp.name.removesuffix(PARTIAL_SUFFIX) + ".unsorted" + PARTIAL_SUFFIX)
        os.replace(self._tmp, unsorted)
        try:
            with _open(unsorted, require_complete=False) as preds:
                _merge_files([preds], self.path, preds.provenance)
        finally:
            unsorted.unlink(missing_ok=True)
        return self.path

    def abort(self) -> None:
        """Close and delete the partial file (the final path is left untouched)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- reading and checking


def _fail(path: Path, problem: str) -> DataError:
    return DataError(f"{path}: {problem}")


class Predictions:
    """An open, validated prediction file (`open_predictions`). Header facts as attributes;
    the per-event arrays (event_ids, source, source_index, offset and, with instances,
    instance_offset: the table rows of event e are instance_offset[e]:instance_offset[e+1]) are
    in memory."""

    def __init__(self, path: Path, f: h5py.File) -> None:
        self.path, self.file = path, f
        attrs = f.attrs
        self.num_classes = int(attrs["num_classes"])
        self.class_names: list[str] = json.loads(_text(attrs["class_names"]))
        self.split = _text(attrs["split"])
        self.sources: list[str] = json.loads(_text(attrs["sources"]))
        self.provenance: dict[str, Any] = json.loads(_text(attrs.get("provenance", "{}")))
        self.has_labels, self.has_scores, self.has_instances = "segment" in f, "scores" in f, "instance" in f
        self.event_ids = f["event_id"][:].astype(np.int64)
        self.source = f["source"][:].astype(np.int64)
        self.source_index = f["source_index"][:].astype(np.int64)
        self.offset = f["offset"][:].astype(np.int64)
        self.instance_offset = np.zeros(self.num_events + 1, np.int64)  # set by _check_instances

    @property
    def num_instances(self) -> int:
        """Rows of the per-instance table (0 without instances)."""
        return int(self.instance_offset[-1])

    @property
    def num_events(self) -> int:
        return len(self.event_ids)

    @property
    def num_points(self) -> int:
        return int(self.offset[-1])

    def header(self) -> dict[str, Any]:
        """What a file this one is merged with must share."""
        return {"num_classes": self.num_classes, "class_names": self.class_names, "split": self.split,
                "sources": self.sources, "has_labels": self.has_labels, "has_scores": self.has_scores,
                "has_instances": self.has_instances}

    def position(self, event_id: int) -> int:
        """The row of `event_id` in the per-event arrays; DataError when the file lacks it."""
        e = int(np.searchsorted(self.event_ids, event_id))
        if e == len(self.event_ids) or self.event_ids[e] != event_id:
            held = (f"ids {self.event_ids[0]}..{self.event_ids[-1]}" if self.num_events else "no ids")
            raise DataError(f"event {event_id} is not in {self.path} (it holds {self.num_events} events, {held})")
        return e

    def read_event(self, event_id: int) -> dict[str, Any]:
        """One event: {event_id, source (a path), source_index, pred, point_index, coord,
        segment (when labelled), scores (when saved)}, point arrays as stored; with instances also
        instance, instance_score, true_instance (when labelled) and instance_table, a dict of the
        event's table rows (instance, class, score, size, momentum, vertex)."""
        e = self.position(event_id)
        a, b = int(self.offset[e]), int(self.offset[e + 1])
        out: dict[str, Any] = {"event_id": int(event_id), "source": self.sources[int(self.source[e])],
                               "source_index": int(self.source_index[e])}
        try:
            for name in _POINT_DATASETS:
                if name in self.file:
                    out[name] = self.file[name][a:b]
            if self.has_instances:
                lo, hi = int(self.instance_offset[e]), int(self.instance_offset[e + 1])
                out["instance_table"] = {name: self.file[_table_path(name)][lo:hi] for name in _TABLE_KEYS}
        except H5_ERRORS as exc:
            raise _fail(self.path, f"event {event_id} (rows {a}:{b}) is unreadable: {exc}") from exc
        return out

    def labelled_points(self, rows: int = _WINDOW_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(truth, prediction) int64 arrays of every point in stored order, `rows` points at a time
        (bounded memory); DataError for a file without truth labels."""
        if not self.has_labels:
            raise _fail(self.path, "has no truth labels (written from unlabelled data); metrics need them")
        segment, pred = self.file["segment"], self.file["pred"]
        try:
            for lo in range(0, self.num_points, rows):
                yield segment[lo : lo + rows].astype(np.int64), pred[lo : lo + rows].astype(np.int64)
        except H5_ERRORS as exc:
            raise _fail(self.path, f"points {lo}.. are unreadable: {exc}") from exc

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Predictions:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_predictions(path: str | Path) -> bool:
    """Whether `path` is (or, by its partial file, was meant to be) a pimm prediction file."""
    path = Path(path)
    if not path.exists():
        return partial_path(path).exists()
    try:
        with open_read(path) as f:
            return _text(f.attrs.get("format", "")) == FORMAT
    except H5_ERRORS:
        return False


def open_predictions(path: str | Path) -> Predictions:
    """Open and validate a complete prediction file (format, version, complete, consistent
    lengths); DataError in one line saying what is wrong otherwise. Close it (or use `with`)."""
    return _open(Path(path), require_complete=True)


def _open(path: Path, require_complete: bool) -> Predictions:
    if not path.exists():
        if partial_path(path).exists():
            raise _fail(path, f"not a complete pimm predictions file (found {partial_path(path).name}: its writer "
                        "did not finish; run the evaluation again)")
        raise _fail(path, "no such file")
    if path.is_dir():
        raise _fail(path, "is a directory, not a pimm predictions file")
    try:
        f = open_read(path)
    except H5_ERRORS as exc:
        hint = " (a partial file whose writer did not finish?)" if path.name.endswith(PARTIAL_SUFFIX) else ""
        raise _fail(path, f"not a readable HDF5 file{hint}: {exc}") from exc
    try:
        preds = _check(path, f, require_complete)
    except DataError:
        f.close()
        raise
    except H5_ERRORS as exc:
        f.close()
        raise _fail(path, f"unreadable ({type(exc).__name__}: {exc}); the file is truncated or corrupt") from exc
    return preds


def _check(path: Path, f: h5py.File, require_complete: bool) -> Predictions:
    fmt = _text(f.attrs.get("format", ""))
    if fmt != FORMAT:
        raise _fail(path, f"not a pimm predictions file (format attribute {fmt!r}, expected {FORMAT!r})")
    version = int(f.attrs.get("version", -1))
    if version not in READABLE_VERSIONS:
        raise _fail(path, f"predictions format version {version} is not supported (this pimm reads versions "
                    f"{', '.join(map(str, READABLE_VERSIONS))}); read it with the pimm that wrote it or a newer one")
    if require_complete and not bool(f.attrs.get("complete", False)):
        raise _fail(path, "not a complete pimm predictions file (its writer did not finish; run the evaluation again)")
    needed = [*_EVENT_DATASETS, "pred", "point_index", "coord"]
    missing = [n for n in needed if n not in f]
    if missing:
        raise _fail(path, f"pimm predictions file without the datasets {missing}")
    num_classes = int(f.attrs["num_classes"])
    preds = Predictions(path, f)
    e, offset = preds.num_events, preds.offset
    for name in ("source", "source_index"):
        if f[name].shape != (e,):
            raise _fail(path, f"'{name}' has shape {f[name].shape}, expected ({e},) like 'event_id'")
    if len(offset) != e + 1 or offset[0] != 0 or np.any(np.diff(offset) < 0):
        raise _fail(path, f"'offset' has {len(offset)} entries starting at {offset[:1].tolist()}; expected {e + 1} "
                    "non-decreasing entries from 0")
    for name, (_, tail) in _POINT_DATASETS.items():
        if name in f:
            want = (preds.num_points, *(num_classes if t == "C" else t for t in tail))
            if f[name].shape != want:
                raise _fail(path, f"'{name}' has shape {f[name].shape}, expected {want} (offset[-1] = "
                            f"{preds.num_points} points)")
    if require_complete and np.any(np.diff(preds.event_ids) <= 0):
        raise _fail(path, "its event ids are not strictly ascending")
    if e and (preds.source.min() < 0 or preds.source.max() >= len(preds.sources)):
        raise _fail(path, f"'source' indexes outside its {len(preds.sources)} sources")
    _check_instances(preds)
    return preds


def _check_instances(preds: Predictions) -> None:
    """Check the instance datasets of an open file and set preds.instance_offset from the
    table's event ids (rows grouped by event, in the file's event order)."""
    f, path = preds.file, preds.path
    point_names = [n for n in ("instance", "instance_score", "true_instance") if n in f]
    if not preds.has_instances:
        if point_names or INSTANCE_GROUP in f:
            raise _fail(path, f"has instance datasets {point_names} without 'instance'; the file is corrupt")
        return
    expected = _point_names(preds.has_labels, preds.has_scores, True)
    missing = [n for n in expected if n not in f] + [_table_path(n) for n in _INSTANCE_DATASETS
                                                     if _table_path(n) not in f]
    if missing or ("true_instance" in f and not preds.has_labels):
        raise _fail(path, f"instance predictions without the datasets {missing or ['segment']}; the file is corrupt")
    table_ids = f[_table_path("event_id")][:]
    for name, (_, tail) in _INSTANCE_DATASETS.items():
        if f[_table_path(name)].shape != (len(table_ids), *tail):
            raise _fail(path, f"'{_table_path(name)}' has shape {f[_table_path(name)].shape}, expected "
                        f"{(len(table_ids), *tail)} like '{_table_path('event_id')}'")
    order = np.argsort(preds.event_ids, kind="stable")
    at = np.minimum(np.searchsorted(preds.event_ids[order], table_ids), max(preds.num_events - 1, 0))
    if len(table_ids) and (not preds.num_events or np.any(preds.event_ids[order][at] != table_ids)):
        raise _fail(path, f"'{_table_path('event_id')}' names events that are not in 'event_id'")
    event_row = order[at] if len(table_ids) else np.zeros(0, np.int64)
    if np.any(np.diff(event_row) < 0):
        raise _fail(path, f"the rows of '{INSTANCE_GROUP}' are not grouped by event in the order of 'event_id'")
    counts = np.bincount(event_row, minlength=preds.num_events)
    preds.instance_offset = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def read_event(path_or_handle: str | Path | Predictions, event_id: int) -> dict[str, Any]:
    """Event `event_id` of a prediction file (a path, or an open `Predictions`) as a dict
    (see `Predictions.read_event`); DataError when the file lacks it."""
    if isinstance(path_or_handle, Predictions):
        return path_or_handle.read_event(event_id)
    with open_predictions(path_or_handle) as preds:
        return preds.read_event(event_id)


INSTANCE_TABLE_COLUMNS = ("event_id", "source", "source_index", "instance", "class", "class_name", "score", "size",
                          "momentum", "vertex_x", "vertex_y", "vertex_z")


def instance_table_path(predictions_path: str | Path) -> Path:
    """Where `pimm predict` and `pimm test` put a prediction file's per-instance table: beside it,
    `<name>.instances.csv`."""
    return Path(predictions_path).with_suffix(".instances.csv")


def write_instance_table(predictions_path: str | Path, csv_path: str | Path) -> Path:
    """The per-instance table of a prediction file as CSV at `csv_path` (written whole or not at
    all): a header of INSTANCE_TABLE_COLUMNS, then one row per predicted instance in event order;
    `source` is the data file's path, unknown momentum and vertex are `nan` (pandas.read_csv reads
    the file as it is). DataError for a file without instances. Returns `csv_path`."""
    csv_path = Path(csv_path)
    with open_predictions(predictions_path) as preds:
        if not preds.has_instances:
            raise _fail(preds.path, "has no instance predictions (it was written by a model without instances); "
                        "a per-instance table needs the predictions of a Panoptic model")
        event_row = np.repeat(np.arange(preds.num_events), np.diff(preds.instance_offset))
        with atomic_path(csv_path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as stream:
            writer = csv.writer(stream)
            writer.writerow(INSTANCE_TABLE_COLUMNS)
            for lo in range(0, preds.num_instances, _WINDOW_ROWS):
                hi = min(lo + _WINDOW_ROWS, preds.num_instances)
                try:
                    table = {n: preds.file[_table_path(n)][lo:hi] for n in _INSTANCE_DATASETS}
                except H5_ERRORS as exc:
                    raise _fail(preds.path, f"instance rows {lo}:{hi} are unreadable: {exc}") from exc
                events = event_row[lo:hi]
                # str() of a float32 is its shortest exact text ('0.7', 'nan')
                writer.writerows(zip(
                    table["event_id"].tolist(), [preds.sources[s] for s in preds.source[events]],
                    preds.source_index[events].tolist(), table["instance"].tolist(), table["class"].tolist(),
                    [preds.class_names[c] for c in table["class"]], map(str, table["score"]), table["size"].tolist(),
                    map(str, table["momentum"]), *(map(str, table["vertex"][:, axis]) for axis in range(3))))
    return csv_path


# ----------------------------------------------------------------------------- merging


def merge_predictions(parts: list[Path], out: Path) -> Path:
    """Merge the prediction files of an evaluation's ranks (each sorted or not) into one file
    `out` sorted by event_id, streaming, written atomically like the writer's; then delete the
    parts. DataError for a missing or incomplete part, parts that disagree (classes, split,
    sources, provenance other than `rank`), a rank missing by their `rank`/`world_size`
    provenance, or an event in more than one part. Returns `out`."""
    parts = [Path(p) for p in parts]
    if not parts:
        raise DataError(f"no prediction parts to merge into {out}")
    opened: list[Predictions] = []
    try:
        for p in parts:
            if not p.exists():
                found = f" (found {partial_path(p).name}: that rank did not finish)" if partial_path(p).exists() else ""
                raise DataError(f"prediction part {p} is missing{found}; cannot merge into {out}")
            opened.append(open_predictions(p))
        _merge_files(opened, Path(out), _common_provenance(opened))
    finally:
        for preds in opened:
            preds.close()
    for p in parts:
        if p.resolve() != Path(out).resolve():
            p.unlink(missing_ok=True)
    return Path(out)


def _common_provenance(parts: list[Predictions]) -> dict[str, Any]:
    """The parts' shared provenance without `rank`; DataError when they disagree or a rank is missing."""
    first = parts[0]
    common = {k: v for k, v in first.provenance.items() if k != "rank"}
    for p in parts[1:]:
        if p.header() != first.header():
            diff = [k for k, v in p.header().items() if first.header()[k] != v]
            raise DataError(f"prediction parts {first.path} and {p.path} differ in {', '.join(diff)}; they are not "
                            "parts of one evaluation")
        other = {k: v for k, v in p.provenance.items() if k != "rank"}
        if other != common:
            diff = sorted(k for k in set(other) | set(common) if other.get(k) != common.get(k))
            raise DataError(f"prediction parts {first.path} and {p.path} differ in provenance {', '.join(diff)}; "
                            "they are not parts of one evaluation")
    ranks = [p.provenance.get("rank") for p in parts]
    world = common.get("world_size")
    if world is not None and all(r is not None for r in ranks) and sorted(ranks) != list(range(int(world))):
        missing = sorted(set(range(int(world))) - set(ranks))
        raise DataError(f"prediction parts hold ranks {sorted(ranks)} of world_size {world}"
                        f"{f'; rank(s) {missing} missing' if missing else ''}; pass every rank's part once")
    return common


def _merge_files(parts: list[Predictions], out: Path, provenance: dict[str, Any]) -> None:
    """Copy every event of `parts` into a new complete file `out`, sorted by event_id, `_WINDOW_ROWS`
    points at a time: each part is read in contiguous runs of events (one run per window when it
    is sorted), the window's rows gathered in memory and appended."""
    ids = np.concatenate([p.event_ids for p in parts])
    part_of = np.concatenate([np.full(p.num_events, i, np.int64) for i, p in enumerate(parts)])
    row_of = np.concatenate([np.arange(p.num_events, dtype=np.int64) for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, part_of, row_of = ids[order], part_of[order], row_of[order]
    dup = np.flatnonzero(np.diff(ids) == 0)
    if len(dup):
        a, b = parts[part_of[dup[0]]].path, parts[part_of[dup[0] + 1]].path
        where = f"both {a} and {b}" if a != b else f"{a} twice"
        raise DataError(f"event {ids[dup[0]]} is in {where} ({len(dup)} duplicated event(s)); cannot merge into {out}")
    offset = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(p.offset) for p in parts])[order])])
    table_offset = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(p.instance_offset) for p in parts])[order])])
    first = parts[0]
    tmp = partial_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    f = _create_file(tmp, num_classes=first.num_classes, class_names=first.class_names, split=first.split,
                     sources=first.sources, has_labels=first.has_labels, has_scores=first.has_scores,
                     provenance=provenance, has_instances=first.has_instances, rows=int(offset[-1]),
                     instance_rows=int(table_offset[-1]))
    try:
        names = _point_names(first.has_labels, first.has_scores, first.has_instances)
        table_names = [_table_path(n) for n in _INSTANCE_DATASETS] if first.has_instances else []
        for lo, hi in _windows(offset, _WINDOW_ROWS):
            # each dataset group with its own rows per event: points, and the instance table
            for datasets, rows, offsets in ((names, offset, [p.offset for p in parts]),
                                            (table_names, table_offset, [p.instance_offset for p in parts])):
                if not datasets or rows[hi] == rows[lo]:
                    continue  # events without points (or without instances)
                block = _gather(parts, offsets, part_of[lo:hi], row_of[lo:hi], datasets)
                for name in datasets:
                    f[name][rows[lo] : rows[hi]] = block[name]
        sources = np.concatenate([p.source for p in parts])[order]
        source_index = np.concatenate([p.source_index for p in parts])[order]
        _finish(f, {"event_id": ids, "source": sources, "source_index": source_index, "offset": offset}, tmp, out)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def _windows(offset: np.ndarray, rows: int) -> Iterable[tuple[int, int]]:
    """(lo, hi) event ranges of about `rows` points each (at least one event)."""
    lo, n = 0, len(offset) - 1
    while lo < n:
        hi = max(int(np.searchsorted(offset, offset[lo] + rows, side="right")) - 1, lo + 1)
        yield lo, min(hi, n)
        lo = min(hi, n)


def _gather(parts: list[Predictions], offsets: list[np.ndarray], part_of: np.ndarray, row_of: np.ndarray,
            names: list[str]) -> dict:
    """The rows of events (part_of[i], row_of[i]), in that order, as one array per dataset; the
    rows of event e of part k are offsets[k][e]:offsets[k][e+1] in each dataset of `names`."""
    buffers: dict[str, list[np.ndarray]] = {n: [] for n in names}
    start_in_buffer = np.zeros(len(part_of), np.int64)
    base = 0
    for k, p in enumerate(parts):
        mine = np.flatnonzero(part_of == k)
        if not len(mine):
            continue
        rows = row_of[mine]
        by_row = np.argsort(rows, kind="stable")
        rows_sorted = rows[by_row]
        # contiguous runs of event rows: one read each (a sorted part gives one run per window)
        breaks = np.flatnonzero(np.diff(rows_sorted) != 1) + 1
        for run in np.split(rows_sorted, breaks):
            a, b = int(offsets[k][run[0]]), int(offsets[k][run[-1] + 1])
            for n in names:
                buffers[n].append(p.file[n][a:b])
        lengths = offsets[k][rows_sorted + 1] - offsets[k][rows_sorted]
        starts = base + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        start_in_buffer[mine[by_row]] = starts
        base += int(lengths.sum())
    lengths = np.array([offsets[k][r + 1] - offsets[k][r] for k, r in zip(part_of, row_of)], np.int64)
    # row j of the window's output comes from buffer row start_in_buffer[event] + (j - event's output start)
    index = np.repeat(start_in_buffer - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(
        int(lengths.sum()))
    return {n: np.concatenate(buffers[n])[index] for n in names}
