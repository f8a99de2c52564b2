"""The PILArNet-M file layout: finding shards, a cached per-file event index, torch-free checks.

Layout, as DeepLearnPhysics/PILArNet-M publishes it: shards `<root>/*<split>/*.h5`, each holding
one row per event in the variable-length datasets `point` (N*8 values per row: x, y, z, deposited
energy, then 4 more columns) and `cluster` (K*5 values in revision v1: size, fragment, group,
interaction, semantic; K*6 in v2/v3: size, cluster_id, group_id, interaction_id, semantic, pid),
and in v2/v3 `cluster_extra` (K*5 values in v2, K*6 in v3, which is how `detect_revision` tells
them apart: mass, momentum, vertex x, y, z[, is_primary]; read for instance targets only). Points
are stored cluster by cluster, so a point's labels are its cluster's, repeated `size` times.
Label -1 means "no label"; the first cluster holds the event's
low-energy scatters (semantic 4, pid -1, which the published v2/v3 readers map to pid class 5
"none": `pid_unlabelled_as_none`, on by default).

The point cut (`kept_points`) is the published reader's: points with deposited energy at or below
`energy_threshold` are dropped (0: none), and with `remove_low_energy_scatters` the first cluster
when it is the low-energy-scatter cluster. `min_points` counts the stored points, as the published
readers do (`min_points_after_cut=True`: the points that survive the cut); an event with no point
left after the cut is always out.

Events with a non-finite x, y, z or energy are found by the same index pass: the launch refuses
them (naming shard, event and column) unless `skip_nonfinite` leaves them out.

Shards are written by `write_pilarnet_file` (pimm's generator, `pimm.data.synth.write_pilarnet`,
writes through it and marks its shards with a `generator` attribute; published shards have none)
and read by the torch reader `pimm.data.dataset.PILArNetDataset`; both take the layout's constants
from here. The launcher calls `open_pilarnet` (via `pimm.data.event_file.validate_data`) before
any process starts.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pimm import names
from pimm.data import index_cache
from pimm.data.hdf5 import H5_ERRORS, open_read
from pimm.data.index_cache import CHECKED_COLUMNS, NONFINITE_TODO
from pimm.errors import ConfigError, DataError
from pimm.files import atomic_path

LAYOUT = "pilarnet"
POINT_COLUMNS = 8  # x, y, z, energy, time, electrons, dx, and one more
VOLUME_SIZE = 768.0  # voxels along each side of the cube the coordinates fill
CLUSTER_COLUMNS = {"v1": 5, "v2": 6, "v3": 6}
EXTRA_COLUMNS = {"v2": 5, "v3": 6}  # cluster_extra per cluster: v2 mass, momentum, vertex x/y/z; v3 adds is_primary
REVISIONS = names.PILARNET_REVISIONS  # the keys of CLUSTER_COLUMNS
SIZE_COLUMN = 0
LABEL_COLUMNS = {"motif": 4, "pid": 5}  # semantic and pid columns of a cluster row (pid: v2/v3 only)
MOTIF_NAMES = ("shower", "track", "michel", "delta", "low_energy")
PID_NAMES = ("photon", "electron", "muon", "pion", "proton", "none")
LABEL_NAMES = {"motif": MOTIF_NAMES, "pid": PID_NAMES}
IGNORE_LABEL = -1
DEFAULT_SPLIT, DEFAULT_REVISION, DEFAULT_LABEL = "train", "v2", "motif"
PID_UNLABELLED_AS_NONE = True  # pid -1 -> class 5 "none", as the published v2/v3 readers do
MIN_POINTS_AFTER_CUT = False  # min_points counts stored points, as the published readers do
INDEX_VERSION = 3  # 2: per-cut kept-point counts; no total energy. 3: events with non-finite values
DATASET_NAMES = ("point", "cluster")  # required; cluster_extra is optional

_FINGERPRINT_BYTES = 1 << 20  # a shard's identity: its size and sha256 of its first and last MiB
_SCAN_EVENTS = 256  # events per read while indexing: bounded memory, few HDF5 calls
_INDEX_KEYS = ("num_points", "label_min", "label_max", "label_counts", "cut_keys", "cut_counts", "nonfinite_rows",
               "nonfinite_columns", "nonfinite_values")
NO_CUT = (0.0, False)  # (energy_threshold, remove_low_energy_scatters): every stored point kept


def synth_pilarnet_command(path: str | Path = "DIR") -> str:
    """The CLI command that writes synthetic PILArNet-layout shards, for error messages."""
    return f"`pimm data synth --layout pilarnet --out {path} --events N --seed S`"


def _fail(path: Path, problem: str, todo: str | None = None) -> DataError:
    return DataError(f"PILArNet file {path}: {problem}; {todo or 'check the file or download it again'}")


# ----------------------------------------------------------------------------- options and shards


def check_options(revision: str, label: str, min_points: int, energy_threshold: float,
                  remove_low_energy_scatters: bool = False, min_points_after_cut: bool = MIN_POINTS_AFTER_CUT,
                  pid_unlabelled_as_none: bool = PID_UNLABELLED_AS_NONE) -> None:
    """ConfigError for a selection option PILArNetDataset cannot use."""
    if revision not in REVISIONS:
        raise ConfigError(f"PILArNetDataset revision={revision!r} is unknown; use one of {', '.join(REVISIONS)}")
    if label not in LABEL_NAMES:
        raise ConfigError(f"PILArNetDataset label={label!r} is unknown; use 'motif' (5 semantic classes) or 'pid'")
    if label == "pid" and CLUSTER_COLUMNS[revision] <= LABEL_COLUMNS["pid"]:
        raise ConfigError(f"PILArNetDataset label='pid' needs revision v2 or v3: revision {revision} clusters have "
                          "no pid column; use label='motif' or v2/v3 files")
    if isinstance(min_points, bool) or not isinstance(min_points, (int, np.integer)) or min_points < 0:
        raise ConfigError(f"PILArNetDataset min_points must be an integer >= 0, got {min_points!r}")
    bad = isinstance(energy_threshold, bool) or not isinstance(energy_threshold, (int, float))
    if bad or not math.isfinite(energy_threshold) or energy_threshold < 0:
        raise ConfigError(f"PILArNetDataset energy_threshold must be a finite number >= 0 (MeV; points at or "
                          f"below it are dropped), got {energy_threshold!r}")
    for name, value in (("remove_low_energy_scatters", remove_low_energy_scatters),
                        ("min_points_after_cut", min_points_after_cut),
                        ("pid_unlabelled_as_none", pid_unlabelled_as_none)):
        if not isinstance(value, (bool, np.bool_)):
            raise ConfigError(f"PILArNetDataset {name} must be true or false, got {value!r}")


def find_shards(path: str | Path, split: str = DEFAULT_SPLIT) -> tuple[Path, list[Path]]:
    """(root, sorted shard files) for `path`: one .h5 file, `<path>/*<split>/*.h5`, or `<path>/*.h5`."""
    given = Path(path)
    root = given.absolute()
    if root.is_file():
        return root, [root]
    if not root.exists():
        where = "" if given.is_absolute() else f" (relative to the current directory {Path.cwd()})"
        raise _fail(root, f"no such file or directory{where}",
                    f"point data.<split>.path at PILArNet-M shards, or write some with {synth_pilarnet_command()}")
    shards = sorted(p for p in root.glob(f"*{split}/*.h5") if p.is_file())
    if not shards:
        shards = sorted(p for p in root.glob("*.h5") if p.is_file())
    if not shards:
        raise _fail(root, f"no shards: neither {root}/*{split}/*.h5 nor {root}/*.h5 exists",
                    f"check the path and split={split!r} (the published layout is <root>/<...>{split}/*.h5)")
    return root, shards


# ----------------------------------------------------------------------------- events


def event_arrays(path: Path, row: int, point_row: np.ndarray, cluster_row: np.ndarray,
                 revision: str) -> tuple[np.ndarray, np.ndarray]:
    """One stored event -> points (N, 8) and clusters (K, 5|6) int64, checking that the cluster
    sizes cover the points exactly; DataError naming the file and event otherwise."""
    columns = CLUSTER_COLUMNS[revision]
    if point_row.size % POINT_COLUMNS:
        raise _fail(path, f"event {row}: its 'point' row has {point_row.size} values, not a multiple of "
                    f"{POINT_COLUMNS} (x, y, z, energy and 4 more per point)")
    if cluster_row.size % columns:
        other = [r for r, c in CLUSTER_COLUMNS.items() if c != columns and cluster_row.size % c == 0]
        hint = f"; is it revision {other[0]}?" if other else ""
        raise _fail(path, f"event {row}: its 'cluster' row has {cluster_row.size} values, not a multiple of "
                    f"{columns} (revision {revision}){hint}", "set data.<split>.revision to the files' revision")
    points = point_row.reshape(-1, POINT_COLUMNS)
    clusters = cluster_row.reshape(-1, columns).astype(np.int64)
    sizes = clusters[:, SIZE_COLUMN]
    if np.any(sizes < 0):
        k = int(np.flatnonzero(sizes < 0)[0])
        raise _fail(path, f"event {row}: cluster {k} has size {int(sizes[k])}; a cluster's size is its number of "
                    "points and cannot be negative", "the labels cannot be assigned; fix the file")
    if int(sizes.sum()) != len(points):
        raise _fail(path, f"event {row}: cluster sizes sum to {int(sizes.sum())} (over {len(sizes)} clusters) but "
                    f"the event has {len(points)} points; they must be equal",
                    "the labels cannot be assigned; fix the file")
    return points, clusters


def kept_points(points: np.ndarray, clusters: np.ndarray, cut: tuple[float, bool]) -> np.ndarray | None:
    """Which points of one event survive `cut` = (energy_threshold, remove_low_energy_scatters):
    a bool mask (N,), or None when every point is kept. The index and the reader both use this."""
    threshold, drop_scatters = cut
    keep = points[:, 3] > threshold if threshold > 0 else None
    if drop_scatters and len(clusters) and clusters[0, LABEL_COLUMNS["motif"]] == MOTIF_NAMES.index("low_energy"):
        if keep is None:
            keep = np.ones(len(points), bool)
        keep[: clusters[0, SIZE_COLUMN]] = False
    return keep


def _kept_count(points: np.ndarray, clusters: np.ndarray, cut: tuple[float, bool]) -> int:
    keep = kept_points(points, clusters, cut)
    return len(points) if keep is None else int(keep.sum())


INSTANCE_COLUMNS = {"particle": 2, "interaction": 3}  # group id, interaction id of a cluster row (every revision)
EXTRA_MOMENTUM, EXTRA_VERTEX = 1, slice(2, 5)  # cluster_extra columns (v2/v3)


def dense_instances(ids: np.ndarray) -> np.ndarray:
    """Per-point instance ids -> 0..K-1 in the order of the ids (int64), -1 where an id is negative
    (stuff: the low-energy deposits, points of no particle or interaction)."""
    out = np.full(len(ids), -1, np.int64)
    thing = ids >= 0
    out[thing] = np.unique(ids[thing], return_inverse=True)[1].reshape(-1)
    return out


def instance_targets(clusters: np.ndarray, extra: np.ndarray | None, keep: np.ndarray | None,
                     pid_unlabelled_as_none: bool) -> dict[str, np.ndarray]:
    """The per-point instance targets of one event's kept points (`keep`: kept_points' mask, None: all):
    particle and interaction (dense_instances of the group and interaction ids among the kept points),
    pid (v2/v3: the cluster's pid, -1 as PID class "none" when `pid_unlabelled_as_none`), and with
    cluster_extra (v2/v3) momentum (MeV, the cluster's) and vertex (x, y, z, the cluster's)."""
    sizes = clusters[:, SIZE_COLUMN]

    def per_point(values: np.ndarray) -> np.ndarray:
        repeated = np.repeat(values, sizes, axis=0)
        return repeated if keep is None else repeated[keep]

    out = {name: dense_instances(per_point(clusters[:, col])) for name, col in INSTANCE_COLUMNS.items()}
    if clusters.shape[1] > LABEL_COLUMNS["pid"]:
        pid = per_point(clusters[:, LABEL_COLUMNS["pid"]])
        if pid_unlabelled_as_none:
            pid = np.where(pid == IGNORE_LABEL, PID_NAMES.index("none"), pid)
        out["pid"] = pid.astype(np.int64)
    if extra is not None:
        out["momentum"] = per_point(extra[:, EXTRA_MOMENTUM]).astype(np.float32)
        out["vertex"] = per_point(extra[:, EXTRA_VERTEX]).astype(np.float32)
    return out


def extra_arrays(path: Path, row: int, extra_row: np.ndarray, revision: str, clusters: int) -> np.ndarray:
    """One event's cluster_extra row -> (K, 5|6) float32, one row per cluster; DataError otherwise."""
    columns = EXTRA_COLUMNS[revision]
    if extra_row.size != clusters * columns:
        raise _fail(path, f"event {row}: its 'cluster_extra' row has {extra_row.size} values for {clusters} "
                    f"clusters; revision {revision} has {columns} per cluster",
                    "set data.<split>.revision to the files' revision")
    return extra_row.reshape(clusters, columns).astype(np.float32)


def point_labels(clusters: np.ndarray, label: str) -> np.ndarray:
    """Per-point labels (N,) int64: each cluster's `label` column repeated over its points."""
    return np.repeat(clusters[:, LABEL_COLUMNS[label]], clusters[:, SIZE_COLUMN])


def write_pilarnet_file(path: str | Path, events: list[dict[str, np.ndarray]],
                        point_dtype: np.dtype | type = np.float32, cluster_dtype: np.dtype | type = np.int64,
                        attrs: dict[str, Any] | None = None) -> Path:
    """Write events ({"point": (N, 8), "cluster": (K, 5|6)[, "cluster_extra": (K, 5|6)]}) as one shard:
    one variable-length row per event in `point`, `cluster` (and `cluster_extra` when every event
    has one), `attrs` as the file's attributes. The file appears complete in one rename with the
    permissions the umask gives (`pimm.files.atomic_path`), or not at all. Returns the path; OSError
    when it cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets = [*DATASET_NAMES, *(["cluster_extra"] if all("cluster_extra" in e for e in events) else [])]
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        for name in datasets:
            dtype = np.dtype({"point": point_dtype, "cluster": cluster_dtype}.get(name, np.float32))
            d = f.create_dataset(name, shape=(len(events),), dtype=h5py.vlen_dtype(dtype))
            for i, event in enumerate(events):
                d[i] = np.asarray(event[name], dtype=dtype).ravel()
        f.attrs.update(attrs or {})
    return path


# ----------------------------------------------------------------------------- the per-file index


def _vlen_datasets(f: h5py.File, path: Path) -> tuple[h5py.Dataset, h5py.Dataset]:
    """The file's `point` and `cluster` datasets, checked to be 1-D numeric vlen with one row per event."""
    for name in DATASET_NAMES:
        d = f.get(name)
        if not isinstance(d, h5py.Dataset):
            raise _fail(path, f"dataset '{name}' is missing (found {sorted(f.keys())})",
                        "is this a PILArNet-M shard? pimm's own event files are read by type='LArTPCDataset'")
        base = h5py.check_vlen_dtype(d.dtype)
        if d.ndim != 1 or base is None or base.kind not in "iuf":
            raise _fail(path, f"dataset '{name}' has shape {d.shape} and dtype {d.dtype}, expected one "
                        "variable-length numeric row per event (shape (E,))")
    point, cluster = f["point"], f["cluster"]
    if len(point) != len(cluster):
        raise _fail(path, f"'point' has {len(point)} rows but 'cluster' has {len(cluster)}; one row per event each")
    return point, cluster


def _blocks(point_ds: h5py.Dataset, cluster_ds: h5py.Dataset):
    """(first row, point rows, cluster rows) of an open shard in blocks of _SCAN_EVENTS events:
    bounded memory, few HDF5 calls."""
    for lo in range(0, len(point_ds), _SCAN_EVENTS):
        yield lo, point_ds[lo : lo + _SCAN_EVENTS], cluster_ds[lo : lo + _SCAN_EVENTS]


def _block_events(path: Path, lo: int, point_rows, cluster_rows, revision: str):
    """(row, points (N, 8), clusters (K, 5|6)) of every event of a block, checked."""
    for row, (point_row, cluster_row) in enumerate(zip(point_rows, cluster_rows), start=lo):
        yield (row, *event_arrays(path, row, point_row, cluster_row, revision))


def _stored_events(path: Path, point_ds: h5py.Dataset, cluster_ds: h5py.Dataset, revision: str):
    """(row, points (N, 8), clusters (K, 5|6)) of every event of an open shard, checked."""
    for lo, point_rows, cluster_rows in _blocks(point_ds, cluster_ds):
        yield from _block_events(path, lo, point_rows, cluster_rows, revision)


def _nonfinite_points(lo: int, point_rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, columns, values) of the first non-finite value in CHECKED_COLUMNS of every event of a
    block that has one. A NaN or inf makes its event's sum non-finite: summing each event's values
    (3 ns/point) clears a clean block; only a block with one is searched value by value."""
    none = np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0, np.float64)
    if not len(point_rows) or point_rows[0].dtype.kind != "f":
        return none  # integers are always finite
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow only costs the search
        if math.isfinite(sum(float(r.sum()) for r in point_rows)):
            return none
    lengths = np.fromiter((r.size for r in point_rows), np.int64, len(point_rows))
    flat = np.concatenate(list(point_rows))
    where = np.flatnonzero(~np.isfinite(flat))
    if not where.size:
        return none
    ends = np.cumsum(lengths)
    event = np.searchsorted(ends, where, side="right")
    column = (where - (ends - lengths)[event]) % POINT_COLUMNS
    checked = column < len(CHECKED_COLUMNS)
    where, event, column = where[checked], event[checked], column[checked]
    event, first = np.unique(event, return_index=True)  # `where` is sorted: the first value of each event
    return event + lo, column[first].astype(np.int8), flat[where[first]].astype(np.float64)


def _scan(path: Path, revision: str, cuts: list[tuple[float, bool]]) -> dict[str, np.ndarray]:
    """Read every event once: per-event point count, range of each label and points kept by each
    of `cuts`; per-file point counts of each label value (-1, 0.., and 'out of range' last); the
    events with a non-finite coordinate or energy (row, CHECKED_COLUMNS index and value of the first)."""
    bins = len(PID_NAMES) + 2
    with open_read(path) as f:
        point_ds, cluster_ds = _vlen_datasets(f, path)
        n = len(point_ds)
        num_points, cut_counts = np.zeros(n, np.int64), np.zeros((len(cuts), n), np.int64)
        label_min = np.full((len(LABEL_COLUMNS), n), IGNORE_LABEL, np.int64)
        label_max = label_min.copy()
        counts = np.zeros((len(LABEL_COLUMNS), bins), np.int64)
        present = [(i, col) for i, col in enumerate(LABEL_COLUMNS.values()) if col < CLUSTER_COLUMNS[revision]]
        nonfinite = []
        for lo, point_rows, cluster_rows in _blocks(point_ds, cluster_ds):
            nonfinite.append(_nonfinite_points(lo, point_rows))
            for row, points, clusters in _block_events(path, lo, point_rows, cluster_rows, revision):
                num_points[row] = len(points)
                for c, cut in enumerate(cuts):
                    cut_counts[c, row] = _kept_count(points, clusters, cut)
                sizes = clusters[:, SIZE_COLUMN]
                for i, col in present:
                    values = clusters[:, col]
                    if len(values):
                        label_min[i, row], label_max[i, row] = values.min(), values.max()
                    counts[i] += np.bincount(np.clip(values + 1, 0, bins - 1), weights=sizes,
                                             minlength=bins).astype(np.int64)
    rows, columns, values = (np.concatenate(a) for a in zip(*nonfinite)) if nonfinite else (
        np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0, np.float64))
    return {"num_points": num_points, "label_min": label_min, "label_max": label_max, "label_counts": counts,
            "cut_keys": np.array(cuts, np.float64).reshape(-1, 2), "cut_counts": cut_counts,
            "nonfinite_rows": rows, "nonfinite_columns": columns, "nonfinite_values": values}


def _fingerprint(path: Path, size: int) -> str:
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            fh.seek(max(size - _FINGERPRINT_BYTES, _FINGERPRINT_BYTES))
            h.update(fh.read())
    return h.hexdigest()


def _count_kept(path: Path, revision: str, cut: tuple[float, bool]) -> np.ndarray:
    """Points each event keeps under `cut`: one more pass over the shard, for a cut not yet indexed."""
    with open_read(path) as f:
        point_ds, cluster_ds = _vlen_datasets(f, path)
        counts = np.zeros(len(point_ds), np.int64)
        for row, points, clusters in _stored_events(path, point_ds, cluster_ds, revision):
            counts[row] = _kept_count(points, clusters, cut)
    return counts


def _load_index(shard: Path, stamp: np.ndarray, revision: str) -> dict[str, Any] | None:
    cached = index_cache.load_arrays(shard, ("stamp", "revision", "fingerprint", *_INDEX_KEYS))
    if cached is None or not np.array_equal(cached["stamp"], stamp) or str(cached["revision"]) != revision:
        return None
    return {**{k: cached[k] for k in _INDEX_KEYS}, "fingerprint": str(cached["fingerprint"])}


def _store_index(shard: Path, key: tuple, stamp: np.ndarray, revision: str, index: dict[str, Any]) -> None:
    index_cache.store(shard, key, {"stamp": stamp, "revision": np.array(revision),
                                   "fingerprint": np.array(index["fingerprint"]),
                                   **{k: index[k] for k in _INDEX_KEYS}}, index)


def shard_index(shard: Path, revision: str, cut: tuple[float, bool] = NO_CUT) -> dict[str, Any]:
    """The event index of one shard: {num_points, num_kept (points each event keeps under `cut`),
    label_min, label_max, label_counts, fingerprint, ...}. Read from `<shard>.pimm-index.npz` when
    that matches the shard's size and mtime; else built by reading the shard once and written there
    atomically (kept in memory, with one warning, where the directory is read-only). A cut the
    cache has no counts for costs one more pass over the shard, then is cached too."""
    try:
        st = shard.stat()
    except OSError as exc:
        raise _fail(shard, f"cannot be read: {exc}") from exc
    stamp = np.array([INDEX_VERSION, st.st_size, st.st_mtime_ns], np.int64)
    key = (str(shard), revision, *stamp.tolist())
    cut = (float(cut[0]), bool(cut[1]))
    index = index_cache.in_memory(key) or _load_index(shard, stamp, revision)
    try:
        if index is None:
            index = {**_scan(shard, revision, [cut]), "fingerprint": _fingerprint(shard, st.st_size)}
        elif cut != NO_CUT and _cut_row(index, cut) is None:
            index = {**index, "cut_keys": np.concatenate([index["cut_keys"], [[cut[0], float(cut[1])]]]),
                     "cut_counts": np.concatenate([index["cut_counts"], [_count_kept(shard, revision, cut)]])}
        else:
            return _with_kept(index, cut)
    except DataError:
        raise
    except H5_ERRORS as exc:
        raise _fail(shard, f"unreadable ({type(exc).__name__}: {exc}); the file is truncated or corrupt") from exc
    if shard.stat().st_mtime_ns != st.st_mtime_ns:
        raise _fail(shard, "changed while it was being indexed", "wait until it is completely written")
    _store_index(shard, key, stamp, revision, index)
    return _with_kept(index, cut)


def _cut_row(index: dict[str, Any], cut: tuple[float, bool]) -> int | None:
    """The row of `cut` in the index's cut_keys (stored as floats), or None when not indexed yet."""
    rows = [r for r, (threshold, drop) in enumerate(index["cut_keys"].tolist()) if (threshold, bool(drop)) == cut]
    return rows[0] if rows else None


def _with_kept(index: dict[str, Any], cut: tuple[float, bool]) -> dict[str, Any]:
    kept = index["num_points"] if cut == NO_CUT else index["cut_counts"][_cut_row(index, cut)]
    return {**index, "num_kept": kept}


# ----------------------------------------------------------------------------- a selection of events


def open_pilarnet(
    path: str | Path,
    split: str = DEFAULT_SPLIT,
    revision: str = DEFAULT_REVISION,
    label: str = DEFAULT_LABEL,
    min_points: int = 0,
    energy_threshold: float = 0.0,
    num_classes: int | None = None,
    ignore_index: int = IGNORE_LABEL,
    remove_low_energy_scatters: bool = False,
    skip_nonfinite: bool = False,
    min_points_after_cut: bool = MIN_POINTS_AFTER_CUT,
    pid_unlabelled_as_none: bool = PID_UNLABELLED_AS_NONE,
) -> tuple[dict[str, Any], list[Path], list[np.ndarray]]:
    """Check PILArNet shards and select their events -> (info, shards, rows).

    Events with fewer than `min_points` stored points (with `min_points_after_cut`: points left after
    the point cut) or with no point left after the cut (`kept_points`: energy at or below
    `energy_threshold` MeV, and the low-energy scatters with `remove_low_energy_scatters`) are out;
    `rows[i]` holds the selected row numbers of `shards[i]`. Labels of `label` must be in
    0..classes-1 (`num_classes`, when given, else the label's own class count) or -1, the format's
    "no label", which `ignore_index` must then be (pid -1 with `pid_unlabelled_as_none` is class
    "none", so it is a class, not a missing label).
    An event with a non-finite coordinate or energy is a DataError, or with `skip_nonfinite` is
    out too (counted in info's nonfinite_dropped).
    `info` is {path, size_bytes, num_events, content_hash, layout, revision, label, split, shards,
    events_in_files, min_points, energy_threshold, remove_low_energy_scatters, skip_nonfinite,
    nonfinite_dropped}; its content_hash covers every shard and the selection (with the dropped
    events, when there are any). Raises ConfigError or DataError."""
    check_options(revision, label, min_points, energy_threshold, remove_low_energy_scatters, min_points_after_cut,
                  pid_unlabelled_as_none)
    cut = (float(energy_threshold), bool(remove_low_energy_scatters))
    minus_one_is_none = label == "pid" and bool(pid_unlabelled_as_none)
    root, shards = find_shards(path, split)
    limit = len(LABEL_NAMES[label]) if num_classes is None else int(num_classes)
    label_row = list(LABEL_COLUMNS).index(label)
    rows, identity, size_bytes, events_in_files, dropped = [], [], 0, 0, {}
    for shard in shards:
        index = shard_index(shard, revision, cut)
        lo, hi = index["label_min"][label_row], index["label_max"][label_row]
        unlabelled = np.flatnonzero(lo == IGNORE_LABEL)
        if ignore_index != IGNORE_LABEL and len(unlabelled) and not minus_one_is_none:
            raise _fail(shard, f"event {int(unlabelled[0])} has points with {label} label -1 (no label), which "
                        f"task.ignore_index={ignore_index} does not ignore; {len(unlabelled)} event(s) of this file "
                        "have such points", "set task.ignore_index=-1 (the default)")
        bad = np.flatnonzero((lo < IGNORE_LABEL) | (hi >= limit))
        if len(bad):
            e = int(bad[0])
            value = int(hi[e]) if hi[e] >= limit else int(lo[e])
            classes = LABEL_NAMES[label]
            todo = (f"set data.num_classes (and model.num_classes) to {len(classes)} for the {label} classes "
                    f"({', '.join(classes)})" if 0 <= value < len(classes) else
                    f"PILArNet {label} labels are 0..{len(classes) - 1} ({', '.join(classes)}) or -1: check "
                    "data.<split>.label and revision, or the file")
            raise _fail(shard, f"event {e} has {label} label {value}, outside 0..{limit - 1} or -1 (ignore)"
                        f"{f' (data.num_classes={num_classes})' if num_classes is not None else ''}; "
                        f"{len(bad)} event(s) of this file are affected", todo)
        name = shard.name if shard == root else str(shard.relative_to(root))
        bad = index["nonfinite_rows"]
        if len(bad) and not skip_nonfinite:
            column = CHECKED_COLUMNS[int(index["nonfinite_columns"][0])]
            value = float(index["nonfinite_values"][0])
            raise _fail(shard, f"event {int(bad[0])} has a non-finite {column} ({value}); {len(bad)} of "
                        f"{len(index['num_points'])} events of this file have non-finite coordinates or energies",
                        NONFINITE_TODO)
        counted = index["num_kept"] if min_points_after_cut else index["num_points"]
        keep = (counted >= min_points) & (index["num_kept"] >= 1)
        if len(bad):
            keep[bad] = False
            dropped[name] = bad.tolist()
        rows.append(np.flatnonzero(keep))
        size = shard.stat().st_size
        size_bytes += size
        events_in_files += len(keep)
        identity.append([name, size, index["fingerprint"]])
    num_events = int(sum(len(r) for r in rows))
    if num_events == 0:
        cut_text = f" above {energy_threshold} MeV" if energy_threshold > 0 else ""
        cut_text += " outside the low-energy scatters" if remove_low_energy_scatters else ""
        wanted = (f">= {max(min_points, 1)} points{cut_text}" if min_points_after_cut or not cut_text else
                  f">= {min_points} stored points and at least one point{cut_text}")
        raise _fail(root, f"no event of {events_in_files} in {len(shards)} shard(s) has {wanted}",
                    "lower data.<split>.min_points or energy_threshold")
    selection = {"layout": LAYOUT, "revision": revision, "shards": identity, "min_points": int(min_points),
                 "energy_threshold": float(energy_threshold), "point_cut": "energy > threshold (index v2)",
                 "remove_low_energy_scatters": bool(remove_low_energy_scatters)}
    if min_points > 1 and cut != NO_CUT:  # only then does it matter which points min_points counts
        selection["min_points_counts"] = "points after the cut" if min_points_after_cut else "stored points"
    if dropped:  # only then: the identity of data without such events is unchanged
        selection["nonfinite_dropped"] = dropped
    info = {
        "path": str(root),
        "size_bytes": size_bytes,
        "num_events": num_events,
        "content_hash": hashlib.sha256(json.dumps(selection, sort_keys=True).encode()).hexdigest(),
        "layout": LAYOUT,
        "revision": revision,
        "label": label,
        "split": split,
        "shards": len(shards),
        "events_in_files": events_in_files,
        "min_points": int(min_points),
        "energy_threshold": float(energy_threshold),
        "remove_low_energy_scatters": bool(remove_low_energy_scatters),
        "min_points_after_cut": bool(min_points_after_cut),
        "skip_nonfinite": bool(skip_nonfinite),
        "nonfinite_dropped": int(sum(len(r) for r in dropped.values())),
    }
    return info, shards, rows


def detect_revision(path: str | Path, split: str = DEFAULT_SPLIT) -> str:
    """The revision of the first shard: v1 without `cluster_extra`; with it, v3 when its rows hold 6
    values per cluster (mass, momentum, vertex x/y/z, is_primary), else v2 (5 per cluster)."""
    _, shards = find_shards(path, split)
    try:
        with open_read(shards[0]) as f:
            if "cluster_extra" not in f:
                return "v1"
            cluster, extra = f["cluster"], f["cluster_extra"]
            for row in range(min(len(cluster), len(extra), _SCAN_EVENTS)):  # the first event with clusters
                clusters = cluster[row].size // CLUSTER_COLUMNS["v2"]
                if clusters:
                    return "v3" if extra[row].size == clusters * EXTRA_COLUMNS["v3"] else "v2"
            return "v2"
    except H5_ERRORS as exc:
        raise _fail(shards[0], f"not a readable HDF5 file: {exc}") from exc


def is_pilarnet(path: str | Path) -> bool:
    """Whether `path` looks like PILArNet data (a directory, or an HDF5 file with a `point` dataset)."""
    path = Path(path)
    if path.is_dir():
        return True
    try:
        with open_read(path) as f:
            return "point" in f and "format" not in f.attrs
    except H5_ERRORS:
        return False


def describe_pilarnet(path: str | Path, split: str = DEFAULT_SPLIT, revision: str | None = None) -> dict[str, Any]:
    """Summary of PILArNet shards: identity, events, points and point counts of each label value as
    stored (-1 first, then each class, then values out of range)."""
    revision = revision or detect_revision(path, split)
    info, shards, _ = open_pilarnet(path, split, revision)
    counts = np.zeros((len(LABEL_COLUMNS), len(PID_NAMES) + 2), np.int64)
    num_points = 0
    for shard in shards:
        index = shard_index(shard, revision)
        counts += index["label_counts"]
        num_points += int(index["num_points"].sum())
    out = {**info, "num_points": num_points}
    for i, (label, classes) in enumerate(LABEL_NAMES.items()):
        if LABEL_COLUMNS[label] < CLUSTER_COLUMNS[revision]:
            # -1 in the file: no label; for pid the readers' class "none" unless pid_unlabelled_as_none=False
            out[f"{label}_counts"] = {"-1": int(counts[i, 0]),
                                      **{n: int(c) for n, c in zip(classes, counts[i, 1:])}}
    return out
