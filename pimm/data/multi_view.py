"""Sonata-style multi-view crops of one event, seeded per event (numpy only).

The published generator (DeepLearnPhysics/pimm `pimm/datasets/transform.py`, `MultiViewGenerator`, as
configured in `configs/panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask.py`) cuts an event into
views, each the points nearest to a centre:

* a major global view around a random point, then `global_views - 1` more global views centred on
  random points of the major one, each of a share drawn from `global_scale` of min(max_size, N) points;
* `local_views` local views of a share drawn from `local_scale`, each centred on a point of the major
  view not yet covered by an earlier local view (all covered: start again);
* the global views share one multiplicative energy jitter (sigma 0.05, cut at 0.05, with p 0.8: the
  published `global_shared_transform`), drawn once before the crops; local views take the energies
  as they were;
* every view is then centred (`CenterShift`: its bounding box's centre to 0), rotated about z, x and
  y by angles in [-pi, pi] each with p 0.8, mirrored along each axis with p 0.5, and jittered by
  Gaussian noise of sigma grid_size / 4 cut at grid_size.

Here every draw comes from `rng`, which pimm derives from (seed, epoch, event): an event's views are
the same at any world size, loader worker count and after a resume (the published generator draws
from the global numpy RNG of whichever worker reads the event). Published anchor-biased local crops
(`anchor_bias_ratio`, used only when the data carry `anchors`, which PILArNet-M does not) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MultiViewSettings:
    """The published pretraining recipe's values (pretrain-sonata-v1m1-pilarnet-smallmask.py)."""

    global_views: int = 2
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_views: int = 6
    local_scale: tuple[float, float] = (0.1, 0.4)
    max_size: int = 30000
    grid_size: float = 0.001  # the coordinates' unit: published normalised coordinates
    energy_jitter: tuple[float, float, float] = (0.05, 0.05, 0.8)  # sigma, clip, p
    rotate_p: float = 0.8
    flip_p: float = 0.5


def _view(coord: np.ndarray, centre: np.ndarray, share: float, limit: int) -> np.ndarray:
    """The indices of the int(share * limit) points nearest `centre`, nearest first (ties: the earlier)."""
    size = int(share * limit)
    return np.argsort(((coord - centre) ** 2).sum(axis=1), kind="stable")[:size]


def _augment(coord: np.ndarray, rng: np.random.Generator, settings: MultiViewSettings) -> np.ndarray:
    """Centre, rotate about z, x, y (each with rotate_p), flip each axis (flip_p), jitter: one view's coordinates."""
    out = coord.astype(np.float64)
    if len(out):
        out = out - (out.min(axis=0) + out.max(axis=0)) / 2.0
    for axis in (2, 0, 1):  # z, x, y, as published
        if rng.random() < settings.rotate_p:
            theta = rng.uniform(-np.pi, np.pi)
            b, c = [i for i in range(3) if i != axis]
            cos, sin = np.cos(theta), np.sin(theta)
            rotated = out.copy()
            rotated[:, b], rotated[:, c] = cos * out[:, b] - sin * out[:, c], sin * out[:, b] + cos * out[:, c]
            out = rotated
    out = out * np.where(rng.random(3) < settings.flip_p, -1.0, 1.0)
    noise = np.clip(rng.normal(scale=settings.grid_size / 4.0, size=out.shape), -settings.grid_size, settings.grid_size)
    return (out + noise).astype(np.float32)


def multi_view(coord: np.ndarray, energy: np.ndarray, rng: np.random.Generator,
               settings: MultiViewSettings = MultiViewSettings()) -> dict[str, np.ndarray]:
    """An event's views: global_/local_ coord (augmented), origin_coord (as given: what cross-view matching
    uses), energy, index (the event's point of each view row), and offset (cumulative view sizes)."""
    n = len(coord)
    if n == 0:
        raise ValueError("multi_view needs an event with at least one point")
    limit = min(settings.max_size, n)
    sigma, clip, p = settings.energy_jitter
    jittered = energy.astype(np.float64)
    if rng.random() < p:  # the global views' shared energy jitter, drawn once
        jittered = jittered * (1.0 + np.clip(rng.normal(scale=sigma, size=energy.shape), -clip, clip))
    major = _view(coord, coord[rng.integers(n)], rng.uniform(*settings.global_scale), limit)
    globals_ = [major]
    for _ in range(settings.global_views - 1):  # centred inside the major view
        centre = coord[major[rng.integers(len(major))]]
        globals_.append(_view(coord, centre, rng.uniform(*settings.global_scale), limit))
    covered = np.zeros(len(major), bool)
    locals_ = []
    for _ in range(settings.local_views):
        if covered.all():
            covered[:] = False
        centre = coord[major[rng.choice(np.flatnonzero(~covered))]]
        view = _view(coord, centre, rng.uniform(*settings.local_scale), limit)
        locals_.append(view)
        covered |= np.isin(major, view)
    out: dict[str, np.ndarray] = {}
    for kind, views, energies in (("global", globals_, jittered), ("local", locals_, energy.astype(np.float64))):
        out[f"{kind}_index"] = np.concatenate(views).astype(np.int64)
        out[f"{kind}_coord"] = np.concatenate([_augment(coord[v], rng, settings) for v in views])
        out[f"{kind}_origin_coord"] = coord[out[f"{kind}_index"]].astype(np.float32)
        out[f"{kind}_energy"] = energies[out[f"{kind}_index"]].astype(np.float32)
        out[f"{kind}_offset"] = np.cumsum([len(v) for v in views]).astype(np.int64)
    return out
