"""Point-cloud transforms of `data.<split>.transforms` (numpy arrays in and out; no torch).

An event is a dict of per-point arrays: coord (N,3) float, energy (N,), segment (N,) and
point_index (N,) int64 (each point's index in the stored event, so predictions of a transformed
event can be written back to the stored points). Transforms run in list order; each random one
draws from `np.random.default_rng([seed, epoch, event index, position in the list])`, so an event
is transformed identically at any world size, worker count and after a resume.

Coordinates stay in detector units (the models voxelise them); rotations, flips and scaling are
about the centre of the detector volume. `GridSample(return_grid_coord=True)` fixes the
coordinates the model voxelises at its place in the list, as the published pipeline's
`GridSample(return_grid_coord=True)` does: the transforms after it move only the points the
x, y, z feature columns are computed from (`Compose` hands the model the fixed ones). The feature
columns (names.FEATURE_COLUMNS) are computed by `feature_columns` in the dataset's `features` mode
("pimm" or "published") unless NormalizeCoord or LogEnergy set them; they compute the columns from
the points as they are at their place in the list (the config check refuses a transform after
them that would move the points or change the energies they used). Points dropped later
(GridSample, RandomCrop) drop their feature rows too.

The names, arguments and defaults are `pimm.names.TRANSFORMS`; the launcher's value checks are
`pimm.config.validate.check_transforms`, which `build_transforms` runs as well.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pimm import names
from pimm.config.validate import check_transforms
from pimm.data.event_format import DETECTOR_SIZE
from pimm.data.pilarnet_file import VOLUME_SIZE

Event = dict[str, np.ndarray]
DEFAULT_FEATURES = names.FEATURE_MODES[0]  # "pimm"; "published": the published PILArNet-M normalisation
PUBLISHED_ENERGY_RANGE = (0.01, 20.0)  # MeV: the published LogTransform's min_val, max_val (feature_columns)
_AXIS = {"x": 0, "y": 1, "z": 2}


class Transform:
    """One step: `__call__(event, rng, context)` -> event; `rng` is None for deterministic ones."""

    random = False

    def __init__(self, **arguments: Any) -> None:
        defaults = names.TRANSFORMS[type(self).__name__]
        self.arguments = {**defaults, **arguments}

    def __call__(self, event: Event, rng: np.random.Generator | None, context: dict) -> Event:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"{type(self).__name__}({args})"


def _select(event: Event, keep: np.ndarray) -> Event:
    """Every per-point array of `event` at the rows `keep` (indices or a mask)."""
    return {key: value[keep] for key, value in event.items()}


def _about_centre(event: Event, context: dict, matrix: np.ndarray) -> Event:
    centre = context["volume_size"] / 2.0
    moved = {key: ((event[key].astype(np.float64) - centre) @ matrix.T + centre).astype(np.float32)
             for key in _moving(event)}
    return {**event, **moved}


def _moving(event: Event) -> tuple[str, ...]:
    """What moves with the points: coord, and an instance target vertex (PILArNetDataset instances=True)
    while it is in the frame the model sees (after GridSample's return_grid_coord the model voxelises
    grid_coord, which stays)."""
    return ("coord", "vertex") if "vertex" in event and "grid_coord" not in event else ("coord",)


class RandomRotate(Transform):
    """With probability `p`, rotate about the axis `axis` through the volume centre by an angle drawn
    from `angle` (degrees)."""

    random = True

    def __call__(self, event, rng, context):
        if self.arguments["p"] < 1.0 and rng.random() >= self.arguments["p"]:  # p=1 draws the angle alone
            return event
        theta = np.deg2rad(rng.uniform(*self.arguments["angle"]))
        cos, sin = np.cos(theta), np.sin(theta)
        a = _AXIS[self.arguments["axis"]]
        b, c = [i for i in range(3) if i != a]
        matrix = np.eye(3)
        matrix[b, b], matrix[b, c], matrix[c, b], matrix[c, c] = cos, -sin, sin, cos
        return _about_centre(event, context, matrix)


class RandomFlip(Transform):
    """Mirror each axis of `axes` about the volume centre with probability `p`."""

    random = True

    def __call__(self, event, rng, context):
        draws = rng.random(len(self.arguments["axes"]))
        signs = np.ones(3)
        for axis, draw in zip(self.arguments["axes"], draws):
            if draw < self.arguments["p"]:
                signs[_AXIS[axis]] = -1.0
        return _about_centre(event, context, np.diag(signs))


class Jitter(Transform):
    """Add Gaussian noise of standard deviation `sigma` (coordinate units) to every coordinate, cut
    to [-clip, clip] when `clip` is set."""

    random = True

    def __call__(self, event, rng, context):
        noise = rng.normal(scale=self.arguments["sigma"], size=event["coord"].shape)
        if self.arguments["clip"] is not None:
            noise = np.clip(noise, -self.arguments["clip"], self.arguments["clip"])
        return {**event, "coord": (event["coord"] + noise).astype(np.float32)}


class RandomScale(Transform):
    """Scale all coordinates about the volume centre by one factor drawn from `scale` = [lo, hi]."""

    random = True

    def __call__(self, event, rng, context):
        return _about_centre(event, context, np.eye(3) * rng.uniform(*self.arguments["scale"]))


class GridSample(Transform):
    """Keep one point per occupied voxel of edge `grid_size`: the voxel's first point in the event's
    order (its label and coordinates); mode="sum" gives it the voxel's summed energy, mode="random"
    keeps a point of the voxel drawn at random (the published mode="train"). With
    `return_grid_coord` the kept coordinates are the ones the model voxelises: later transforms move
    only the points the x, y, z feature columns come from."""

    random = True  # mode="random" only

    def __call__(self, event, rng, context):
        cell = np.floor(event["coord"] / self.arguments["grid_size"]).astype(np.int64)
        _, first, inverse, counts = np.unique(cell, axis=0, return_index=True, return_inverse=True,
                                              return_counts=True)
        kept = first
        if self.arguments["mode"] == "random":
            members = np.argsort(inverse.reshape(-1), kind="stable")  # the points of each voxel together
            kept = members[np.cumsum(counts) - counts + (rng.random(len(counts)) * counts).astype(np.int64)]
        order = np.argsort(first, kind="stable")  # voxels in the order of their first points
        out = _select(event, kept[order])
        if self.arguments["mode"] == "sum":
            total = np.bincount(inverse.reshape(-1), weights=event["energy"], minlength=len(first))
            out["energy"] = total[order].astype(event["energy"].dtype)
        if self.arguments["return_grid_coord"]:
            out["grid_coord"] = out["coord"].copy()
        return out


class NormalizeCoord(Transform):
    """Feature x, y, z: the coordinates minus the event's mean, divided by its largest distance from it."""

    def __call__(self, event, rng, context):
        coord = event["coord"].astype(np.float64)
        centred = coord - coord.mean(axis=0) if len(coord) else coord
        radius = np.sqrt((centred**2).sum(axis=1)).max() if len(coord) else 0.0
        return {**event, "feat_coord": (centred / (radius if radius > 0 else 1.0)).astype(np.float32)}


class LogEnergy(Transform):
    """Feature log_energy: log1p(energy / scale) (scale None: the dataset's energy_scale)."""

    def __call__(self, event, rng, context):
        scale = self.arguments["scale"] or context["energy_scale"]
        return {**event, "feat_energy": np.log1p(event["energy"] / scale).astype(np.float32)}


class RandomCrop(Transform):
    """Keep the `max_points` points nearest to a randomly drawn point of the event (ties: the earlier
    point), in the event's order; an event with at most max_points points is kept whole."""

    random = True

    def __call__(self, event, rng, context):
        n, limit = len(event["coord"]), self.arguments["max_points"]
        centre = event["coord"][rng.integers(n)] if n else None  # drawn even when nothing is cropped
        if n <= limit:
            return event
        distance = ((event["coord"].astype(np.float64) - centre) ** 2).sum(axis=1)
        keep = np.sort(np.argsort(distance, kind="stable")[:limit])
        return _select(event, keep)


class CenterShift(Transform):
    """Move the event so that the centre of its bounding box is the volume centre (the published
    CenterShift puts it at 0 of the centred coordinates, which is the same point)."""

    def __call__(self, event, rng, context):
        coord = event["coord"].astype(np.float64)
        if not len(coord):
            return event
        shift = context["volume_size"] / 2.0 - (coord.min(axis=0) + coord.max(axis=0)) / 2.0
        return {**event, **{key: (event[key].astype(np.float64) + shift).astype(np.float32) for key in _moving(event)}}


class MomentumTransform(Transform):
    """Each of `keys` (per-point targets; absent ones are skipped): positive values p become log10(p), the
    others stay as they are. The published transform of the same name (pimm/datasets/transform.py:224-234),
    which the detector-v1m2 recipes put in front of their momentum regression: the model learns log10 p."""

    def __call__(self, event, rng, context):
        out = dict(event)
        for key in self.arguments["keys"]:
            if key in event:
                value = event[key]
                log = np.log10(np.clip(value, 1e-6, None))
                out[key] = np.where(value > 0, log, value).astype(value.dtype)
        return out


_CLASSES = {cls.__name__: cls for cls in (RandomRotate, RandomFlip, Jitter, RandomScale, GridSample, NormalizeCoord,
                                          LogEnergy, RandomCrop, CenterShift, MomentumTransform)}
assert tuple(_CLASSES) == tuple(names.TRANSFORMS), "pimm.names.TRANSFORMS and the transform classes differ"
assert {n for n, c in _CLASSES.items() if c.random} == set(names.RANDOM_TRANSFORMS)


class Compose:
    """The transforms of one split, applied in order to an event."""

    def __init__(self, transforms: list[Transform]) -> None:
        self.transforms = list(transforms)

    @property
    def drops_points(self) -> bool:
        """Whether an event may come out with fewer points than it went in with."""
        return any(isinstance(t, (GridSample, RandomCrop)) for t in self.transforms)

    def __call__(self, event: Event, seed: int, epoch: int, index: int, context: dict) -> Event:
        for position, transform in enumerate(self.transforms):
            # seeded by the sample and the place in the list alone: the same at any topology
            rng = np.random.default_rng([seed, epoch, index, position]) if transform.random else None
            event = transform(event, rng, context)
        if "grid_coord" in event:  # GridSample(return_grid_coord): the model sees the fixed coordinates
            grid = event.pop("grid_coord")
            event = {**event, "coord": grid, "feature_coord": event["coord"]}
        return event

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


def build_transforms(specs: list[dict] | None, where: str = "dataset") -> Compose | None:
    """`[dict(type="RandomRotate", axis="z"), ...]` -> Compose (None -> None); ConfigError for a list
    the config check refuses."""
    if specs is None:
        return None
    check_transforms({"transforms": specs}, where)
    return Compose([_CLASSES[spec["type"]](**{k: v for k, v in spec.items() if k != "type"}) for spec in specs])


def feature_columns(event: Event, volume_size: float, energy_scale: float, mode: str = DEFAULT_FEATURES) -> np.ndarray:
    """(N, 4) float32 feature columns x, y, z, log_energy (names.FEATURE_COLUMNS) of a transformed event.

    mode "pimm": x, y, z scaled to the volume (coord * 2 / volume_size - 1, so [-1, 1]) and
    log1p(energy / energy_scale). mode "published" (the published PILArNet-M recipes' NormalizeCoord
    and LogTransform): x, y, z in the unit ball around the volume centre,
    (coord - volume_size / 2) / (volume_size * sqrt(3) / 2), and the energy E (MeV) as
    2 * (log10(E + lo) - log10(lo)) / (log10(hi + lo) - log10(lo)) - 1 with (lo, hi) =
    PUBLISHED_ENERGY_RANGE, not clipped: -1 at 0 MeV, 1 at 20 MeV, 1.42 at 100 MeV.
    x, y, z come from event["feature_coord"] where GridSample(return_grid_coord) left it.
    NormalizeCoord / LogEnergy, when in the transforms, set their columns."""
    coord, energy = event.get("feature_coord", event["coord"]), event["energy"]
    feat = np.empty((len(coord), len(names.FEATURE_COLUMNS)), dtype=np.float32)
    published = mode == "published"
    if "feat_coord" in event:
        feat[:, :3] = event["feat_coord"]
    elif published:
        half = volume_size / 2.0
        feat[:, :3] = (coord.astype(np.float64) - half) / (half * np.sqrt(3.0))
    else:
        feat[:, :3] = coord * (2.0 / volume_size) - 1.0  # centred, roughly [-1, 1]
    if "feat_energy" in event:
        feat[:, 3] = event["feat_energy"]
    elif published:
        low, high = PUBLISHED_ENERGY_RANGE
        decades = np.log10(energy.astype(np.float64) + low) - np.log10(low)
        feat[:, 3] = 2.0 * decades / (np.log10(high + low) - np.log10(low)) - 1.0
    else:
        feat[:, 3] = np.log1p(energy / energy_scale)  # compresses the Landau tail
    return feat


def preprocessing(data: dict) -> dict[str, Any]:
    """How a model trained with the config section `data` computes its inputs: the evaluation reader's
    (data.test, else val, else train) dataset type, features mode, energy_scale and volume_size, and
    the transforms of data.test or data.val (never train's random augmentation). `pimm export`
    records it in config.json; `pimm predict` reads new data with it."""
    readers = [data.get(split) for split in ("test", "val", "train")]
    reader = next((r for r in readers if isinstance(r, dict)), {})
    kind = reader.get("type", "LArTPCDataset")
    evaluation = next((r for r in readers[:2] if isinstance(r, dict)), {})
    return {
        "dataset": kind,
        "features": reader.get("features", DEFAULT_FEATURES),
        "energy_scale": float(reader.get("energy_scale", 1.0)),
        "volume_size": float(reader.get("volume_size", VOLUME_SIZE)) if kind == "PILArNetDataset" else DETECTOR_SIZE,
        "transforms": evaluation.get("transforms"),
    }

