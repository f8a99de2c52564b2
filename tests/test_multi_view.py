"""Sonata-style multi-view crops (pimm.data.multi_view): a pure function of the event's seed, the
published structure (2 global views inside one major view, 6 local views covering it, a shared energy
jitter on the global views only), isometric augmentation up to the jitter, the point cap."""

from __future__ import annotations

import numpy as np

from pimm.data.multi_view import MultiViewSettings, multi_view
from pimm.data.synth import distinct_voxels

SCALE = 768.0 * 3**0.5 / 2  # published NormalizeCoord


def event(n: int = 3000, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    coord = (distinct_voxels(n, seed, 0).astype(np.float64) - 384.0) / SCALE
    energy = np.random.default_rng(seed).uniform(-1.0, 1.0, n)
    return coord, energy


def test_views_are_a_function_of_the_events_seed():
    coord, energy = event()
    a = multi_view(coord, energy, np.random.default_rng([0, 1, 5]))
    b = multi_view(coord, energy, np.random.default_rng([0, 1, 5]))
    c = multi_view(coord, energy, np.random.default_rng([0, 1, 6]))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["global_index"], c["global_index"])


def test_the_published_structure_and_augmentation():
    coord, energy = event()
    settings = MultiViewSettings()
    views = multi_view(coord, energy, np.random.default_rng(3), settings)
    limit = min(settings.max_size, len(coord))
    for kind, count, (lo, hi) in (("global", 2, settings.global_scale), ("local", 6, settings.local_scale)):
        sizes = np.diff(views[f"{kind}_offset"], prepend=0)
        assert len(sizes) == count and all(int(lo * limit) <= s <= int(hi * limit) for s in sizes)
        np.testing.assert_array_equal(views[f"{kind}_origin_coord"], coord[views[f"{kind}_index"]].astype(np.float32))
        # each view: rotations, flips and centring keep distances; the jitter moves a point by <= grid_size
        start = 0
        for end in views[f"{kind}_offset"]:
            got, was = views[f"{kind}_coord"][start:end].astype(np.float64), coord[views[f"{kind}_index"][start:end]]
            d_got = np.linalg.norm(got[1:] - got[:1], axis=1)
            d_was = np.linalg.norm(was[1:] - was[:1], axis=1)
            assert np.abs(d_got - d_was).max() <= 2 * np.sqrt(3) * settings.grid_size + 1e-6
            start = end
    major = views["global_index"][: views["global_offset"][0]]
    assert np.isin(views["local_index"], major).any()  # local centres lie in the major view
    # one energy jitter shared by the global views, none on the local views
    ratio = views["global_energy"] / energy[views["global_index"]].astype(np.float32)
    same = {}
    for i, r in zip(views["global_index"], ratio):
        assert same.setdefault(int(i), r) == r
    np.testing.assert_array_equal(views["local_energy"], energy[views["local_index"]].astype(np.float32))


def test_the_point_cap_bounds_every_view():
    coord, energy = event(n=2000)
    views = multi_view(coord, energy, np.random.default_rng(0), MultiViewSettings(max_size=500))
    assert np.diff(views["global_offset"], prepend=0).max() <= 500
