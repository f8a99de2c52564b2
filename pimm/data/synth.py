"""Synthetic LArTPC events: a physics-inspired generator, written in pimm's event format
(`pimm.data.event_format`) or in PILArNet-M's layout (`pimm.data.pilarnet_file`) through their modules.

An event is a set of 3D points (one per ~3 mm voxel pitch unit) with a deposited energy (MeV)
and one of five PILArNet semantic labels. Objects are drawn as in a liquid-argon TPC image:
tracks (muons, protons) with multiple scattering and a Bragg peak, Michel electrons at stopping
muon ends, delta rays branching off tracks, electromagnetic showers as branching cascades, and
isolated low-energy blips. Every event is a pure function of (seed, index).

Every file written here carries the attribute `generator` = GENERATOR: `write_dataset` and
`write_pilarnet` never replace an existing file unless asked (`overwrite`), and then only one
they wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pimm.data.event_format import CLASS_NAMES, DETECTOR_SIZE, write_event_file
from pimm.data.hdf5 import text_attribute
from pimm.data.pilarnet_file import (
    CLUSTER_COLUMNS,
    EXTRA_COLUMNS,
    POINT_COLUMNS,
    VOLUME_SIZE,
    write_pilarnet_file,
)
from pimm.errors import DataError
from pimm.files import os_error_reason

SHOWER, TRACK, MICHEL, DELTA, LOW_ENERGY = range(len(CLASS_NAMES))
PHOTON, ELECTRON, MUON, PION, PROTON = range(5)  # pilarnet_file.PID_NAMES
NO_PID = -1  # PILArNet-M's particle type of low-energy deposits
VOXELS = int(VOLUME_SIZE)  # the PILArNet-M layout's voxel cube: 768 per side
PILARNET_SPREAD = 1.0  # voxels: the Gaussian offsets of a densified event's point copies
MAX_COPIES = 32  # points_per_event: each generated point becomes at most this many voxels
ENOUGH_POINTS = 0.9  # points_per_event: an event densified to this share of the points asked for is close enough
_PID_MASS_MEV = (0.0, 0.511, 105.66, 139.57, 938.27)  # photon, electron, muon, pion, proton
_INTERACTION_STREAM = 7919  # generate_event(..., interaction=j > 0) draws from [seed, index, this + j]
MAX_INTERACTIONS = 3  # pilarnet_event: 1 to this many interactions per image

GENERATOR = "pimm.data.synth"  # the `generator` attribute of every file written here
GENERATOR_VERSION = 1
# 2: integer voxels in a 768 cube, cluster ids -1 for blips, shower fragments; 3: several interactions per
# image, the rain as interaction -1, momentum from each particle's kinetic energy, vertex the interaction's
PILARNET_GENERATOR_VERSION = 3

_UNIT_CM = 0.3  # one coordinate unit is a ~3 mm voxel pitch
_MIP_DEDX = 2.1  # MeV/cm deposited by a minimum-ionising particle in liquid argon


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


def generate_event(seed: int, index: int, interaction: int = 0) -> dict[str, np.ndarray]:
    """Event `index` of the synthetic data set `seed`: coord (N,3) float32, energy (N,) float32,
    segment (N,) uint8, and per point the object it belongs to, instance (N,) int32 (tracks,
    Michels, deltas and showers in drawing order, the low-energy blips last), and that object's
    particle type, pid (N,) int8 (pilarnet_file.PID_NAMES; -1 for blips, as in PILArNet-M), and the
    fragment of its object, fragment (N,) int8 (a shower's trunk 0 and sub-cascades 1, 2; 0 elsewhere).
    Also per point whether its object comes from the event's interaction vertex, primary (N,) bool
    (tracks and showers starting there, and the Michels and deltas of those tracks; the others cross
    the volume from anywhere: the "rain"), and the object's origin (N,3) float32 (the vertex for
    primaries, its own start for the rain; blips: the vertex), and vertex (3,) float32.
    A pure function of (seed, index, interaction) (non-negative integers); `interaction` > 0 draws
    another interaction of the same event (pilarnet_event puts several in one image), interaction 0
    is the event pimm's event files hold."""
    stream = [seed, index] if interaction == 0 else [seed, index, _INTERACTION_STREAM + interaction]
    rng = np.random.default_rng(stream)
    parts: list[tuple] = []  # (points, energies, semantic, pid, fragment: 0 or one per point) per object
    origins: list[tuple[bool, np.ndarray]] = []  # (primary, origin) per object, as parts

    vertex = rng.uniform(40.0, DETECTOR_SIZE - 40.0, size=3)  # neutrino-like interaction vertex
    n_tracks = int(rng.integers(1, 4))
    for t in range(n_tracks):
        proton = t > 0 and rng.random() < 0.5  # the first track is always a muon
        from_vertex = rng.random() < 0.6
        start = vertex if from_vertex else rng.uniform(10.0, DETECTOR_SIZE - 10.0, size=3)
        direction = _random_dirs(rng, 1)[0]
        pts, energy, stops = _track(rng, start, direction, proton)
        parts.append((pts, energy, TRACK, PROTON if proton else MUON, 0))
        origins.append((from_vertex, start))
        if not proton and stops and rng.random() < 0.6:
            end_dir = _random_dirs(rng, 1)[0]
            kinks = int(rng.integers(1, 4))
            m_pts, m_e = _electron(rng, pts[-1], end_dir, rng.uniform(10.0, 35.0), 0.8, 0.05, kinks, _MIP_DEDX)
            parts.append((m_pts, m_e, MICHEL, ELECTRON, 0))
            origins.append((from_vertex, start))
        for _ in range(int(rng.integers(0, 4))):
            at = int(rng.integers(int(0.1 * len(pts)), max(int(0.85 * len(pts)), int(0.1 * len(pts)) + 1)))
            local = _unit(pts[min(at + 3, len(pts) - 1)] - pts[max(at - 3, 0)])
            d_dir = _tilt(rng, local[None], np.array([rng.uniform(0.8, 1.5)]))[0]
            d_pts, d_e = _electron(rng, pts[at], d_dir, rng.uniform(3.0, 12.0), 0.7, 0.15, 0, 0.6 * _MIP_DEDX)
            parts.append((d_pts, d_e, DELTA, ELECTRON, 0))
            origins.append((from_vertex, start))

    for _ in range(int(rng.choice(3, p=[0.15, 0.45, 0.4]))):
        at_vertex = rng.random() < 0.5
        origin = vertex if at_vertex else rng.uniform(20.0, DETECTOR_SIZE - 20.0, size=3)
        s_pts, s_e, photon, s_fragment = _shower(rng, origin, _random_dirs(rng, 1)[0])
        parts.append((s_pts, s_e, SHOWER, PHOTON if photon else ELECTRON, s_fragment))
        origins.append((at_vertex, origin))

    activity = np.concatenate([p for p, *_ in parts])
    b_pts, b_e = _blips(rng, activity)
    parts.append((b_pts, b_e, LOW_ENERGY, NO_PID, 0))
    origins.append((False, vertex))

    coord = np.concatenate([p for p, *_ in parts]).astype(np.float32)
    energy = np.concatenate([e for _, e, *_ in parts]).astype(np.float32)
    segment = np.concatenate([np.full(len(p), label, dtype=np.uint8) for p, _, label, *_ in parts])
    instance = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, (p, *_) in enumerate(parts)])
    pid = np.concatenate([np.full(len(p), kind, dtype=np.int8) for p, _, _, kind, _ in parts])
    fragment = np.concatenate([np.broadcast_to(np.asarray(f, np.int8), len(p)) for p, *_, f in parts])
    primary = np.concatenate([np.full(len(p), first, bool) for (p, *_), (first, _) in zip(parts, origins)])
    origin = np.concatenate([np.broadcast_to(np.asarray(o, np.float32), (len(p), 3))
                             for (p, *_), (_, o) in zip(parts, origins)])
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
        "primary": primary[keep][order],
        "origin": np.ascontiguousarray(origin[keep][order]),
        "vertex": vertex.astype(np.float32),
    }


# ----------------------------------------------------------------------------- files


def _check_int(value: object, name: str, minimum: int) -> int:
    """`value` as an int >= minimum, else a DataError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def written_here(path: str | Path) -> bool:
    """Whether `path` is an HDF5 file this generator wrote (its `generator` attribute is GENERATOR)."""
    return text_attribute(path, "generator") == GENERATOR


def _check_targets(paths: list[Path], overwrite: bool) -> None:
    """DataError for an existing file among `paths`, unless `overwrite` and the generator wrote it."""
    for path in paths:
        if not os.path.lexists(path):
            continue
        if path.is_dir():
            raise DataError(f"--out {path} is a directory; give the path of a .h5 file to write")
        if not overwrite:
            raise DataError(f"{path} exists; pimm data synth does not replace files unasked: give a new --out, or "
                            "add --overwrite to replace a file pimm data synth wrote")
        if not written_here(path):
            raise DataError(f"{path} exists and pimm data synth did not write it (it has no generator attribute "
                            f"{GENERATOR!r}); --overwrite only replaces generated files: give another --out, or "
                            "move that file away yourself")


def _cannot_write(path: Path, exc: OSError) -> DataError:
    """One line: which file could not be written, why, and what to do."""
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    reason = f"{blocker} is a file, not a directory" if blocker is not None else os_error_reason(exc)
    return DataError(f"cannot write {path}: {reason}; give a --out in a writable directory")


def write_dataset(path: str | Path, num_events: int, seed: int, overwrite: bool = False) -> Path:
    """Generate events 0..num_events-1 of `seed` into a pimm event file at `path` (through
    `pimm.data.event_format.write_event_file`: complete or not at all); returns the path.

    An existing `path` is a DataError, unless `overwrite` and this generator wrote it; so is a path
    that cannot be written (one line: the path, the reason, what to do)."""
    num_events = _check_int(num_events, "the number of events", 1)
    seed = _check_int(seed, "the seed", 0)
    path = Path(path)
    _check_targets([path], overwrite)
    events = (generate_event(seed, i) for i in range(num_events))
    attrs = {"generator": GENERATOR, "generator_version": GENERATOR_VERSION, "seed": seed}
    try:
        return write_event_file(path, events, attrs)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc


# ----------------------------------------------------------------------------- the PILArNet-M layout


def _voxelised(e: dict[str, np.ndarray], seed: int, index: int, points_per_event: int | None) -> dict[str, np.ndarray]:
    """The generator's event in PILArNet-M's voxel grid: coordinates scaled from DETECTOR_SIZE to the
    VOXELS cube and floored to integer voxels; with `points_per_event`, each point first replicated
    m times with Gaussian offsets of PILARNET_SPREAD voxels (m chosen so the event has about that
    many voxels; each copy keeps its point's energy, so per-voxel energies and cuts behave as in the
    sparse event). One point per voxel and object fragment: the first one's energy and labels."""
    coord = e["coord"].astype(np.float64) * (VOXELS / DETECTOR_SIZE)
    n = len(coord)
    arrays = {k: e[k] for k in ("energy", "segment", "pid", "instance", "fragment", "interaction") if k in e}
    if points_per_event is not None and n:
        rng = np.random.default_rng([seed, index, 768])  # its own stream: the objects stay as drawn
        noise = rng.normal(scale=PILARNET_SPREAD, size=(MAX_COPIES * n, 3))
        fragments = _fragment_ids(arrays)
        copies = min(MAX_COPIES, max(1, -(-points_per_event // n)))
        for _ in range(3):  # a denser spread merges more copies into one voxel: correct for it
            dense = np.repeat(coord, copies, axis=0) + noise[: copies * n]
            found = len(np.unique(_voxel_keys(dense, np.repeat(fragments, copies))))
            if found >= ENOUGH_POINTS * points_per_event or copies == MAX_COPIES:
                break
            copies = min(MAX_COPIES, int(np.ceil(copies * points_per_event / max(found, 1))))
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


def _interactions(seed: int, index: int) -> dict[str, np.ndarray]:
    """Event `index` of `seed` as one image of 1 to MAX_INTERACTIONS interactions (generate_event's
    interaction 0, 1, ...), each with its vertex, its particles and its rain, overlaid in one volume:
    the per-point arrays concatenated with instance ids made unique across interactions, interaction
    (N,) int64 (the interaction's number for its primaries, -1 for the rain and the blips), and per
    object (indexed by instance) its kinetic energy (MeV: its deposited energy), origin (3,) and pid."""
    count = int(np.random.default_rng([seed, index, _INTERACTION_STREAM]).integers(1, MAX_INTERACTIONS + 1))
    subs = [generate_event(seed, index, j) for j in range(count)]
    offsets = np.cumsum([0] + [int(sub["instance"].max()) + 1 if len(sub["instance"]) else 0 for sub in subs])
    instance = np.concatenate([sub["instance"].astype(np.int64) + offsets[j] for j, sub in enumerate(subs)])
    e = {k: np.concatenate([sub[k] for sub in subs]) for k in ("coord", "energy", "segment", "pid", "fragment")}
    e["instance"] = instance.astype(np.int32)
    e["interaction"] = np.concatenate([np.where(sub["primary"] & (sub["segment"] != LOW_ENERGY), j, -1)
                                       for j, sub in enumerate(subs)]).astype(np.int64)
    objects = int(offsets[-1])
    e["object_energy"] = np.bincount(instance, weights=e["energy"], minlength=objects)
    e["object_origin"] = np.zeros((objects, 3), np.float64)
    e["object_origin"][instance] = np.concatenate([sub["origin"] for sub in subs])
    e["object_pid"] = np.full(objects, NO_PID, np.int64)
    e["object_pid"][instance] = e["pid"]
    return e


def pilarnet_event(seed: int, index: int, revision: str = "v2", points_per_event: int | None = None
                   ) -> dict[str, np.ndarray]:
    """Event `index` of `seed` as PILArNet-M stores it: point (N, 8) float32 (integer voxel x, y, z in
    a VOXELS cube, energy, drift time, electrons, dx, 0) and cluster (K, 5|6) int64 rows, points
    stored cluster by cluster: the low-energy blips first (cluster and group id -1, as in PILArNet-M),
    then one cluster per object fragment in drawing order (a shower's trunk and sub-cascades are
    fragments with their own cluster ids under one group id). An image holds 1 to MAX_INTERACTIONS
    interactions (`_interactions`): the interaction id of a cluster is its interaction's number for
    the particles from that interaction's vertex, -1 for the rain (particles from no common vertex)
    and the blips. v2/v3 also cluster_extra (K, 5|6) float32: mass (MeV, by pid), momentum (MeV/c,
    of the cluster's particle: sqrt(T^2 + 2 T m) with T its deposited energy), vertex x, y, z (the
    interaction's vertex for its particles, the particle's own start for the rain, in voxels; 0 for
    blips), and in v3 is_primary (1 for tracks and showers). Also coord, energy, segment (uint8), pid
    (int8) and interaction (int64) in stored order. `points_per_event`: about that many points
    (`_voxelised`); None: one per generated point."""
    if revision not in CLUSTER_COLUMNS:
        raise DataError(f"revision {revision!r} is unknown; use one of {', '.join(CLUSTER_COLUMNS)}")
    composed = _interactions(seed, index)
    e = _voxelised(composed, seed, index, points_per_event)
    blip = e["segment"] == LOW_ENERGY
    rank = np.where(blip, -1, _fragment_ids(e))
    order = np.argsort(rank, kind="stable")
    _, first, sizes = np.unique(rank[order], return_index=True, return_counts=True)
    coord, energy, segment, pid, instance, interaction = (
        e[k][order] for k in ("coord", "energy", "segment", "pid", "instance", "interaction"))
    point = np.zeros((len(coord), POINT_COLUMNS), np.float32)
    point[:, :3], point[:, 3] = coord, energy
    point[:, 4] = coord[:, 0] * 0.5  # drift time, ~0.5 us per voxel
    point[:, 5] = energy / 23.6e-6  # ionisation electrons (W = 23.6 eV in argon)
    point[:, 6] = _UNIT_CM
    blip_cluster = segment[first] == LOW_ENERGY
    cluster_id = np.where(blip_cluster, -1, np.cumsum(~blip_cluster) - 1)
    # objects numbered 0.. in drawing order (the blips, drawn last, have the highest instance)
    group_id = np.where(blip_cluster, -1, np.unique(instance[first], return_inverse=True)[1])
    cluster_interaction = np.where(blip_cluster, -1, interaction[first])
    # v1 [size, fragment, group, interaction, semantic]; v2/v3 [size, cluster_id, group_id, interaction_id,
    # semantic, pid]
    columns = [sizes, cluster_id, group_id, cluster_interaction, segment[first]]
    out = {"coord": coord, "energy": energy, "segment": segment, "pid": pid, "interaction": interaction}
    if CLUSTER_COLUMNS[revision] == 6:
        columns.append(pid[first])
        extra = np.zeros((len(sizes), EXTRA_COLUMNS[revision]), np.float32)
        objects = instance[first].astype(np.int64)
        mass = np.where(pid[first] >= 0, np.asarray(_PID_MASS_MEV)[np.maximum(pid[first], 0)], 0.0)
        kinetic = composed["object_energy"][objects]
        extra[:, 0] = mass
        extra[:, 1] = np.where(blip_cluster, 0.0, np.sqrt(kinetic**2 + 2.0 * kinetic * mass))
        vertex = composed["object_origin"][objects] * (VOXELS / DETECTOR_SIZE)
        extra[:, 2:5] = np.where(blip_cluster[:, None], 0.0, vertex)
        if revision == "v3":
            extra[:, 5] = np.isin(segment[first], (TRACK, SHOWER)) & ~blip_cluster
        out["cluster_extra"] = extra
    return {"point": point, "cluster": np.stack(columns, axis=1).astype(np.int64), **out}


def write_pilarnet(
    out: str | Path, num_events: int, seed: int, revision: str = "v2", shards: int = 1, split: str = "train",
    points_per_event: int | None = None, overwrite: bool = False,
) -> list[Path]:
    """Generate events 0..num_events-1 of `seed` in the PILArNet-M layout (`pilarnet_event`, about
    `points_per_event` points each when given), each shard written through
    `pimm.data.pilarnet_file.write_pilarnet_file`; returns the shard paths.

    `out` ending in .h5 is one file; otherwise shards go to `<out>/<split>/<split>_NNN.h5`, events
    split evenly between them in order (read back with path=out, split=split). An existing shard
    is a DataError unless `overwrite` and this generator wrote it, and so is another .h5 file in
    `<out>/<split>`, which a reader would mix with the new shards."""
    num_events = _check_int(num_events, "the number of events", 1)
    seed = _check_int(seed, "the seed", 0)
    shards = _check_int(shards, "the number of shards", 1)
    if points_per_event is not None:
        points_per_event = _check_int(points_per_event, "--points-per-event", 1)
    if revision not in CLUSTER_COLUMNS:
        raise DataError(f"revision {revision!r} is unknown; use one of {', '.join(CLUSTER_COLUMNS)}")
    out = Path(out)
    if out.suffix == ".h5" and shards > 1:
        raise DataError(f"--out {out} is one file but --shards is {shards}; give a directory for several shards")
    if shards > num_events:
        raise DataError(f"{shards} shards need at least as many events, got {num_events}")
    paths = [out] if out.suffix == ".h5" else [out / split / f"{split}_{i:03d}.h5" for i in range(shards)]
    _check_targets(paths, overwrite)
    if out.suffix != ".h5" and (out / split).is_dir():
        others = sorted(p.name for p in (out / split).glob("*.h5") if p not in paths)
        if others:
            raise DataError(f"{out / split} also holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, "
                            f"which a reader of {out} would mix with the {shards} new shard(s); move them away or "
                            "give another --out")
    written = []
    for shard, indices in zip(paths, np.array_split(np.arange(num_events), shards)):
        events = [pilarnet_event(seed, int(i), revision, points_per_event) for i in indices]
        attrs = {"generator": GENERATOR, "generator_version": PILARNET_GENERATOR_VERSION, "seed": seed,
                 "revision": revision, "first_event": int(indices[0]), "points_per_event": int(points_per_event or 0)}
        try:
            written.append(write_pilarnet_file(shard, events, attrs=attrs))
        except OSError as exc:
            raise _cannot_write(shard, exc) from exc
    return written


def distinct_voxels(points: int, seed: int, event: int) -> np.ndarray:
    """`points` distinct integer voxels (points, 3) of generated PILArNet-M-like event `event` of `seed`,
    drawings of `pilarnet_event` overlaid until there are enough (for benchmarks at a given event size)."""
    drawn: list[np.ndarray] = []
    distinct = np.empty((0, 3), np.int64)
    for drawing in range(1000):
        drawn.append(pilarnet_event(seed, event * 1000 + drawing, points_per_event=points)["coord"].astype(np.int64))
        stacked = np.concatenate(drawn)
        _, first = np.unique(stacked, axis=0, return_index=True)
        distinct = stacked[np.sort(first)]  # the drawing order, each voxel once
        if len(distinct) >= points:
            return distinct[:points]
    raise DataError(f"the generator gave only {len(distinct)} distinct voxels for {points} asked")
