"""Lazy, fork-safe torch datasets over pimm event files (format: `pimm.data.event_format`) and
PILArNet-M shards (layout: `pimm.data.pilarnet_file`)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from pimm import names
from pimm.data.event_file import dropped_note
from pimm.data.event_format import DETECTOR_SIZE, check_layout, event_file_error, select_events
from pimm.data.hdf5 import H5_ERRORS, open_read
from pimm.data.pilarnet_file import (
    DEFAULT_LABEL,
    DEFAULT_REVISION,
    DEFAULT_SPLIT,
    EXTRA_COLUMNS,
    IGNORE_LABEL,
    LABEL_NAMES,
    MIN_POINTS_AFTER_CUT,
    PID_NAMES,
    PID_UNLABELLED_AS_NONE,
    VOLUME_SIZE,
    event_arrays,
    extra_arrays,
    instance_targets,
    kept_points,
    open_pilarnet,
    point_labels,
)
from pimm.data.transforms import DEFAULT_FEATURES, build_transforms, feature_columns
from pimm.errors import ConfigError, DataError
from pimm.registry import Registry

__all__ = ["DATASETS", "LArTPCDataset", "PILArNetDataset", "build_dataset"]

DATASETS = Registry("dataset")
# open_pilarnet's label range with labels=False: any class number passes (-1 is "no label" in the format)
UNCHECKED_CLASSES = 2**62
# per-point instance targets of PILArNetDataset(instances=True) (pilarnet_file.instance_targets): int64 ids and
# classes, float32 momentum, (N, 3) float32 vertex; they follow the points through transforms and collation
TARGET_KEYS = ("particle", "interaction", "pid", "momentum", "vertex")
log = logging.getLogger("pimm")


def _transforms(transforms: list[dict] | None, augment: bool):
    """The Compose of a dataset's `transforms` (None: none); ConfigError when augment is set as well."""
    if transforms is not None and augment:
        raise ConfigError("dataset sets both augment=True and transforms: the transforms replace the built-in "
                          "augmentation, so set augment=False (or transforms=None to keep augment)")
    return build_transforms(transforms)


def _feature_mode(features: str) -> str:
    if features not in names.FEATURE_MODES:
        raise ConfigError(f"dataset features={features!r} is unknown; use one of {', '.join(names.FEATURE_MODES)} "
                          "(pimm.data.transforms.feature_columns says what each computes)")
    return features


def _check_options(seed: int, max_len: int | None, **positive: float) -> None:
    """ConfigError for a dataset seed, max_len or positive number (by name) a dataset cannot use."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"dataset seed must be an integer >= 0, got {seed!r}")
    bad_len = isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1
    if max_len is not None and bad_len:
        raise ConfigError(f"dataset max_len must be a positive integer or None, got {max_len!r}")
    for name, value in positive.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"dataset {name} must be a positive number, got {value!r}")


@DATASETS.register
class LArTPCDataset(Dataset):
    """Events of a pimm event file as dicts of tensors: coord (N,3), feat (N,4), segment (N,), event_id.

    Keys are an event index or `(epoch, index)`; with `augment`, the random flips, rotation about
    the drift (x) axis, energy scale and coordinate jitter depend only on (seed, epoch, index).
    `transforms` (a list of dict(type=..., ...), pimm.data.transforms) replaces that augmentation
    with the listed steps, each random one seeded by (seed, epoch, index, its place in the list);
    `point_index(index)` gives the stored point index of each point an event comes out with.
    With `skip_nonfinite`, events with a non-finite coordinate or energy are left out (the file is
    read once to find them; without it the launcher has refused such a file); the index is then
    over the remaining events, in stored order. With `labels=False` (prediction) the file may lack
    `segment`; every event's segment is then -1 (no label, which collation still expects).
    The HDF5 file is opened lazily in each process (never across a fork, never pickled).
    """

    volume_size = DETECTOR_SIZE  # coordinates lie in [0, volume_size)^3: feature scale, rotation centre

    def __init__(
        self,
        path: str | Path,
        augment: bool = False,
        seed: int = 0,
        max_len: int | None = None,
        energy_scale: float = 1.0,
        skip_nonfinite: bool = False,
        labels: bool = True,
        transforms: list[dict] | None = None,
        features: str = DEFAULT_FEATURES,
    ) -> None:
        _check_options(seed, max_len, energy_scale=energy_scale)
        self.features = _feature_mode(features)
        self.transforms = _transforms(transforms, augment)
        self.labels = bool(labels)
        if skip_nonfinite:
            self.info, offsets, self.class_names, stored = select_events(path, skip_nonfinite=True,
                                                                         labels=self.labels)
            _log_dropped(self.info)
        else:
            self.info, offsets, self.class_names = check_layout(path, self.labels)
            stored = None
        self.path = self.info["path"]
        n = self.info["num_events"] if max_len is None else min(int(max_len), self.info["num_events"])
        # stored index of each event used (None: all of them, in order)
        self.stored = None if stored is None or len(stored) == len(offsets) - 1 else stored[:n]
        last = n if self.stored is None else int(self.stored[-1]) + 1
        self.offsets = offsets[: last + 1].copy()  # read once; index lookups never touch the file
        self._len = n
        self.augment = bool(augment)
        self.seed = int(seed)
        self.energy_scale = float(energy_scale)
        self._reset_handle()

    def _reset_handle(self) -> None:
        self._h5: h5py.File | None = None
        self._pid: int | None = None
        self._arrays: tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset] | None = None

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_h5"] = state["_pid"] = state["_arrays"] = None  # an open HDF5 handle must not travel
        return state

    def close(self) -> None:
        """Close this process's file handle (it is reopened on the next access)."""
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._reset_handle()

    def _open(self) -> tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset | None]:
        """This process's (coord, energy, segment) datasets (segment None: an unlabelled file read
        with labels=False), opening the file on first use."""
        if self._arrays is None or self._pid != os.getpid():
            # a handle inherited through fork shares HDF5 state with the parent: open our own
            self._reset_handle()
            try:
                self._h5 = open_read(self.path)
                segment = self._h5["segment"] if self.labels else None
                self._arrays = (self._h5["coord"], self._h5["energy"], segment)
            except H5_ERRORS as exc:
                raise event_file_error(Path(self.path),
                                       f"cannot be reopened ({exc}); was it changed after loading?") from exc
            self._pid = os.getpid()
        return self._arrays

    def _parse_key(self, key: Any) -> tuple[int, int]:
        """(epoch, index) from an int index or an (epoch, index) pair."""
        if isinstance(key, tuple):
            if len(key) != 2:
                raise TypeError(f"dataset key must be an index or (epoch, index), got {key!r}")
            epoch, index = int(key[0]), int(key[1])
        else:
            epoch, index = 0, int(key)
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"event index {key!r} out of range for {n} events in {self.path}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return epoch, index

    def read_raw(self, index: int) -> dict[str, np.ndarray]:
        """Event `index` as stored: coord (N,3) float32, energy (N,) float32, segment (N,) uint8
        (int64 -1 everywhere with labels=False), point_index (N,) int64 (0..N-1)."""
        coord_ds, energy_ds, segment_ds = self._open()
        stored = index if self.stored is None else int(self.stored[index])
        a, b = int(self.offsets[stored]), int(self.offsets[stored + 1])
        try:
            # one contiguous slice per array: random access costs one or two chunk reads
            segment = segment_ds[a:b] if segment_ds is not None else np.full(b - a, -1, np.int64)
            return {"coord": coord_ds[a:b], "energy": energy_ds[a:b], "segment": segment,
                    "point_index": np.arange(b - a, dtype=np.int64)}
        except H5_ERRORS as exc:
            raise event_file_error(Path(self.path), f"event {stored} (rows {a}:{b}) is unreadable: {exc}") from exc

    def _augment(
        self, coord: np.ndarray, energy: np.ndarray, segment: np.ndarray, epoch: int, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flip y/z, rotate about x around the volume centre, jitter; drop points pushed outside."""
        # seeded by the sample alone, so any rank/worker topology sees the same augmentation
        rng = np.random.default_rng([self.seed, epoch, index])
        flip = np.where(rng.random(2) < 0.5, -1.0, 1.0)
        theta = rng.uniform(0.0, 2.0 * np.pi)
        escale = rng.uniform(0.95, 1.05)
        centre = self.volume_size / 2.0
        c = coord.astype(np.float64) - centre
        y, z = c[:, 1] * flip[0], c[:, 2] * flip[1]
        cos, sin = np.cos(theta), np.sin(theta)
        c[:, 1], c[:, 2] = cos * y - sin * z, sin * y + cos * z
        c += rng.normal(scale=0.1, size=c.shape) + centre
        out = c.astype(np.float32)
        keep = np.all((out >= 0.0) & (out < self.volume_size), axis=1)
        if keep.all():
            return out, (energy * escale).astype(np.float32), segment
        if not keep.any():
            # everything rotated out (tiny event in a corner): clamp rather than return nothing
            out = np.clip(out, 0.0, np.nextafter(np.float32(self.volume_size), np.float32(0)))
            keep[:] = True
        return out[keep], (energy[keep] * escale).astype(np.float32), segment[keep]

    def _transformed(self, epoch: int, index: int) -> dict[str, np.ndarray]:
        """Event `index` after this dataset's transforms at `epoch` (arrays of pimm.data.transforms)."""
        raw = self.read_raw(index)
        event = {key: raw[key] for key in ("coord", "energy", "segment", "point_index", *TARGET_KEYS) if key in raw}
        context = {"volume_size": float(self.volume_size), "energy_scale": self.energy_scale}
        return self.transforms(event, self.seed, epoch, index, context)

    def point_index(self, key: int | tuple[int, int], count: int | None = None) -> np.ndarray:
        """(N,) int32: the stored point index (its row in the event as stored, before any point cut) of
        each point `self[key]` gives, in the same order; re-reads the event when points may have been
        dropped. `count`: the number of points `self[key]` gave, which spares the read otherwise."""
        epoch, index = self._parse_key(key)
        cut = getattr(self, "cut", (0.0, False))
        drops = self.augment or (self.transforms is not None and self.transforms.drops_points)
        if not drops and not (cut[0] > 0 or cut[1]) and count is not None:
            return np.arange(count, dtype=np.int32)  # every stored point, in order: nothing to read
        if self.transforms is not None and self.transforms.drops_points:
            return self._transformed(epoch, index)["point_index"].astype(np.int32)
        if self.augment:  # the built-in augmentation drops points pushed out of the volume
            raw = self.read_raw(index)
            # point_index in place of segment: _augment returns the rows it kept
            return self._augment(raw["coord"], raw["energy"], raw["point_index"], epoch, index)[2].astype(np.int32)
        return self.read_raw(index)["point_index"].astype(np.int32)

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        epoch, index = self._parse_key(key)
        if self.transforms is not None:
            event = self._transformed(epoch, index)
            coord, segment = event["coord"], event["segment"]
            feat = feature_columns(event, float(self.volume_size), self.energy_scale, self.features)
        else:
            event = self.read_raw(index)
            coord, energy, segment = event["coord"], event["energy"], event["segment"]
            if self.augment:
                coord, energy, segment = self._augment(coord, energy, segment, epoch, index)
            feat = feature_columns({"coord": coord, "energy": energy}, self.volume_size, self.energy_scale,
                                   self.features)
        item = {
            "coord": torch.from_numpy(np.ascontiguousarray(coord, dtype=np.float32)),
            "feat": torch.from_numpy(feat),
            "segment": torch.from_numpy(segment.astype(np.int64)),
            "event_id": index,
        }
        item.update({key: torch.from_numpy(np.ascontiguousarray(event[key])) for key in TARGET_KEYS if key in event})
        return item

    def __repr__(self) -> str:
        return (f"LArTPCDataset({self.path!r}, events={len(self)}, augment={self.augment}, "
                f"transforms={self.transforms}, seed={self.seed})")


@DATASETS.register
class PILArNetDataset(LArTPCDataset):
    """Events of PILArNet-M shards (layout in `pimm.data.pilarnet_file`) in LArTPCDataset's format:
    coord (N,3), feat (N,4), segment (N,) int64 (the `label` column: "motif" or "pid", -1 = ignore),
    event_id (the index in the selection, over all shards in order).

    `path` is one .h5 shard, a directory with `*<split>/*.h5`, or a directory of .h5 files.
    Points with deposited energy at or below `energy_threshold` MeV are dropped, and with
    `remove_low_energy_scatters` the event's low-energy-scatter cluster (the first, semantic 4),
    as PILArNet-M's published reader does; events with fewer than `min_points` points left (or
    none) are left out, through an index cached beside each shard (built on first use), and with
    `skip_nonfinite` those with a non-finite coordinate or energy (found by the same index).
    `min_points` counts the stored points, as the published readers do; `min_points_after_cut=True`
    counts the points left after the cut instead. `volume_size` is the side of the cube the
    coordinates fill (768 voxels in PILArNet-M). pid -1 (the low-energy deposits of PILArNet-M
    v2/v3) is class 5 "none", as in the published readers; `pid_unlabelled_as_none=False` keeps it
    -1 (no label, ignored). With `labels=False` (prediction) segment is -1 everywhere and the
    labels are not checked. With `instances=True` each event also gives the instance targets of its
    points (TARGET_KEYS, pilarnet_file.instance_targets): particle and interaction (dense ids per event,
    -1 for stuff), and in v2/v3 pid, momentum and vertex; transforms carry them (a vertex moves with the
    coordinates the model sees). Shards are opened lazily, one handle per shard
    and process, never across a fork.
    """

    def __init__(
        self,
        path: str | Path,
        split: str = DEFAULT_SPLIT,
        revision: str = DEFAULT_REVISION,
        label: str = DEFAULT_LABEL,
        min_points: int = 0,
        energy_threshold: float = 0.0,
        augment: bool = False,
        seed: int = 0,
        max_len: int | None = None,
        energy_scale: float = 1.0,
        volume_size: float = VOLUME_SIZE,
        pid_unlabelled_as_none: bool = PID_UNLABELLED_AS_NONE,
        remove_low_energy_scatters: bool = False,
        skip_nonfinite: bool = False,
        labels: bool = True,
        transforms: list[dict] | None = None,
        min_points_after_cut: bool = MIN_POINTS_AFTER_CUT,
        features: str = DEFAULT_FEATURES,
        instances: bool = False,
    ) -> None:
        _check_options(seed, max_len, energy_scale=energy_scale, volume_size=volume_size)
        if instances and augment:
            raise ConfigError("instances=True with augment=True: the built-in augmentation does not carry the "
                              "instance targets; augment with transforms=[...] instead (they do)")
        self.instances = bool(instances) and bool(labels)
        self.features = _feature_mode(features)
        self.transforms = _transforms(transforms, augment)
        self.labels = bool(labels)
        self.info, shards, rows = open_pilarnet(path, split, revision, label, min_points, energy_threshold,
                                                remove_low_energy_scatters=remove_low_energy_scatters,
                                                skip_nonfinite=bool(skip_nonfinite),
                                                num_classes=None if labels else UNCHECKED_CLASSES,
                                                min_points_after_cut=min_points_after_cut,
                                                pid_unlabelled_as_none=pid_unlabelled_as_none)
        _log_dropped(self.info)
        self.cut = (float(energy_threshold), bool(remove_low_energy_scatters))
        self.path = self.info["path"]
        self.shards = [str(s) for s in shards]
        n = self.info["num_events"] if max_len is None else min(int(max_len), self.info["num_events"])
        # (shard, row) of every selected event: index lookups never touch the files
        self.event_shard = np.concatenate([np.full(len(r), i, np.int32) for i, r in enumerate(rows)])[:n]
        self.event_row = np.concatenate(rows)[:n]
        self.revision, self.label = revision, label
        self.class_names = list(LABEL_NAMES[label])
        self.augment = bool(augment)
        self.seed = int(seed)
        self.energy_scale = float(energy_scale)
        self.volume_size = float(volume_size)
        self.pid_unlabelled_as_none = bool(pid_unlabelled_as_none)
        self._reset_handle()

    def _reset_handle(self) -> None:
        self._files: dict[int, tuple[h5py.File, h5py.Dataset, h5py.Dataset, h5py.Dataset | None]] = {}
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.event_row)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"], state["_pid"] = {}, None  # open HDF5 handles must not travel
        return state

    def close(self) -> None:
        """Close this process's shard handles (they are reopened on the next access)."""
        if self._pid == os.getpid():
            for f, *_ in self._files.values():
                f.close()
        self._reset_handle()

    def _open_shard(self, shard: int) -> tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset | None]:
        """This process's (point, cluster, cluster_extra or None) datasets of one shard, opening it on first use."""
        if self._pid != os.getpid():
            self._reset_handle()  # handles inherited through fork share HDF5 state with the parent
            self._pid = os.getpid()
        if shard not in self._files:
            path = self.shards[shard]
            try:
                f = open_read(path)
                extra = f["cluster_extra"] if self.revision in EXTRA_COLUMNS and "cluster_extra" in f else None
                self._files[shard] = (f, f["point"], f["cluster"], extra)
            except H5_ERRORS as exc:
                raise DataError(f"PILArNet file {path}: cannot be reopened ({exc}); was it changed after "
                                "indexing?") from exc
        return self._files[shard][1:]

    def read_raw(self, index: int) -> dict[str, np.ndarray]:
        """Event `index` of the selection: point (N,8) and cluster (K,5|6) as stored, and the points
        that survive the cut: coord (M,3) float32, energy (M,) float32, segment (M,) int64 (the
        chosen label per point), point_index (M,) int64 (their rows in `point`); with instances=True also
        the instance targets of those points (TARGET_KEYS)."""
        shard, row = int(self.event_shard[index]), int(self.event_row[index])
        point_ds, cluster_ds, extra_ds = self._open_shard(shard)
        path = Path(self.shards[shard])
        try:
            point_row, cluster_row = point_ds[row], cluster_ds[row]
            extra_row = extra_ds[row] if self.instances and extra_ds is not None else None
        except H5_ERRORS as exc:
            raise DataError(f"PILArNet file {path}: event {row} is unreadable: {exc}") from exc
        point, cluster = event_arrays(path, row, point_row, cluster_row, self.revision)
        segment = point_labels(cluster, self.label) if self.labels else np.full(len(point), IGNORE_LABEL, np.int64)
        if self.labels and self.pid_unlabelled_as_none and self.label == "pid":
            segment[segment == IGNORE_LABEL] = PID_NAMES.index("none")
        keep = kept_points(point, cluster, self.cut)
        kept = point if keep is None else point[keep]
        targets = {}
        if self.instances:
            extra = None if extra_row is None else extra_arrays(path, row, extra_row, self.revision, len(cluster))
            targets = instance_targets(cluster, extra, keep, self.pid_unlabelled_as_none)
        return {
            **targets,
            "point_index": np.arange(len(point), dtype=np.int64) if keep is None else np.flatnonzero(keep),
            "point": point,
            "cluster": cluster,
            "coord": np.ascontiguousarray(kept[:, :3], dtype=np.float32),
            "energy": np.ascontiguousarray(kept[:, 3], dtype=np.float32),
            "segment": segment if keep is None else segment[keep],
        }

    def __repr__(self) -> str:
        return (f"PILArNetDataset({self.path!r}, revision={self.revision}, label={self.label}, shards="
                f"{len(self.shards)}, events={len(self)}, augment={self.augment}, "
                f"transforms={self.transforms}, seed={self.seed})")


def _log_dropped(info: dict) -> None:
    note = dropped_note(info)
    if note:
        log.info("%s", note)


def build_dataset(cfg: dict, seed: int) -> LArTPCDataset:
    """Build a dataset from a config dict such as `dict(type="LArTPCDataset", path=..., augment=True)`
    or `dict(type="PILArNetDataset", path=..., split="train", revision="v2", label="motif")`."""
    if isinstance(cfg, dict) and "seed" in cfg:
        raise ConfigError(f"dataset config {cfg!r} sets 'seed'; the dataset seed comes from the run seed")
    return DATASETS.build(cfg, seed=seed)
