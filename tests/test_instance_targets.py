"""PILArNetDataset(instances=True): per-point particle, interaction, pid, momentum and vertex targets read
back exactly from generated v1/v2/v3 shards, carried through transforms and collation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pimm.data.collate import collate_events, split_events
from pimm.data.dataset import PILArNetDataset
from pimm.data.pilarnet_file import PID_NAMES, dense_instances
from pimm.data.synth import pilarnet_event, write_pilarnet
from pimm.errors import ConfigError

SEED, EVENTS = 23, 5


def expected(event: dict, threshold: float) -> dict[str, np.ndarray]:
    """The targets of one generated event, from the generator's own arrays (not through the reader)."""
    cluster, point = event["cluster"], event["point"]
    keep = point[:, 3] > threshold
    group = np.repeat(cluster[:, 2], cluster[:, 0])[keep]
    interaction = np.repeat(cluster[:, 3], cluster[:, 0])[keep]
    out = {}
    for name, ids in (("particle", group), ("interaction", interaction)):
        # dense 0..K-1 in id order, -1 for negative ids: built here by a dictionary, not by dense_instances
        table = {g: i for i, g in enumerate(sorted({int(g) for g in ids if g >= 0}))}
        out[name] = np.array([table.get(int(g), -1) for g in ids], np.int64)
    if cluster.shape[1] == 6:
        pid = np.repeat(cluster[:, 5], cluster[:, 0])[keep]
        out["pid"] = np.where(pid < 0, PID_NAMES.index("none"), pid)
        extra = event["cluster_extra"]
        out["momentum"] = np.repeat(extra[:, 1], cluster[:, 0])[keep]
        out["vertex"] = np.repeat(extra[:, 2:5], cluster[:, 0], axis=0)[keep]
    return out


@pytest.mark.parametrize("revision", ["v1", "v2", "v3"])
def test_targets_read_back_exactly_from_generated_shards(tmp_path, revision):
    write_pilarnet(tmp_path, EVENTS, seed=SEED, revision=revision, split="train", points_per_event=400)
    dataset = PILArNetDataset(tmp_path, revision=revision, energy_threshold=0.13, instances=True)
    assert len(dataset) == EVENTS
    for index in range(EVENTS):
        item, want = dataset[index], expected(pilarnet_event(SEED, index, revision, points_per_event=400), 0.13)
        assert set(want) <= set(item) and len(item["particle"]) == len(item["coord"])
        for key, value in want.items():
            np.testing.assert_array_equal(item[key].numpy(), value, err_msg=key)
        assert item["particle"].max() >= 1  # several particles per event
    plain = PILArNetDataset(tmp_path, revision=revision, energy_threshold=0.13)
    assert not set(plain[0]) & {"particle", "interaction", "pid", "momentum", "vertex"}  # off by default


def test_targets_follow_transforms_and_collation(tmp_path):
    write_pilarnet(tmp_path, 4, seed=SEED, revision="v2", split="train", points_per_event=400)
    rotate = [dict(type="RandomRotate", axis="z", angle=[90, 90]), dict(type="RandomCrop", max_points=150)]
    plain = PILArNetDataset(tmp_path, revision="v2", instances=True)
    moved = PILArNetDataset(tmp_path, revision="v2", instances=True, transforms=rotate)
    a, b = plain[(0, 1)], moved[(0, 1)]
    rows = moved.point_index((0, 1))  # the stored points the crop kept
    stored = plain.point_index((0, 1))
    where = {int(r): i for i, r in enumerate(stored)}
    picked = [where[int(r)] for r in rows]
    for key in ("particle", "interaction", "pid", "momentum"):
        np.testing.assert_array_equal(b[key].numpy(), a[key].numpy()[picked], err_msg=key)
    # a quarter turn about z through the volume centre: the vertex turns with the points
    centre = 384.0
    x, y = a["vertex"][picked, 0].double() - centre, a["vertex"][picked, 1].double() - centre
    torch.testing.assert_close(b["vertex"][:, 0].double() - centre, -y, atol=1e-3, rtol=0)
    torch.testing.assert_close(b["vertex"][:, 1].double() - centre, x, atol=1e-3, rtol=0)
    batch = collate_events([plain[i] for i in range(4)])
    assert batch["particle"].shape == batch["segment"].shape and batch["vertex"].shape == batch["coord"].shape
    halves = split_events(batch, 2)
    assert torch.equal(torch.cat([h["particle"] for h in halves]), batch["particle"])


def test_dense_instances_and_refusals(tmp_path):
    assert dense_instances(np.array([7, -1, 3, 7, 12, -5])).tolist() == [1, -1, 0, 1, 2, -1]
    write_pilarnet(tmp_path, 2, seed=SEED, revision="v1", split="train", points_per_event=200)
    with pytest.raises(ConfigError, match="instances=True with augment=True"):
        PILArNetDataset(tmp_path, revision="v1", instances=True, augment=True)


def test_generated_images_hold_several_interactions_and_the_rain():
    """pimm's PILArNet-M events: 1 to 3 interactions, each with its vertex and several particles from it,
    plus particles from no common vertex (interaction -1); momentum sqrt(T^2 + 2Tm) of each particle."""
    counts, rain = [], 0
    for index in range(12):
        e = pilarnet_event(SEED, index, "v2")
        cluster, extra = e["cluster"], e["cluster_extra"]
        interactions = sorted({int(i) for i in cluster[:, 3] if i >= 0})
        counts.append(len(interactions))
        rain += int(((cluster[:, 3] == -1) & (cluster[:, 2] >= 0)).sum())
        for j in interactions:
            members = cluster[:, 3] == j
            assert len(np.unique(extra[members, 2:5], axis=0)) == 1  # one vertex per interaction
        assert (extra[:, 1] >= 0).all()
    assert max(counts) >= 2 and rain > 0
    assert e["interaction"].shape == e["segment"].shape
