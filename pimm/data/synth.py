"""Synthetic LArTPC events: a physics-inspired generator and the HDF5 writer for pimm event files.

An event is a set of 3D points (one per ~3 mm voxel pitch unit) with a deposited energy (MeV)
and one of five PILArNet semantic labels. Objects are drawn as in a liquid-argon TPC image:
tracks (muons, protons) with multiple scattering and a Bragg peak, Michel electrons at stopping
muon ends, delta rays branching off tracks, electromagnetic showers as branching cascades, and
isolated low-energy blips. Every event is a pure function of (seed, index).

File layout (format "pimm-events", version 1): flat datasets `coord` (N,3) float32,
`energy` (N,) float32, `segment` (N,) uint8 and `offsets` (E+1,) int64, event i being rows
offsets[i]:offsets[i+1]. `write_pilarnet` writes the same events in PILArNet-M's layout (one
cluster per object; see pimm.data.pilarnet_file).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np

from pimm.data.pilarnet_file import CLUSTER_COLUMNS, EXTRA_COLUMNS, POINT_COLUMNS, VOLUME_SIZE
from pimm.errors import DataError

CLASS_NAMES = ("shower", "track", "michel", "delta", "low_energy")
SHOWER, TRACK, MICHEL, DELTA, LOW_ENERGY = range(len(CLASS_NAMES))
PHOTON, ELECTRON, MUON, PION, PROTON = range(5)  # pilarnet_file.PID_NAMES
NO_PID = -1  # PILArNet-M's particle type of low-energy deposits
DETECTOR_SIZE = 256.0
VOXELS = int(VOLUME_SIZE)  # the PILArNet-M layout's voxel cube: 768 per side
PILARNET_SPREAD = 1.0  # voxels: the Gaussian offsets of a densified event's point copies
_MAX_COPIES = 32
_PID_MASS_MEV = (0.0, 0.511, 105.66, 139.57, 938.27)  # photon, electron, muon, pion, proton

FORMAT = "pimm-events"
FORMAT_VERSION = 1
GENERATOR = "pimm.data.synth"
GENERATOR_VERSION = 1
PILARNET_GENERATOR_VERSION = 2  # 2: integer voxels in a 768 cube, cluster ids -1 for blips, shower fragments
DATASET_NAMES = ("coord", "energy", "segment", "offsets")
CHUNK_ROWS = 4096  # measured fastest for random event reads (vs 1k/16k/64k); lzf saved only 3%, so none

_UNIT_CM = 0.3  # one coordinate unit is a ~3 mm voxel pitch
_MIP_DEDX = 2.1  # MeV/cm deposited by a minimum-ionising particle in liquid argon
_DTYPES = {"coord": np.dtype("<f4"), "energy": np.dtype("<f4"), "segment": np.dtype("u1"), "offsets": np.dtype("<i8")}




def synth_command(path: str | Path = "PATH") -> str:
    """The CLI command that (re)generates an event file at `path`, for error messages."""
    return f"`pimm data synth --out {path} --events N --seed S`"


# ----------------------------------------------------------------------------- geometry helpers


def _unit(v: np.ndarray) -> np.ndarray:
    """Normalise vectors along the last axis."""
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def _random_dirs(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,3) isotropic unit vectors."""
    return _unit(rng.normal(size=(n, 3)))


def _perpendicular(rng: np.random.Generator, d: np.ndarray) -> np.ndarray:
    """Random unit vectors perpendicular to each row of `d` (n,3)."""
    u = rng.normal(size=d.shape)
    u -= (u * d).sum(-1, keepdims=True) * d
    return _unit(u)


def _tilt(rng: np.random.Generator, d: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """Rotate unit vectors `d` (n,3) by `angle` (n,) radians towards a random perpendicular."""
    angle = np.asarray(angle)[..., None]
    return _unit(np.cos(angle) * d + np.sin(angle) * _perpendicular(rng, d))


def _moyal(rng: np.random.Generator, n: int) -> np.ndarray:
    """Moyal (Landau approximation) samples: mode 0, long right tail; X = -ln(chi2_1)."""
    return -np.log(np.maximum(rng.chisquare(1.0, n), 1e-12))


def _landau_factor(rng: np.random.Generator, n: int, width: float) -> np.ndarray:
    """Multiplicative dE/dx fluctuation around 1 with a Landau-like tail."""
    return np.clip(1.0 + width * _moyal(rng, n), 0.4, 5.0)


def _walk(
    rng: np.random.Generator,
    start: np.ndarray,
    direction: np.ndarray,
    n: int,
    step: float,
    scatter: float,
    jitter: float,
    kinks: int = 0,
) -> np.ndarray:
    """(n,3) points of a charged-particle path: `n` steps of `step` units from `start`.

    The direction does a random walk of rms `scatter` per step (multiple Coulomb scattering:
    the angle grows like sqrt(path)); `kinks` hard scatters add a 25-60 degree turn each;
    points get a transverse `jitter` (diffusion and voxelisation).
    """
    kicks = rng.normal(scale=scatter, size=(n, 3))
    if kinks and n > 4:
        at = rng.choice(np.arange(2, n - 1), size=min(kinks, n - 3), replace=False)
        kicks[at] += rng.uniform(0.45, 1.2, size=(len(at), 1)) * _perpendicular(rng, np.tile(direction, (len(at), 1)))
    dirs = _unit(direction + np.cumsum(kicks, axis=0))
    # point k sits after k steps: the exclusive cumulative sum of the step vectors
    pts = start + step * (np.cumsum(dirs, axis=0) - dirs)
    return pts + rng.normal(scale=jitter, size=pts.shape)


def _inside(p: np.ndarray, margin: float) -> bool:
    """Whether point `p` lies in the detector at least `margin` units from every face."""
    return bool(np.all(p >= margin) and np.all(p < DETECTOR_SIZE - margin))


# ----------------------------------------------------------------------------- particle objects


def _track(
    rng: np.random.Generator, start: np.ndarray, direction: np.ndarray, proton: bool
) -> tuple[np.ndarray, np.ndarray, bool]:
    """A muon- or proton-like track: (points, energies, stops_inside)."""
    if proton:
        length, step, scatter, dedx_a = rng.uniform(12.0, 45.0), 0.6, 0.02, 17.0
    else:
        length, step, scatter, dedx_a = rng.uniform(60.0, 200.0), 1.0, 0.012, 8.0
    n = int(length / step) + 1
    pts = _walk(rng, start, direction, n, step, scatter, jitter=0.25)
    stops = _inside(pts[-1], 4.0)
    if stops or proton:
        # Bragg curve: dE/dx ~ A * R^-0.42 in the residual range R (cm), never below a MIP
        residual_cm = (n - 1 - np.arange(n)) * step * _UNIT_CM + 0.05
        dedx = np.clip(dedx_a * residual_cm**-0.42, _MIP_DEDX, 40.0)
    else:
        dedx = np.full(n, _MIP_DEDX)  # a through-going muon stays minimum-ionising
    energy = dedx * step * _UNIT_CM * _landau_factor(rng, n, 0.12)
    return pts, energy, stops


def _electron(
    rng: np.random.Generator,
    start: np.ndarray,
    direction: np.ndarray,
    length: float,
    step: float,
    scatter: float,
    kinks: int,
    dedx: float,
) -> tuple[np.ndarray, np.ndarray]:
    """A short, tortuous electron path (Michel or delta ray): (points, energies)."""
    n = max(int(length / step), 2)
    pts = _walk(rng, start + step * direction, direction, n, step, scatter, jitter=0.2, kinks=kinks)
    rise = 1.0 + 1.5 * (np.arange(n) >= n - 2)  # the electron stops: the last points are denser
    return pts, dedx * step * _UNIT_CM * rise * _landau_factor(rng, n, 0.15)


def _shower(
    rng: np.random.Generator, origin: np.ndarray, direction: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray]:
    """An electromagnetic cascade as a tree of straight segments: (points, energies, started by a
    photon, fragment of each point: 0 the trunk, 1 and 2 the two sub-cascades of its first split).

    A photon converts after a gap (an electron starts at once); each segment splits in two
    children with a larger opening angle, less energy and a shorter length until the energy
    falls below the critical energy. Points spread transversely more with depth.
    """
    photon = rng.random() < 0.65
    gap = min(rng.exponential(15.0), 50.0) if photon else 0.0
    starts = (origin + gap * direction)[None]
    dirs = direction[None]
    lengths = np.array([rng.uniform(15.0, 35.0)])
    energies = np.array([rng.uniform(60.0, 450.0)])  # shower energy, MeV
    branches = np.zeros(1, np.int64)  # 0: the trunk; 1, 2: the first split's two sub-cascades
    seg_start, seg_dir, seg_len, seg_depth, seg_branch = [], [], [], [], []
    for depth in range(6):
        seg_start.append(starts)
        seg_dir.append(dirs)
        seg_len.append(lengths)
        seg_depth.append(np.full(len(lengths), depth))
        seg_branch.append(branches)
        split = energies > 18.0  # below ~critical energy a branch just ends
        if depth == 5 or not split.any():
            break
        p_start, p_dir, p_len, p_e = starts[split], dirs[split], lengths[split], energies[split]
        k = len(p_e)
        branches = np.arange(1, 2 * k + 1) if depth == 0 else np.concatenate([branches[split], branches[split]])
        ends = p_start + p_dir * p_len[:, None]
        frac = rng.beta(2.0, 2.0, size=k)
        energies = np.concatenate([p_e * frac, p_e * (1.0 - frac)]) * 0.85
        parent_dir = np.concatenate([p_dir, p_dir])
        spread = 0.18 * (depth + 1)  # opening angles grow down the cascade
        dirs = _tilt(rng, parent_dir, np.abs(rng.normal(0.0, spread, size=2 * k)) + 0.05)
        lengths = np.concatenate([p_len, p_len]) * rng.uniform(0.55, 0.9, size=2 * k)
        # some children are photons that travel a little before converting again
        hop = np.where(rng.random(2 * k) < 0.3, rng.exponential(3.0, size=2 * k), 0.0)
        starts = np.concatenate([ends, ends]) + dirs * hop[:, None]
    s_start = np.concatenate(seg_start)
    s_dir = np.concatenate(seg_dir)
    s_len = np.concatenate(seg_len)
    s_depth = np.concatenate(seg_depth)
    s_branch = np.concatenate(seg_branch)
    spacing = 0.6
    counts = np.maximum((s_len / spacing).astype(np.int64), 1)
    seg = np.repeat(np.arange(len(counts)), counts)
    # position along each segment: 0, spacing, 2*spacing, ... restarting per segment
    along = (np.arange(len(seg)) - np.repeat(np.cumsum(counts) - counts, counts)) * spacing
    sigma = (0.3 + 0.4 * s_depth)[seg]
    pts = s_start[seg] + s_dir[seg] * along[:, None] + rng.normal(size=(len(seg), 3)) * sigma[:, None]
    # the photon-converted trunk carries an e+e- pair: twice the ionisation of one electron
    pairs = np.where((s_depth[seg] == 0) & photon, 2.0, 1.0)
    energy = _MIP_DEDX * spacing * _UNIT_CM * pairs * _landau_factor(rng, len(seg), 0.25)
    return pts, energy, photon, s_branch[seg]


def _blips(rng: np.random.Generator, activity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """10-40 isolated low-energy deposits of 1-3 points, anywhere or near `activity` points."""
    n = int(rng.integers(10, 41))
    centres = rng.uniform(0.0, DETECTOR_SIZE, size=(n, 3))
    near = rng.random(n) < 0.5
    if len(activity):
        anchor = activity[rng.integers(0, len(activity), size=n)]
        offset = _random_dirs(rng, n) * rng.uniform(5.0, 20.0, size=(n, 1))
        centres = np.where(near[:, None], anchor + offset, centres)
    sizes = rng.integers(1, 4, size=n)
    pts = np.repeat(centres, sizes, axis=0) + rng.normal(scale=0.6, size=(int(sizes.sum()), 3))
    energy = 0.03 + rng.exponential(0.15, size=len(pts))
    return pts, energy


# ----------------------------------------------------------------------------- events


def generate_event(seed: int, index: int) -> dict[str, np.ndarray]:
    """Event `index` of the synthetic data set `seed`: coord (N,3) float32, energy (N,) float32,
    segment (N,) uint8, and per point the object it belongs to, instance (N,) int32 (tracks,
    Michels, deltas and showers in drawing order, the low-energy blips last), and that object's
    particle type, pid (N,) int8 (pilarnet_file.PID_NAMES; -1 for blips, as in PILArNet-M), and the
    fragment of its object, fragment (N,) int8 (a shower's trunk 0 and sub-cascades 1, 2; 0 elsewhere).
    A pure function of (seed, index) (both non-negative integers)."""
    rng = np.random.default_rng([seed, index])
    parts: list[tuple] = []  # (points, energies, semantic, pid, fragment: 0 or one per point) per object

    vertex = rng.uniform(40.0, DETECTOR_SIZE - 40.0, size=3)  # neutrino-like interaction vertex
    n_tracks = int(rng.integers(1, 4))
    for t in range(n_tracks):
        proton = t > 0 and rng.random() < 0.5  # the first track is always a muon
        from_vertex = rng.random() < 0.6
        start = vertex if from_vertex else rng.uniform(10.0, DETECTOR_SIZE - 10.0, size=3)
        direction = _random_dirs(rng, 1)[0]
        pts, energy, stops = _track(rng, start, direction, proton)
        parts.append((pts, energy, TRACK, PROTON if proton else MUON, 0))
        if not proton and stops and rng.random() < 0.6:
            end_dir = _random_dirs(rng, 1)[0]
            kinks = int(rng.integers(1, 4))
            m_pts, m_e = _electron(rng, pts[-1], end_dir, rng.uniform(10.0, 35.0), 0.8, 0.05, kinks, _MIP_DEDX)
            parts.append((m_pts, m_e, MICHEL, ELECTRON, 0))
        for _ in range(int(rng.integers(0, 4))):
            at = int(rng.integers(int(0.1 * len(pts)), max(int(0.85 * len(pts)), int(0.1 * len(pts)) + 1)))
            local = _unit(pts[min(at + 3, len(pts) - 1)] - pts[max(at - 3, 0)])
            d_dir = _tilt(rng, local[None], np.array([rng.uniform(0.8, 1.5)]))[0]
            d_pts, d_e = _electron(rng, pts[at], d_dir, rng.uniform(3.0, 12.0), 0.7, 0.15, 0, 0.6 * _MIP_DEDX)
            parts.append((d_pts, d_e, DELTA, ELECTRON, 0))

    for _ in range(int(rng.choice(3, p=[0.15, 0.45, 0.4]))):
        origin = vertex if rng.random() < 0.5 else rng.uniform(20.0, DETECTOR_SIZE - 20.0, size=3)
        s_pts, s_e, photon, s_fragment = _shower(rng, origin, _random_dirs(rng, 1)[0])
        parts.append((s_pts, s_e, SHOWER, PHOTON if photon else ELECTRON, s_fragment))

    activity = np.concatenate([p for p, *_ in parts])
    b_pts, b_e = _blips(rng, activity)
    parts.append((b_pts, b_e, LOW_ENERGY, NO_PID, 0))

    coord = np.concatenate([p for p, *_ in parts]).astype(np.float32)
    energy = np.concatenate([e for _, e, *_ in parts]).astype(np.float32)
    segment = np.concatenate([np.full(len(p), label, dtype=np.uint8) for p, _, label, *_ in parts])
    instance = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, (p, *_) in enumerate(parts)])
    pid = np.concatenate([np.full(len(p), kind, dtype=np.int8) for p, _, _, kind, _ in parts])
    fragment = np.concatenate([np.broadcast_to(np.asarray(f, np.int8), len(p)) for p, *_, f in parts])
    # test containment after the float32 cast: 255.99999999 would round onto the face
    keep = np.all((coord >= 0.0) & (coord < DETECTOR_SIZE), axis=1)
    # real images come in voxel order, not object by object: do not leak labels through order
    order = rng.permutation(int(keep.sum()))
    return {
        "coord": np.ascontiguousarray(coord[keep][order]),
        "energy": energy[keep][order],
        "segment": segment[keep][order],
        "instance": instance[keep][order],
        "pid": pid[keep][order],
        "fragment": fragment[keep][order],
    }


# ----------------------------------------------------------------------------- files


class _ContentHasher:
    """Streams the four arrays' raw little-endian bytes into one sha256 per array.

    content_hash = sha256(sha256(coord) || sha256(energy) || sha256(segment) || sha256(offsets)),
    the inner digests being raw 32-byte digests of each array's C-order bytes. Per-array
    streams let the writer hash rows as it writes them, in any interleaving.
    """

    def __init__(self) -> None:
        self._h = {name: hashlib.sha256() for name in DATASET_NAMES}

    def update(self, name: str, array: np.ndarray) -> None:
        self._h[name].update(np.ascontiguousarray(array, dtype=_DTYPES[name]).data)

    def hexdigest(self) -> str:
        return hashlib.sha256(b"".join(self._h[name].digest() for name in DATASET_NAMES)).hexdigest()


def _check_int(value: object, name: str, minimum: int) -> int:
    """`value` as an int >= minimum, else a DataError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def write_dataset(path: str | Path, num_events: int, seed: int) -> Path:
    """Generate events 0..num_events-1 of `seed` into a pimm event file at `path`; returns the path.

    The file is written to `<path>.h5.tmp` beside it and moved into place only when complete,
    so a crash never leaves a half-written file under the final name.
    """
    num_events = _check_int(num_events, "the number of events", 1)
    seed = _check_int(seed, "the seed", 0)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the directory for {path}: {exc}; choose a writable --out path") from exc
    tmp = path.with_suffix(".h5.tmp")
    hasher = _ContentHasher()
    offsets = np.zeros(num_events + 1, dtype=np.int64)
    try:
        with h5py.File(tmp, "w") as f:
            ds = {
                "coord": f.create_dataset(
                    "coord", shape=(0, 3), maxshape=(None, 3), dtype=_DTYPES["coord"], chunks=(CHUNK_ROWS, 3)
                ),
                "energy": f.create_dataset(
                    "energy", shape=(0,), maxshape=(None,), dtype=_DTYPES["energy"], chunks=(CHUNK_ROWS,)
                ),
                "segment": f.create_dataset(
                    "segment", shape=(0,), maxshape=(None,), dtype=_DTYPES["segment"], chunks=(CHUNK_ROWS,)
                ),
            }
            pending: dict[str, list[np.ndarray]] = {name: [] for name in ds}
            pending_rows = 0
            written = 0

            def flush() -> None:
                nonlocal pending_rows, written
                for name, d in ds.items():
                    block = np.concatenate(pending[name])
                    d.resize(written + len(block), axis=0)
                    d[written:] = block
                    hasher.update(name, block)
                    pending[name] = []
                written += pending_rows
                pending_rows = 0

            for i in range(num_events):
                event = generate_event(seed, i)
                for name in ds:
                    pending[name].append(event[name])
                pending_rows += len(event["segment"])
                offsets[i + 1] = offsets[i] + len(event["segment"])
                if pending_rows >= 8 * CHUNK_ROWS:  # write whole chunks at a time
                    flush()
            if pending_rows:
                flush()
            f.create_dataset("offsets", data=offsets)
            hasher.update("offsets", offsets)
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["generator"] = GENERATOR
            f.attrs["generator_version"] = GENERATOR_VERSION
            f.attrs["seed"] = seed
            f.attrs["num_events"] = num_events
            f.attrs["class_names"] = json.dumps(list(CLASS_NAMES))
            f.attrs["content_hash"] = hasher.hexdigest()
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write the event file {path}: {exc}; choose a writable --out path") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a partial temp file behind (also on Ctrl-C)
        raise
    return path


# ----------------------------------------------------------------------------- the PILArNet-M layout


def _voxelised(e: dict[str, np.ndarray], seed: int, index: int, points_per_event: int | None) -> dict[str, np.ndarray]:
    """The generator's event in PILArNet-M's voxel grid: coordinates scaled from DETECTOR_SIZE to the
    VOXELS cube and floored to integer voxels; with `points_per_event`, each point first replicated
    m times with Gaussian offsets of PILARNET_SPREAD voxels (m chosen so the event has about that
    many voxels; each copy keeps its point's energy, so per-voxel energies and cuts behave as in the
    sparse event). One point per voxel and object fragment: the first one's energy and labels."""
    coord = e["coord"].astype(np.float64) * (VOXELS / DETECTOR_SIZE)
    n = len(coord)
    arrays = {k: e[k] for k in ("energy", "segment", "pid", "instance", "fragment")}
    if points_per_event is not None and n:
        rng = np.random.default_rng([seed, index, 768])  # its own stream: the objects stay as drawn
        noise = rng.normal(scale=PILARNET_SPREAD, size=(_MAX_COPIES * n, 3))
        fragments = _fragment_ids(arrays)
        copies = min(_MAX_COPIES, max(1, -(-points_per_event // n)))
        for _ in range(3):  # a denser spread merges more copies into one voxel: correct for it
            dense = np.repeat(coord, copies, axis=0) + noise[: copies * n]
            found = len(np.unique(_voxel_keys(dense, np.repeat(fragments, copies))))
            if found >= 0.9 * points_per_event or copies == _MAX_COPIES:
                break
            copies = min(_MAX_COPIES, int(np.ceil(copies * points_per_event / max(found, 1))))
        coord = dense
        arrays = {k: np.repeat(v, copies) for k, v in arrays.items()}
    voxel = np.clip(np.floor(coord), 0, VOXELS - 1)
    _, first = np.unique(_voxel_keys(voxel, _fragment_ids(arrays)), return_index=True)
    first.sort()  # the event's own order
    return {"coord": voxel[first].astype(np.float32), **{k: v[first] for k, v in arrays.items()}}


def _fragment_ids(e: dict[str, np.ndarray]) -> np.ndarray:
    """One int64 per point naming its object fragment (object, then fragment), in drawing order."""
    return e["instance"].astype(np.int64) * 4 + e["fragment"]


def _voxel_keys(coord: np.ndarray, fragment_ids: np.ndarray) -> np.ndarray:
    """One int64 per (fragment, voxel): equal keys are the same voxel of the same object fragment."""
    v = np.clip(np.floor(coord), 0, VOXELS - 1).astype(np.int64)
    return ((fragment_ids * VOXELS + v[:, 0]) * VOXELS + v[:, 1]) * VOXELS + v[:, 2]


def pilarnet_event(seed: int, index: int, revision: str = "v2", points_per_event: int | None = None
                   ) -> dict[str, np.ndarray]:
    """Event `index` of `seed` as PILArNet-M stores it: point (N, 8) float32 (integer voxel x, y, z in
    a VOXELS cube, energy, drift time, electrons, dx, 0) and cluster (K, 5|6) int64 rows, points
    stored cluster by cluster: the low-energy blips first (cluster and group id -1, as in PILArNet-M),
    then one cluster per object fragment in drawing order (a shower's trunk and sub-cascades are
    fragments with their own cluster ids under one group id); v2/v3 also cluster_extra (K, 5|6)
    float32: mass (MeV, by pid), momentum (a stand-in: the cluster's energy, MeV), the group's first
    voxel as vertex x, y, z, and in v3 is_primary (1 for tracks and showers). Also coord, energy,
    segment (uint8) and pid (int8) in stored order. `points_per_event`: about that many points
    (`_voxelised`); None: one per generated point (~550)."""
    if revision not in CLUSTER_COLUMNS:
        raise DataError(f"revision {revision!r} is unknown; use one of {', '.join(CLUSTER_COLUMNS)}")
    e = _voxelised(generate_event(seed, index), seed, index, points_per_event)
    blip = e["segment"] == LOW_ENERGY
    rank = np.where(blip, -1, _fragment_ids(e))
    order = np.argsort(rank, kind="stable")
    _, first, sizes = np.unique(rank[order], return_index=True, return_counts=True)
    coord, energy, segment, pid, instance = (e[k][order] for k in ("coord", "energy", "segment", "pid", "instance"))
    point = np.zeros((len(coord), POINT_COLUMNS), np.float32)
    point[:, :3], point[:, 3] = coord, energy
    point[:, 4] = coord[:, 0] * 0.5  # drift time, ~0.5 us per voxel
    point[:, 5] = energy / 23.6e-6  # ionisation electrons (W = 23.6 eV in argon)
    point[:, 6] = _UNIT_CM
    blip_cluster = segment[first] == LOW_ENERGY
    cluster_id = np.where(blip_cluster, -1, np.cumsum(~blip_cluster) - 1)
    # objects numbered 0.. in drawing order (the blips, drawn last, have the highest instance)
    group_id = np.where(blip_cluster, -1, np.unique(instance[first], return_inverse=True)[1])
    interaction = np.where(blip_cluster, -1, 0)
    # v1 [size, fragment, group, interaction, semantic]; v2/v3 [size, cluster_id, group_id, interaction_id,
    # semantic, pid]
    columns = [sizes, cluster_id, group_id, interaction, segment[first]]
    out = {"coord": coord, "energy": energy, "segment": segment, "pid": pid}
    if CLUSTER_COLUMNS[revision] == 6:
        columns.append(pid[first])
        extra = np.zeros((len(sizes), EXTRA_COLUMNS[revision]), np.float32)
        extra[:, 0] = np.where(pid[first] >= 0, np.asarray(_PID_MASS_MEV)[np.maximum(pid[first], 0)], 0.0)
        extra[:, 1] = np.add.reduceat(energy, first) if len(first) else 0.0
        groups, group_cluster = np.unique(group_id, return_index=True)  # each group's first cluster
        vertex = coord[first[group_cluster[np.searchsorted(groups, group_id)]]]
        extra[:, 2:5] = np.where(blip_cluster[:, None], 0.0, vertex)
        if revision == "v3":
            extra[:, 5] = np.isin(segment[first], (TRACK, SHOWER)) & ~blip_cluster
        out["cluster_extra"] = extra
    return {"point": point, "cluster": np.stack(columns, axis=1).astype(np.int64), **out}


def write_pilarnet_file(
    path: str | Path,
    events: list[dict[str, np.ndarray]],
    point_dtype: np.dtype | type = np.float32,
    cluster_dtype: np.dtype | type = np.int64,
    attrs: dict | None = None,
) -> Path:
    """Write events ({"point": (N, 8), "cluster": (K, C)[, "cluster_extra": (K, 5|6)]}) as one PILArNet-M
    shard: flat variable-length rows in `point`, `cluster` (and `cluster_extra` when every event has
    one). Written beside `path` and moved into place when complete; returns the path."""
    path = Path(path)
    tmp = path.with_suffix(".h5.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w") as f:
            names = ["point", "cluster"] + (["cluster_extra"] if all("cluster_extra" in e for e in events) else [])
            for name in names:
                dtype = {"point": point_dtype, "cluster": cluster_dtype}.get(name, np.float32)
                d = f.create_dataset(name, shape=(len(events),), dtype=h5py.vlen_dtype(np.dtype(dtype)))
                for i, event in enumerate(events):
                    d[i] = np.asarray(event[name], dtype=dtype).ravel()
            f.attrs.update(attrs or {})
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write the PILArNet file {path}: {exc}; choose a writable --out path") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_pilarnet(
    out: str | Path, num_events: int, seed: int, revision: str = "v2", shards: int = 1, split: str = "train",
    points_per_event: int | None = None,
) -> list[Path]:
    """Generate events 0..num_events-1 of `seed` in the PILArNet-M layout (`pilarnet_event`, about
    `points_per_event` points each when given); returns the shard paths.

    `out` ending in .h5 is one file; otherwise shards go to `<out>/<split>/<split>_NNN.h5`, events
    split evenly between them in order (read back with path=out, split=split)."""
    num_events = _check_int(num_events, "the number of events", 1)
    seed = _check_int(seed, "the seed", 0)
    shards = _check_int(shards, "the number of shards", 1)
    if points_per_event is not None:
        points_per_event = _check_int(points_per_event, "--points-per-event", 1)
    out = Path(out)
    if out.suffix == ".h5" and shards > 1:
        raise DataError(f"--out {out} is one file but --shards is {shards}; give a directory for several shards")
    if shards > num_events:
        raise DataError(f"{shards} shards need at least as many events, got {num_events}")
    paths = [out] if out.suffix == ".h5" else [out / split / f"{split}_{i:03d}.h5" for i in range(shards)]
    written = []
    for shard, indices in zip(paths, np.array_split(np.arange(num_events), shards)):
        events = [pilarnet_event(seed, int(i), revision, points_per_event) for i in indices]
        attrs = {"generator": GENERATOR, "generator_version": PILARNET_GENERATOR_VERSION, "seed": seed,
                 "revision": revision, "first_event": int(indices[0]), "points_per_event": int(points_per_event or 0)}
        written.append(write_pilarnet_file(shard, events, attrs=attrs))
    return written


def compute_content_hash(path: str | Path) -> str:
    """Recompute the content hash of an event file from its stored arrays (see `_ContentHasher`)."""
    hasher = _ContentHasher()
    with h5py.File(path, "r") as f:
        for name in DATASET_NAMES:
            d = f[name]
            step = 64 * CHUNK_ROWS
            for lo in range(0, d.shape[0], step):
                hasher.update(name, d[lo : lo + step])
    return hasher.hexdigest()


def describe(path: str | Path) -> dict:
    """Summary of an event file: {path, num_events, num_points, seed, content_hash, class_counts}."""
    from pimm.data.dataset import validate_event_file  # local import: dataset imports this module

    info = validate_event_file(path)
    counts = np.zeros(len(CLASS_NAMES), dtype=np.int64)
    try:
        with h5py.File(info["path"], "r") as f:
            seg = f["segment"]
            num_points = int(seg.shape[0])
            seed = int(f.attrs["seed"]) if "seed" in f.attrs else None
            step = 64 * CHUNK_ROWS
            for lo in range(0, num_points, step):
                counts += np.bincount(seg[lo : lo + step], minlength=len(CLASS_NAMES))[: len(CLASS_NAMES)]
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(
            f"cannot read the event file {info['path']}: {exc}; regenerate it with {synth_command(info['path'])}"
        ) from exc
    return {
        "path": info["path"],
        "num_events": info["num_events"],
        "num_points": num_points,
        "seed": seed,
        "content_hash": info["content_hash"],
        "class_counts": {name: int(c) for name, c in zip(CLASS_NAMES, counts)},
    }
