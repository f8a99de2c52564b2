"""The PILArNet-M reader on generated shards: exact read-back, the cached index, selection, ignore
labels, multi-shard layouts, the launcher's torch-free checks, and one short real run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO, attempts, losses, run_pimm, steps
from torch.utils.data import DataLoader

from pimm.cli import main
from pimm.config import load_config
from pimm.config.validate import check_config
from pimm.data import index_cache, pilarnet_file
from pimm.data.collate import collate_events
from pimm.data.dataset import PILArNetDataset, build_dataset
from pimm.data.event_file import validate_data
from pimm.data.index_cache import index_path
from pimm.data.pilarnet_file import open_pilarnet, write_pilarnet_file
from pimm.data.synth import LOW_ENERGY, generate_event, pilarnet_event, write_pilarnet
from pimm.errors import ConfigError, DataError
from pimm.tasks import event_mean_loss
from pimm.tasks.metrics import SegmentationMeter


def _stored(seed: int, index: int) -> tuple[dict, np.ndarray]:
    """The generator's event and the order PILArNet-M stores its points in (blips, then objects)."""
    e = generate_event(seed, index)
    return e, np.argsort(np.where(e["segment"] == LOW_ENERGY, -1, e["instance"]), kind="stable")


def _event(clusters: list[list[int]], revision: str = "v2", seed: int = 0) -> dict:
    """A hand-made event with the given cluster rows and random points."""
    cluster = np.array(clusters, np.int64).reshape(-1, pilarnet_file.CLUSTER_COLUMNS[revision])
    rng = np.random.default_rng(seed)
    point = rng.uniform(1.0, 255.0, size=(int(cluster[:, 0].sum()), 8)).astype(np.float32)
    return {"point": point, "cluster": cluster}


@pytest.mark.parametrize("revision", ["v1", "v2", "v3"])
def test_generated_shard_reads_back_the_generators_points_and_labels(tmp_path: Path, revision: str) -> None:
    (path,) = write_pilarnet(tmp_path / "one.h5", 6, seed=4, revision=revision)
    labels = ["motif", "pid"] if revision != "v1" else ["motif"]
    sets = {label: PILArNetDataset(path, revision=revision, label=label) for label in labels}
    assert len(sets["motif"]) == 6 and sets["motif"].info["num_events"] == 6
    for i in range(6):
        e = pilarnet_event(4, i, revision)  # the generator's event in stored order
        raw = sets["motif"].read_raw(i)
        assert raw["point"].shape == (len(e["coord"]), 8)
        assert raw["cluster"].shape[1] == (5 if revision == "v1" else 6)
        np.testing.assert_array_equal(raw["coord"], e["coord"])
        np.testing.assert_array_equal(raw["energy"], e["energy"])
        np.testing.assert_array_equal(raw["segment"], e["segment"])
        if revision != "v1":  # pid -1 (the low-energy deposits) is class 5 "none" by default
            np.testing.assert_array_equal(sets["pid"].read_raw(i)["segment"], np.where(e["pid"] < 0, 5, e["pid"]))
        item = sets["motif"][(0, i)]
        assert item["event_id"] == i and item["feat"].shape == (len(e["coord"]), 4)
        assert item["coord"].dtype == torch.float32 and item["segment"].dtype == torch.int64
        assert torch.equal(item["segment"], torch.from_numpy(e["segment"].astype(np.int64)))
        assert float(item["feat"][:, :3].min()) >= -1.0 and float(item["feat"][:, :3].max()) <= 1.0  # 768 cube
    batch = collate_events([sets["motif"][i] for i in range(3)])
    assert batch["offset"].tolist()[-1] == len(batch["coord"])


def test_synthetic_shards_have_the_published_layout(tmp_path: Path) -> None:
    """Integer voxels in the 768 cube; v2/v3 cluster rows [size, cluster_id, group_id, interaction_id,
    semantic, pid] with the low-energy cluster first and ids -1; shower fragments under one group;
    cluster_extra 5 (v2) or 6 (v3: mass, momentum, vertex x/y/z, is_primary) per cluster."""
    for revision, width in (("v2", 5), ("v3", 6)):
        root = tmp_path / revision
        write_pilarnet(root, 30, seed=12, revision=revision, shards=2)
        assert pilarnet_file.detect_revision(root) == revision
        fragments = interactions = 0
        for shard in sorted(root.glob("train/*.h5")):
            with h5py.File(shard) as f:
                assert set(f) == {"point", "cluster", "cluster_extra"}
                for point_row, cluster_row, extra_row in zip(f["point"], f["cluster"], f["cluster_extra"]):
                    point, cluster = point_row.reshape(-1, 8), cluster_row.reshape(-1, 6)
                    extra = extra_row.reshape(-1, width)
                    assert len(extra) == len(cluster) and cluster[:, 0].sum() == len(point)
                    assert np.array_equal(point[:, :3], np.floor(point[:, :3]))
                    assert point[:, :3].min() >= 0 and point[:, :3].max() <= 767
                    size, cluster_id, group_id, interaction, semantic, pid = cluster.T
                    assert semantic[0] == LOW_ENERGY and cluster_id[0] == group_id[0] == pid[0] == -1
                    assert interaction[0] == -1 and (cluster_id[1:] == np.arange(len(cluster) - 1)).all()
                    assert (group_id[1:] >= 0).all() and (pid[1:] >= 0).all() and (semantic[1:] != LOW_ENERGY).all()
                    for g in np.unique(group_id[1:]):  # a group with several clusters is a fragmented shower
                        members = np.flatnonzero(group_id == g)
                        if len(members) > 1:
                            fragments += 1
                            assert (semantic[members] == 0).all() and len(set(pid[members])) == 1
                    # vertex: one per interaction, shared by all its clusters; a group's clusters share their
                    # vertex and momentum; momentum from the kinetic energy and mass; mass by particle type;
                    # v3 is_primary for tracks and showers
                    for j in np.unique(interaction[interaction >= 0]):
                        assert len(np.unique(extra[interaction == j, 2:5], axis=0)) == 1
                        interactions += 1
                    for g in np.unique(group_id[1:]):
                        assert len(np.unique(extra[group_id == g, 1:5], axis=0)) == 1
                    assert (extra[1:, 1] >= 0).all() and (extra[0, 1:5] == 0).all()
                    assert np.allclose(extra[pid == 2, 0], 105.66, atol=0.01)
                    if revision == "v3":
                        assert (extra[:, 5] == np.isin(semantic, (0, 1)) * (cluster_id >= 0)).all()
        assert fragments > 0 and interactions > 0
    assert pilarnet_file.detect_revision(write_pilarnet(tmp_path / "v1.h5", 2, seed=1, revision="v1")[0]) == "v1"


def test_points_per_event_gives_realistic_event_sizes(tmp_path: Path, capsys) -> None:
    sizes = [len(pilarnet_event(3, i, points_per_event=4000)["coord"]) for i in range(12)]
    assert 3000 <= np.mean(sizes) <= 5000, sizes
    sparse = [len(pilarnet_event(3, i)["coord"]) for i in range(12)]
    assert np.mean(sparse) < 2000  # 1 to 3 interactions of ~550 generated points each
    e = pilarnet_event(3, 0, points_per_event=4000)
    again = pilarnet_event(3, 0, points_per_event=4000)  # a pure function of (seed, index, size)
    assert all(np.array_equal(e[k], again[k]) for k in e)
    assert len(np.unique(e["point"][:, :3], axis=0)) > 0.9 * len(e["point"])  # mostly one point per voxel
    assert main(["data", "synth", "--layout", "pilarnet", "--out", str(tmp_path / "d"), "--events", "3",
                 "--points-per-event", "2000"]) == 0
    assert "fewer than --points-per-event" not in capsys.readouterr().err
    # more than the generator can make (at most MAX_COPIES voxels per generated point): written, and said
    assert main(["data", "synth", "--layout", "pilarnet", "--out", str(tmp_path / "big"), "--events", "2",
                 "--points-per-event", "500000"]) == 0
    said = capsys.readouterr().err
    assert "fewer than --points-per-event 500000" in said and "at most 32 voxels" in said, said
    code = main(["data", "synth", "--out", str(tmp_path / "x.h5"), "--events", "3", "--points-per-event", "2000"])
    assert code == 2 and "applies to --layout pilarnet" in capsys.readouterr().err
    assert not (tmp_path / "x.h5").exists()


def test_published_feature_normalisation_against_a_hand_computation(tmp_path: Path) -> None:
    (path,) = write_pilarnet(tmp_path / "n.h5", 3, seed=7)
    published = PILArNetDataset(path, features="published")
    for i in range(3):
        raw, feat = published.read_raw(i), published[i]["feat"].double().numpy()
        coord, energy = raw["coord"].astype(np.float64), raw["energy"].astype(np.float64)
        np.testing.assert_allclose(feat[:, :3], (coord - 384.0) / (768.0 * np.sqrt(3.0) / 2.0), atol=1e-6)
        # the published LogTransform(0.01, 20): log10(E + 0.01), no clip (above 20 MeV the column passes 1)
        np.testing.assert_allclose(feat[:, 3], 2.0 * (np.log10(energy + 0.01) - np.log10(0.01))
                                   / (np.log10(20.01) - np.log10(0.01)) - 1.0, atol=1e-6)
        assert np.sqrt((feat[:, :3] ** 2).sum(axis=1)).max() <= 1.0
    pimm_feat = PILArNetDataset(path)[0]["feat"].numpy()
    np.testing.assert_allclose(pimm_feat[:, :3], published.read_raw(0)["coord"] * (2.0 / 768.0) - 1.0, atol=1e-6)
    with pytest.raises(ConfigError, match="features='unit' is unknown; use one of pimm, published"):
        PILArNetDataset(path, features="unit")
    # an export records how its inputs were computed; pimm predict reads new data the same way
    from pimm.cli.export import export_config
    from pimm.config import load_config
    from pimm.launch.predict import _data_source

    cfg = load_config(REPO / "configs" / "pilarnet" / "semseg.py")
    recorded = export_config(cfg, "last", 3)["preprocessing"]
    assert recorded == {"dataset": "PILArNetDataset", "features": "published", "energy_scale": 1.0,
                        "volume_size": 768.0, "transforms": None}
    data, _ = _data_source(argparse.Namespace(data=path, split=None), recorded)
    assert data["features"] == "published" and data["volume_size"] == 768.0 and data["revision"] == "v2"


def test_dtypes_come_from_the_file(tmp_path: Path) -> None:
    events = [pilarnet_event(2, i) for i in range(3)]
    path = write_pilarnet_file(tmp_path / "f64.h5", events, point_dtype=np.float64, cluster_dtype=np.int32)
    with h5py.File(path) as f:
        assert h5py.check_vlen_dtype(f["point"].dtype) == np.float64
        assert h5py.check_vlen_dtype(f["cluster"].dtype) == np.int32
    ds = PILArNetDataset(path)
    for i, e in enumerate(events):
        raw = ds.read_raw(i)
        assert raw["coord"].dtype == np.float32
        np.testing.assert_array_equal(raw["coord"], e["coord"])
        np.testing.assert_array_equal(raw["segment"], e["segment"])


def test_index_is_cached_beside_the_file_and_rebuilt_when_it_changes(tmp_path: Path, monkeypatch) -> None:
    (path,) = write_pilarnet(tmp_path / "shard.h5", 5, seed=1)
    scans = []
    real_scan = pilarnet_file._scan
    monkeypatch.setattr(pilarnet_file, "_scan", lambda *a: scans.append(a) or real_scan(*a))
    first = PILArNetDataset(path)
    cache = index_path(path)
    assert cache.exists() and len(scans) == 1
    stamp = cache.stat().st_mtime_ns
    again = PILArNetDataset(path)  # a second start reads the cache: no scan, no rewrite
    assert len(scans) == 1 and cache.stat().st_mtime_ns == stamp
    assert again.info == first.info
    write_pilarnet(path, 7, seed=2, overwrite=True)  # the file changes: size and mtime differ
    changed = PILArNetDataset(path)
    assert len(scans) == 2 and len(changed) == 7 and changed.info["content_hash"] != first.info["content_hash"]
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched only
    PILArNetDataset(path)
    assert len(scans) == 3
    cache.write_bytes(b"not an npz")  # a corrupt cache is rebuilt, not trusted
    assert len(PILArNetDataset(path)) == 7 and len(scans) == 4
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no leftovers


def test_unwritable_directory_keeps_the_index_in_memory(tmp_path: Path, monkeypatch, caplog) -> None:
    paths = write_pilarnet(tmp_path / "ro", 6, seed=3, shards=2)
    real_open = open

    def refuse(file, mode="r", *args, **kwargs):
        if "w" in mode:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(index_cache, "open", refuse, raising=False)
    with caplog.at_level(logging.WARNING, logger="pimm"):
        ds = PILArNetDataset(tmp_path / "ro")
        PILArNetDataset(tmp_path / "ro")
    assert len(ds) == 6 and not any(index_path(p).exists() for p in paths)
    assert len([r for r in caplog.records if "keeping them in memory" in r.message]) == 1  # once per directory
    scans = []
    monkeypatch.setattr(pilarnet_file, "_scan", lambda *a: scans.append(a))
    assert len(PILArNetDataset(tmp_path / "ro")) == 6 and not scans  # this process does not scan again


def test_energy_threshold_cuts_points_and_min_points_counts_stored_points(tmp_path: Path, monkeypatch) -> None:
    (path,) = write_pilarnet(tmp_path / "sel.h5", 12, seed=6)
    events = [pilarnet_event(6, i) for i in range(12)]
    sizes = np.array([len(e["coord"]) for e in events])
    threshold = float(np.median(np.concatenate([e["energy"] for e in events])))
    above = np.array([(e["energy"] > np.float32(threshold)).sum() for e in events])
    min_points = int(np.median(above))
    scans, passes = [], []
    real_scan, real_count = pilarnet_file._scan, pilarnet_file._count_kept
    monkeypatch.setattr(pilarnet_file, "_scan", lambda *a: scans.append(a) or real_scan(*a))
    monkeypatch.setattr(pilarnet_file, "_count_kept", lambda *a: passes.append(a) or real_count(*a))
    both = {"min_points": min_points, "energy_threshold": threshold}
    for kwargs, keep in (
        ({"min_points": min_points}, sizes >= min_points),
        ({"energy_threshold": threshold}, above > 0),
        (both, (sizes >= min_points) & (above > 0)),  # the published readers: min_points counts stored points
        ({**both, "min_points_after_cut": True}, above >= min_points),
    ):
        ds = PILArNetDataset(path, **kwargs)
        assert 0 < len(ds) <= 12 and len(ds) == keep.sum(), kwargs
        for i, row in enumerate(np.flatnonzero(keep)):
            e, raw = events[row], ds.read_raw(i)
            cut = e["energy"] > np.float32(kwargs.get("energy_threshold", 0.0))
            if "energy_threshold" not in kwargs:
                cut[:] = True
            # the points at or below the threshold are gone, labels stay with their points
            np.testing.assert_array_equal(raw["coord"], e["coord"][cut])
            np.testing.assert_array_equal(raw["segment"], e["segment"][cut])
            assert raw["point"].shape == (len(e["coord"]), 8)  # the stored event, uncut
            counted = cut.sum() if kwargs.get("min_points_after_cut") else len(e["coord"])
            assert len(ds[(0, i)]["coord"]) == cut.sum() >= 1 and counted >= kwargs.get("min_points", 1)
        assert ds.info["events_in_files"] == 12
    assert len(ds) < len(PILArNetDataset(path, **both))  # counting after the cut keeps fewer events
    # one full scan, then one pass for the new threshold; later starts read both from the cache
    assert len(scans) == 1 and len(passes) == 1
    PILArNetDataset(path, min_points=min_points, energy_threshold=threshold)
    assert len(scans) == 1 and len(passes) == 1
    ds = PILArNetDataset(path, min_points=min_points, max_len=2)
    assert len(ds) == 2
    hashes = {PILArNetDataset(path, min_points=m, energy_threshold=t, min_points_after_cut=a).info["content_hash"]
              for m in (0, min_points) for t in (0.0, threshold) for a in (False, True)}
    assert len(hashes) == 5  # the selection and the cut are part of the identity the resume cursor checks
    with pytest.raises(DataError, match="no event of 12 .* has >= 100000 stored points and at least one point above"):
        PILArNetDataset(path, min_points=100_000, energy_threshold=threshold)
    with pytest.raises(DataError, match="no event of 12 .* has >= 100000 points above"):
        PILArNetDataset(path, min_points=100_000, energy_threshold=threshold, min_points_after_cut=True)
    with pytest.raises(ConfigError, match="min_points must be an integer >= 0"):
        PILArNetDataset(path, min_points=-1)
    with pytest.raises(ConfigError, match="energy_threshold must be a finite number >= 0"):
        PILArNetDataset(path, energy_threshold=float("nan"))
    with pytest.raises(ConfigError, match="min_points_after_cut must be true or false, got 'yes'"):
        PILArNetDataset(path, min_points_after_cut="yes")


def test_remove_low_energy_scatters_drops_the_first_cluster_only_when_it_is_one(tmp_path: Path) -> None:
    # v2 rows [size, cluster_id, group_id, interaction_id, semantic, pid]; the first event starts with
    # its scatters (semantic 4), the second has none, so its first cluster (a track) is kept
    scatters_first = [[3, 0, 0, -1, 4, -1], [4, 1, 1, 0, 1, 2], [2, 2, 2, 0, 0, 1]]
    no_scatters = [[4, 0, 0, 0, 1, 2], [2, 1, 1, 0, 0, 1]]
    path = write_pilarnet_file(tmp_path / "les.h5", [_event(scatters_first), _event(no_scatters, seed=1)])
    ds = PILArNetDataset(path, remove_low_energy_scatters=True)
    assert ds.read_raw(0)["segment"].tolist() == [1, 1, 1, 1, 0, 0]
    np.testing.assert_array_equal(ds.read_raw(0)["coord"], _event(scatters_first)["point"][3:, :3])
    assert ds.read_raw(1)["segment"].tolist() == [1, 1, 1, 1, 0, 0]
    assert len(PILArNetDataset(path, remove_low_energy_scatters=True, min_points=6)) == 2
    assert len(PILArNetDataset(path, min_points=7)) == 1
    # min_points counts stored points (the scatters too) unless min_points_after_cut
    assert len(PILArNetDataset(path, remove_low_energy_scatters=True, min_points=7)) == 1
    with pytest.raises(DataError, match="outside the low-energy scatters"):
        PILArNetDataset(path, remove_low_energy_scatters=True, min_points=7, min_points_after_cut=True)
    with pytest.raises(ConfigError, match="remove_low_energy_scatters must be true or false"):
        PILArNetDataset(path, remove_low_energy_scatters="yes")


def test_ignore_labels_stay_minus_one_and_the_trainer_skips_them(tmp_path: Path) -> None:
    # v2 rows [size, cluster_id, group_id, interaction_id, semantic, pid]
    clusters = [[3, 0, 0, -1, 4, -1], [4, 1, 1, 0, -1, 2], [2, 2, 2, 0, 1, 4]]
    path = write_pilarnet_file(tmp_path / "ignore.h5", [_event(clusters), _event(clusters, seed=1)])
    motif = PILArNetDataset(path, label="motif")
    assert motif.read_raw(0)["segment"].tolist() == [4, 4, 4, -1, -1, -1, -1, 1, 1]
    assert motif[1]["segment"].tolist() == [4, 4, 4, -1, -1, -1, -1, 1, 1]
    # pid -1 is class 5 "none" by default, as the published readers map it; the option keeps it unlabelled
    pid = PILArNetDataset(path, label="pid")
    assert pid.read_raw(0)["segment"].tolist() == pid[0]["segment"].tolist() == [5, 5, 5, 2, 2, 2, 2, 4, 4]
    unlabelled = PILArNetDataset(path, label="pid", pid_unlabelled_as_none=False)
    assert unlabelled.read_raw(0)["segment"].tolist() == [-1, -1, -1, 2, 2, 2, 2, 4, 4]
    assert validate_data({"type": "PILArNetDataset", "path": str(path)}, num_classes=5)["num_events"] == 2
    # as class "none" the -1 needs no ignore_index; kept unlabelled, ignore_index must be -1
    assert validate_data(_spec(path, label="pid"), num_classes=6, ignore_index=-100)["num_events"] == 2
    with pytest.raises(DataError, match="pid label -1 .* task.ignore_index=-100 does not ignore"):
        validate_data(_spec(path, label="pid", pid_unlabelled_as_none=False), num_classes=6, ignore_index=-100)

    batch = collate_events([motif[0], motif[1]])
    logits = torch.randn(len(batch["segment"]), 5)
    loss, per_event = event_mean_loss(logits, batch["segment"], batch["offset"])
    valid = batch["segment"] >= 0
    expected = torch.nn.functional.cross_entropy(logits[:9][valid[:9]], batch["segment"][:9][valid[:9]])
    assert torch.isfinite(loss) and torch.allclose(per_event[0], expected)
    meter = SegmentationMeter(5, torch.device("cpu"))
    meter.add(logits, batch["segment"], per_event)
    assert int(meter.confusion.sum()) == int(valid.sum())


def test_directory_of_split_shards(tmp_path: Path) -> None:
    root = tmp_path / "pilarnet"
    write_pilarnet(root, 10, seed=8, shards=3, split="train")
    write_pilarnet(root, 4, seed=9, shards=1, split="val")
    (root / "pilarnet_train").mkdir()  # the published names end in the split: <root>/*train/*.h5
    write_pilarnet(root / "pilarnet_train" / "extra.h5", 2, seed=10)
    train = PILArNetDataset(root, split="train")
    val = PILArNetDataset(root, split="val")
    assert train.info["shards"] == 4 and len(train) == 12 and len(val) == 4
    expected = [pilarnet_event(10, i) for i in range(2)] + [pilarnet_event(8, i) for i in range(10)]
    for i, e in enumerate(expected):  # shards in sorted path order, rows in file order
        np.testing.assert_array_equal(train.read_raw(i)["coord"], e["coord"])
    np.testing.assert_array_equal(val.read_raw(3)["segment"], pilarnet_event(9, 3)["segment"])
    assert train.info["content_hash"] != val.info["content_hash"]
    # a shard rewritten with other content changes the identity of the whole set
    before = train.info["content_hash"]
    write_pilarnet(root / "pilarnet_train" / "extra.h5", 2, seed=11, overwrite=True)
    assert PILArNetDataset(root, split="train").info["content_hash"] != before
    flat = tmp_path / "flat"
    write_pilarnet(flat / "a.h5", 3, seed=1)
    write_pilarnet(flat / "b.h5", 2, seed=2)
    assert len(PILArNetDataset(flat)) == 5  # a plain directory of .h5 files
    with pytest.raises(DataError, match=r"no shards: neither .*\*test/\*\.h5"):
        PILArNetDataset(root, split="test")


def test_dataset_pickles_without_handles_and_workers_read_the_same(tmp_path: Path) -> None:
    root = tmp_path / "w"
    write_pilarnet(root, 8, seed=5, shards=2)
    ds = build_dataset({"type": "PILArNetDataset", "path": str(root)}, seed=0)
    ds.read_raw(0)
    assert ds._files and not pickle.loads(pickle.dumps(ds))._files
    single = [ds[i]["coord"] for i in range(8)]
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert all(torch.equal(a, b["coord"]) for a, b in zip(single, loader, strict=True))
    ds.close()


# ----------------------------------------------------------------------------- the launcher's checks


def _spec(path: Path, **kw) -> dict:
    return {"type": "PILArNetDataset", "path": str(path), **kw}


def test_validation_names_what_is_wrong(tmp_path: Path) -> None:
    good = [_event([[3, 0, 0, 0, 1, 2], [2, 1, 1, 0, 0, 0]])]
    no_cluster = tmp_path / "no_cluster.h5"
    with h5py.File(no_cluster, "w") as f:
        f.create_dataset("point", shape=(1,), dtype=h5py.vlen_dtype(np.float32))
    with pytest.raises(DataError, match=r"no_cluster.h5: dataset 'cluster' is missing"):
        validate_data(_spec(no_cluster))

    bad_point = dict(good[0], point=np.zeros(7, np.float32))
    path = write_pilarnet_file(tmp_path / "bad_point.h5", [bad_point])
    with pytest.raises(DataError, match=r"bad_point.h5: event 0: its 'point' row has 7 values, not a multiple of 8"):
        validate_data(_spec(path))

    v1 = write_pilarnet_file(tmp_path / "v1.h5", [_event([[3, 0, 0, 0, 1], [2, 1, 1, 0, 4]], revision="v1")])
    with pytest.raises(DataError, match=r"'cluster' row has 10 values, not a multiple of 6 .*is it revision v1\?"):
        validate_data(_spec(v1, revision="v2"))
    assert validate_data(_spec(v1, revision="v1"))["num_events"] == 1
    with pytest.raises(ConfigError, match="label='pid' needs revision v2 or v3"):
        validate_data(_spec(v1, revision="v1", label="pid"))

    sizes = dict(good[0], cluster=np.array([[4, 0, 0, 0, 1, 2], [2, 1, 1, 0, 0, 0]]))
    path = write_pilarnet_file(tmp_path / "sizes.h5", [good[0], sizes])
    with pytest.raises(DataError, match=r"sizes.h5: event 1: cluster sizes sum to 6 .* but the event has 5 points"):
        validate_data(_spec(path))

    events = [good[0], _event([[3, 0, 0, 0, 7, 2]])]
    path = write_pilarnet_file(tmp_path / "range.h5", events)
    with pytest.raises(DataError, match=r"range.h5: event 1 has motif label 7, outside 0..4 or -1"):
        validate_data(_spec(path))
    path = write_pilarnet_file(tmp_path / "pid.h5", [_event([[3, 0, 0, 0, 1, 6]])])
    write_pilarnet_file(tmp_path / "pid3.h5", [_event([[3, 0, 0, 0, 1, 3]])])
    assert validate_data(_spec(path), num_classes=5)["num_events"] == 1  # motif labels are fine
    with pytest.raises(DataError, match=r"event 0 has pid label 6, outside 0..5 or -1 \(ignore\) "
                       r"\(data.num_classes=6\).*pid labels are 0..5 \(photon, .*, none\) or -1"):
        validate_data(_spec(path, label="pid"), num_classes=6)
    with pytest.raises(DataError, match=r"event 0 has pid label 3, outside 0..2 .*set data.num_classes .* to 6"):
        validate_data(_spec(v1.with_name("pid3.h5"), label="pid"), num_classes=3)
    with pytest.raises(DataError, match=r"no such file or directory"):
        validate_data(_spec(tmp_path / "missing"))


def test_config_accepts_pilarnet_keys_only_for_pilarnet(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "tests" / "tiny_semseg.py")
    cfg["data"]["train"] = _spec(tmp_path, split="train", revision="v1", label="motif", min_points=10,
                                 energy_threshold=1.5, volume_size=256.0, remove_low_energy_scatters=True)
    check_config(cfg)
    cfg["data"]["train"]["remove_low_energy_scatters"] = "yes"
    with pytest.raises(ConfigError, match="data.train.remove_low_energy_scatters"):
        check_config(cfg)
    cfg["data"]["train"]["remove_low_energy_scatters"] = False
    cfg["data"]["train"]["revision"] = "v4"
    with pytest.raises(ConfigError, match=r"data.train.revision='v4' is not allowed.*one of v1, v2, v3"):
        check_config(cfg)
    cfg["data"]["train"] = {"type": "LArTPCDataset", "path": "x.h5", "min_points": 3}
    with pytest.raises(ConfigError, match="data.train.min_points is an option of PILArNetDataset"):
        check_config(cfg)


def test_open_pilarnet_identity_covers_every_shard(tmp_path: Path) -> None:
    write_pilarnet(tmp_path / "s", 6, seed=2, shards=3)
    info, shards, rows = open_pilarnet(tmp_path / "s")
    assert len(shards) == 3 and [len(r) for r in rows] == [2, 2, 2]
    assert info["size_bytes"] == sum(p.stat().st_size for p in shards)
    for key in ("path", "size_bytes", "num_events", "content_hash"):  # what provenance and the cursor read
        assert key in info


# ----------------------------------------------------------------------------- command line


def test_synth_and_describe_both_layouts(tmp_path: Path) -> None:
    res = run_pimm(["data", "synth", "--layout", "pilarnet", "--revision", "v1", "--out", str(tmp_path / "p"),
                    "--events", "6", "--shards", "2", "--seed", "3"], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "wrote 6 events" in res.stdout and "2 v1 shard(s)" in res.stdout
    res = run_pimm(["data", "describe", str(tmp_path / "p")], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["layout"] == "pilarnet" and info["revision"] == "v1" and info["num_events"] == 6
    assert sum(info["motif_counts"].values()) == info["num_points"] and "pid_counts" not in info
    res = run_pimm(["data", "synth", "--out", str(tmp_path / "native.h5"), "--events", "3"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = run_pimm(["data", "describe", str(tmp_path / "native.h5")], cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and json.loads(res.stdout)["num_events"] == 3


def _pilarnet_run(tmp_path: Path, path: Path, *extra: str):
    def data(split: str) -> str:
        return (f"{{type: PILArNetDataset, path: {path}, split: {split}, revision: v2, label: motif, "
                "min_points: 20}")

    return run_pimm(["launch", "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "1",
                     "--run.name", "pilarnet", "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"),
                     *extra, "--", f"data.train={data('train')}", f"data.val={data('val')}", "epochs=1",
                     "max_steps=3"], cwd=REPO, timeout=120)


def test_launch_refuses_a_bad_shard_before_starting(tmp_path: Path) -> None:
    bad = write_pilarnet_file(tmp_path / "bad.h5", [_event([[3, 0, 0, 0, 9, 2]])] * 4)
    res = _pilarnet_run(tmp_path, bad, "--dry-run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "event 0 has motif label 9, outside 0..4 or -1 (ignore) (data.num_classes=5)" in res.stderr


def test_one_rank_training_on_generated_shards(tmp_path: Path) -> None:
    write_pilarnet(tmp_path / "d", 16, seed=21, shards=2, split="train")
    write_pilarnet(tmp_path / "d", 4, seed=22, split="val")
    res = _pilarnet_run(tmp_path, tmp_path / "d")
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = tmp_path / "exp" / "tests" / "pilarnet"
    prov = json.loads((run_dir / "provenance.json").read_text())
    text = json.dumps(prov)
    assert PILArNetDataset(tmp_path / "d", min_points=20).info["content_hash"] in text


def test_two_ranks_with_loader_workers_then_resume_on_one_rank(tmp_path: Path) -> None:
    """v1 shards through the whole path (point cut, scatter removal, 3 shards, 2 loader workers per
    rank): a 2-rank run stopped at step 5 and resumed on 1 rank consumes, step by step, the events
    an uninterrupted 1-rank run consumes, with the same losses up to float summation order."""
    root = tmp_path / "v1"
    write_pilarnet(root, 44, seed=31, shards=3, split="train", revision="v1")
    write_pilarnet(root, 6, seed=32, split="val", revision="v1")

    def run(name: str, nproc: int, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
        spec = (f"{{type: PILArNetDataset, path: {root}, revision: v1, min_points: 300, "
                "energy_threshold: 0.25, remove_low_energy_scatters: true, split: ")
        res = run_pimm(["launch", "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", str(nproc),
                        "--run.name", name, "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"),
                        *(["--train.resume"] if "resume" in extra else []), "--",
                        f"data.train={spec}train}}", f"data.val={spec}val}}", "epochs=2", "num_worker=4",
                        "log_event_ids=true", *(e for e in extra if e != "resume")], cwd=REPO, timeout=300)
        return res, tmp_path / "exp" / "tests" / name

    selected = PILArNetDataset(root, revision="v1", min_points=300, energy_threshold=0.25,
                               remove_low_energy_scatters=True)
    assert 8 <= len(selected) < 44  # the cut leaves some events out
    res, ref = run("ref", 1)
    assert res.returncode == 0, res.stderr
    res, run_dir = run("job", 2, "debug.interrupt_at_step=5")
    assert res.returncode == 75, res.stderr
    res, run_dir = run("job", 1, "resume")
    assert res.returncode == 0, res.stderr
    resumed = attempts(run_dir)[-1]
    assert resumed["cursor"] == "remapped" and resumed["world_size"] == 1 and resumed["start_step"] == 5
    assert steps(run_dir) == steps(ref) and len(steps(ref)) == 2 * (len(selected) // 4)
    for step, loss in losses(run_dir).items():  # float summation order differs across topologies
        assert abs(loss - losses(ref)[step]) <= 1e-4 * loss
    assert selected.info["content_hash"] in (run_dir / "provenance.json").read_text()


def test_published_finetuning_recipe_runs_on_two_ranks(tmp_path: Path) -> None:
    """configs/pilarnet/finetune.py as shipped: a Pointcept-style backbone checkpoint with another head
    (key_map + skip, strict=False), a tenth of the lr for the backbone, CE + Lovasz, rotation, flip and
    grid sampling, the published reader defaults and features, on 2 ranks with loader workers."""
    from pimm.models import build_model

    root = tmp_path / "pil"
    write_pilarnet(root, 24, seed=41, shards=2, split="train", revision="v3")
    write_pilarnet(root, 6, seed=42, split="val", revision="v3")
    cfg = load_config(REPO / "configs" / "pilarnet" / "finetune.py")
    torch.manual_seed(5)
    other = build_model({**cfg["model"], "num_classes": 6}).state_dict()  # someone's 6-class model
    backbone = {("module.head." + k[5:]) if k.startswith("head.") else "module.backbone." + k: v
                for k, v in other.items()}
    checkpoint = tmp_path / "pointcept.pth"
    torch.save({"epoch": 10, "state_dict": backbone}, checkpoint)
    head = [k for k in other if k.startswith("head.")]

    res = run_pimm(["launch", "--train.config", "pilarnet/finetune", "--resources.nproc-per-node", "2",
                    "--run.name", "recipe", "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), "--",
                    f"pretrained.path={checkpoint}", "data.test=null", "max_steps=2", "epochs=1",
                    "data.train.min_points=100", "data.val.min_points=100", "revision=v3",
                    *(f"data.{s}.path={root}" for s in ("train", "val"))], cwd=REPO, timeout=300)
    assert res.returncode == 2 and "unknown config key 'revision'" in res.stderr  # a typo is refused at once
    res = run_pimm(["launch", "--train.config", "pilarnet/finetune", "--resources.nproc-per-node", "2",
                    "--run.name", "recipe", "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), "--",
                    f"pretrained.path={checkpoint}", "data.test=null", "max_steps=2", "epochs=1", "num_worker=4",
                    "data.train.min_points=100", "data.val.min_points=100", "data.train.revision=v3",
                    "data.val.revision=v3", *(f"data.{s}.path={root}" for s in ("train", "val"))],
                   cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    loaded = len(other) - len(head)
    assert f"loaded {loaded} of {len(other)}, skipped {len(head)} (head." in res.stdout
    run_dir = tmp_path / "exp" / "pilarnet" / "recipe"
    attempt = attempts(run_dir)[-1]
    assert attempt["pretrained"]["loaded"] == loaded and attempt["world_size"] == 2
    lr = cfg["optimizer"]["lr"]
    groups = [(g["params"], g["lr"], g["weight_decay"]) for g in attempt["optimizer_groups"]]
    assert [(p, round(r / lr, 6)) for p, r, _ in groups] == [
        ("default", 1.0), ("stem.*norm*|stem.*bias|blocks.*norm*|blocks.*bias", 0.1), ("stem.*|blocks.*", 0.1),
        ("*norm*|*bias", 1.0)]
    assert [wd for *_, wd in groups] == [0.01, 0.0, 0.01, 0.0]
    used = load_config(run_dir / "config.py")
    assert used["data"]["train"]["features"] == "published" and [t["type"] for t in used["task"]["loss"]] == [
        "CrossEntropy", "Lovasz"]
    assert losses(run_dir) and all(np.isfinite(v) for v in losses(run_dir).values())
