"""Lazy, fork-safe access to pimm event files (see `pimm.data.synth` for the format)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from pimm.data.event_file import _H5_ERRORS, _OPEN_KW, _fail, _read_index, validate_event_file
from pimm.data.synth import DETECTOR_SIZE
from pimm.errors import ConfigError
from pimm.registry import Registry

__all__ = ["DATASETS", "LArTPCDataset", "build_dataset", "validate_event_file"]

DATASETS = Registry("dataset")

@DATASETS.register
class LArTPCDataset(Dataset):
    """Events of a pimm event file as dicts of tensors: coord (N,3), feat (N,4), segment (N,), event_id.

    Keys are an event index or `(epoch, index)`; with `augment`, the random flips, rotation about
    the drift (x) axis, energy scale and coordinate jitter depend only on (seed, epoch, index).
    The HDF5 file is opened lazily in each process (never across a fork, never pickled).
    """

    def __init__(
        self,
        path: str | Path,
        augment: bool = False,
        seed: int = 0,
        max_len: int | None = None,
        energy_scale: float = 1.0,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"dataset seed must be an integer >= 0, got {seed!r}")
        bad_len = isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1
        if max_len is not None and bad_len:
            raise ConfigError(f"dataset max_len must be a positive integer or None, got {max_len!r}")
        if not isinstance(energy_scale, (int, float)) or not math.isfinite(energy_scale) or energy_scale <= 0:
            raise ConfigError(f"dataset energy_scale must be a positive number, got {energy_scale!r}")
        self.info, offsets, self.class_names = _read_index(path)
        self.path = self.info["path"]
        n = self.info["num_events"] if max_len is None else min(int(max_len), self.info["num_events"])
        self.offsets = offsets[: n + 1].copy()  # read once; index lookups never touch the file
        self.augment = bool(augment)
        self.seed = int(seed)
        self.energy_scale = float(energy_scale)
        self._reset_handle()

    def _reset_handle(self) -> None:
        self._h5: h5py.File | None = None
        self._pid: int | None = None
        self._arrays: tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_h5"] = state["_pid"] = state["_arrays"] = None  # an open HDF5 handle must not travel
        return state

    def close(self) -> None:
        """Close this process's file handle (it is reopened on the next access)."""
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._reset_handle()

    def _open(self) -> tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset]:
        """This process's (coord, energy, segment) datasets, opening the file on first use."""
        if self._arrays is None or self._pid != os.getpid():
            # a handle inherited through fork shares HDF5 state with the parent: open our own
            self._reset_handle()
            try:
                self._h5 = h5py.File(self.path, **_OPEN_KW)
                self._arrays = (self._h5["coord"], self._h5["energy"], self._h5["segment"])
            except _H5_ERRORS as exc:
                raise _fail(Path(self.path), f"cannot be reopened ({exc}); was it changed after loading?") from exc
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
        """Event `index` as stored: coord (N,3) float32, energy (N,) float32, segment (N,) uint8."""
        coord_ds, energy_ds, segment_ds = self._open()
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        try:
            # one contiguous slice per array: random access costs one or two chunk reads
            return {"coord": coord_ds[a:b], "energy": energy_ds[a:b], "segment": segment_ds[a:b]}
        except _H5_ERRORS as exc:
            raise _fail(Path(self.path), f"event {index} (rows {a}:{b}) is unreadable: {exc}") from exc

    def _augment(
        self, coord: np.ndarray, energy: np.ndarray, segment: np.ndarray, epoch: int, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flip y/z, rotate about x around the volume centre, jitter; drop points pushed outside."""
        # seeded by the sample alone, so any rank/worker topology sees the same augmentation
        rng = np.random.default_rng([self.seed, epoch, index])
        flip = np.where(rng.random(2) < 0.5, -1.0, 1.0)
        theta = rng.uniform(0.0, 2.0 * np.pi)
        escale = rng.uniform(0.95, 1.05)
        centre = DETECTOR_SIZE / 2.0
        c = coord.astype(np.float64) - centre
        y, z = c[:, 1] * flip[0], c[:, 2] * flip[1]
        cos, sin = np.cos(theta), np.sin(theta)
        c[:, 1], c[:, 2] = cos * y - sin * z, sin * y + cos * z
        c += rng.normal(scale=0.1, size=c.shape) + centre
        out = c.astype(np.float32)
        keep = np.all((out >= 0.0) & (out < DETECTOR_SIZE), axis=1)
        if keep.all():
            return out, (energy * escale).astype(np.float32), segment
        if not keep.any():
            # everything rotated out (tiny event in a corner): clamp rather than return nothing
            out = np.clip(out, 0.0, np.nextafter(np.float32(DETECTOR_SIZE), np.float32(0)))
            keep[:] = True
        return out[keep], (energy[keep] * escale).astype(np.float32), segment[keep]

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        epoch, index = self._parse_key(key)
        raw = self.read_raw(index)
        coord, energy, segment = raw["coord"], raw["energy"], raw["segment"]
        if self.augment:
            coord, energy, segment = self._augment(coord, energy, segment, epoch, index)
        feat = np.empty((len(coord), 4), dtype=np.float32)
        feat[:, :3] = coord * (2.0 / DETECTOR_SIZE) - 1.0  # centred, roughly [-1, 1]
        feat[:, 3] = np.log1p(energy / self.energy_scale)  # compresses the Landau tail
        return {
            "coord": torch.from_numpy(np.ascontiguousarray(coord, dtype=np.float32)),
            "feat": torch.from_numpy(feat),
            "segment": torch.from_numpy(segment.astype(np.int64)),
            "event_id": index,
        }

    def __repr__(self) -> str:
        return f"LArTPCDataset({self.path!r}, events={len(self)}, augment={self.augment}, seed={self.seed})"


def build_dataset(cfg: dict, seed: int) -> LArTPCDataset:
    """Build a dataset from a config dict such as `dict(type="LArTPCDataset", path=..., augment=True)`."""
    if isinstance(cfg, dict) and "seed" in cfg:
        raise ConfigError(f"dataset config {cfg!r} sets 'seed'; the dataset seed comes from the run seed")
    return DATASETS.build(cfg, seed=seed)
