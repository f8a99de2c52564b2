"""Particle instances by DBSCAN on the points of each semantic class: the baseline a learned detector
must beat, scored with pimm's panoptic metrics on generated PILArNet-M-layout events.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/panoptic.py [--events 200] [--points-per-event 4000]
                                                              [--eps 1.9,4,8] [--min-samples 1] [--out FILE]

Events: `pimm data synth --layout pilarnet --revision v2` (1 to 3 interactions and the rain per
image), read with `PILArNetDataset(instances=True, energy_threshold=0.13)`. Truth: the particle
instances (group ids; the low-energy deposits are stuff) with their majority motif class. Baseline:
scikit-learn's DBSCAN on the voxels of each non-stuff motif class separately, each cluster one
instance of that class, one row per eps (in voxels: 1.9 joins the 26 neighbours of a voxel; pimm's
generated events leave gaps of a few voxels along a particle, which larger radii bridge). Given the true semantic
labels here; given a model's predicted labels once a semantic model is passed (not yet: the query
detector and its training are not in pimm yet, so this prints the baseline alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.cluster import DBSCAN

from pimm.data.dataset import PILArNetDataset
from pimm.data.pilarnet_file import MOTIF_NAMES
from pimm.data.synth import write_pilarnet
from pimm.tasks.panoptic_metrics import PanopticAccumulator

STUFF = MOTIF_NAMES.index("low_energy")
COLUMNS = ("ari_all_labelled", "ari_predicted_things", "purity", "efficiency", "pq", "detection_f1")


def dbscan_instances(coord: np.ndarray, semantic: np.ndarray, eps: float, min_samples: int) -> np.ndarray:
    """Per-point instance ids (-1: stuff or noise): DBSCAN on the points of each non-stuff class."""
    instance = np.full(len(coord), -1, np.int64)
    next_id = 0
    for cls in np.unique(semantic):
        if cls < 0 or cls == STUFF:
            continue
        rows = np.flatnonzero(semantic == cls)
        labels = DBSCAN(eps=eps, min_samples=min_samples).fit_predict(coord[rows])
        found = labels >= 0
        instance[rows[found]] = labels[found] + next_id
        next_id += int(labels.max()) + 1 if found.any() else 0
    return instance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=200, help="generated events (default 200)")
    p.add_argument("--points-per-event", type=int, default=4000, help="about this many voxels per event (default 4000)")
    p.add_argument("--eps", default="1.9,4,8", help="DBSCAN radii in voxels, one row each (default 1.9,4,8)")
    p.add_argument("--min-samples", type=int, default=1, help="DBSCAN min_samples (default 1)")
    p.add_argument("--seed", type=int, default=7, help="generator seed (default 7)")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pimm-bench-panoptic-") as tmp:
        write_pilarnet(tmp, args.events, seed=args.seed, revision="v2", split="train",
                       points_per_event=args.points_per_event)
        events = PILArNetDataset(tmp, revision="v2", energy_threshold=0.13, instances=True)
        radii = [float(e) for e in args.eps.split(",")]
        meters = {eps: PanopticAccumulator(num_classes=len(MOTIF_NAMES), stuff_classes=(STUFF,),
                                           class_names=MOTIF_NAMES) for eps in radii}
        start = time.perf_counter()
        points = 0
        for index in range(len(events)):
            item = events[index]
            coord, semantic = item["coord"].numpy(), item["segment"].numpy()
            truth = item["particle"].numpy()
            for eps, meter in meters.items():
                meter.update(index, truth, dbscan_instances(coord, semantic, eps, args.min_samples), semantic, semantic)
            points += len(coord)
        seconds = time.perf_counter() - start
    results = {eps: meter.result() for eps, meter in meters.items()}
    print(f"{len(events)} generated events, {points / len(events):.0f} voxels each on average; DBSCAN min_samples "
          f"{args.min_samples}: {1000 * seconds / len(events) / len(radii):.1f} ms per event and radius\n")
    print("| method | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for eps, result in results.items():
        print(f"| DBSCAN eps {eps:g}, true semantics | " + " | ".join(f"{result[c]:.3f}" for c in COLUMNS) + " |")
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                        "dbscan_true": {str(e): r for e, r in results.items()}}, default=float) + "\n")


if __name__ == "__main__":
    sys.exit(main())
