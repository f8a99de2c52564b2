"""Tests for pimm.data: the synthetic generator, event files, the dataset and collation."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from pimm.data.collate import batch_index_to_offset, collate_events, offset_to_batch_index
from pimm.data.dataset import LArTPCDataset, build_dataset, validate_event_file
from pimm.data.synth import (
    CLASS_NAMES,
    DETECTOR_SIZE,
    compute_content_hash,
    describe,
    generate_event,
    write_dataset,
)
from pimm.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]


def _same_event(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in ("coord", "energy", "segment"))


@pytest.fixture(scope="module")
def event_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small event file shared by the read-only tests."""
    return write_dataset(tmp_path_factory.mktemp("events") / "small.h5", num_events=24, seed=5)


# ----------------------------------------------------------------------------- generator


def test_generate_event_is_deterministic() -> None:
    a, b = generate_event(3, 5), generate_event(3, 5)
    assert _same_event(a, b)
    assert not _same_event(a, generate_event(3, 6))
    assert not _same_event(a, generate_event(4, 5))


def test_generate_event_is_the_same_in_another_process() -> None:
    code = "from pimm.data.synth import generate_event; e = generate_event(3, 5); print(e['coord'].sum(dtype='f8'))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout) == float(generate_event(3, 5)["coord"].sum(dtype="f8"))


def test_generated_events_are_plausible() -> None:
    counts = np.zeros(len(CLASS_NAMES), dtype=np.int64)
    sizes = []
    for i in range(50):
        e = generate_event(11, i)
        n = len(e["segment"])
        assert e["coord"].dtype == np.float32 and e["coord"].shape == (n, 3)
        assert e["energy"].dtype == np.float32 and e["energy"].shape == (n,)
        assert e["segment"].dtype == np.uint8 and e["segment"].max() < len(CLASS_NAMES)
        assert np.all(e["coord"] >= 0) and np.all(e["coord"] < DETECTOR_SIZE)
        assert np.all(np.isfinite(e["energy"])) and np.all(e["energy"] > 0)
        counts += np.bincount(e["segment"], minlength=len(CLASS_NAMES))
        sizes.append(n)
    assert np.all(counts > 0), dict(zip(CLASS_NAMES, counts))
    assert min(sizes) >= 20 and max(sizes) <= 5000
    assert 250 <= np.mean(sizes) <= 1500


def test_classes_differ_in_energy_and_spread() -> None:
    e = {k: np.concatenate([generate_event(2, i)[k] for i in range(30)]) for k in ("energy", "segment")}
    mean = {name: e["energy"][e["segment"] == c].mean() for c, name in enumerate(CLASS_NAMES)}
    # blips and delta rays are low energy; tracks (Bragg peaks, protons) are the densest
    assert mean["low_energy"] < mean["delta"] < mean["track"]
    assert mean["low_energy"] < mean["shower"]


# ----------------------------------------------------------------------------- files


def test_write_validate_and_read_back(event_file: Path) -> None:
    info = validate_event_file(event_file)
    assert info["path"] == str(event_file.absolute())
    assert info["num_events"] == 24 and info["format_version"] == 1
    assert info["size_bytes"] == event_file.stat().st_size
    assert info["content_hash"] == compute_content_hash(event_file)
    assert not event_file.with_suffix(".h5.tmp").exists()
    with h5py.File(event_file) as f:
        assert f.attrs["format"] == "pimm-events" and f.attrs["seed"] == 5
        assert json.loads(f.attrs["class_names"]) == list(CLASS_NAMES)
        assert f["offsets"].dtype == np.int64 and f["segment"].dtype == np.uint8
    ds = LArTPCDataset(event_file)
    assert len(ds) == 24
    for i in (0, 7, 23):
        expect = generate_event(5, i)
        sample = ds[i]
        assert np.array_equal(sample["coord"].numpy(), expect["coord"])
        assert np.array_equal(sample["segment"].numpy(), expect["segment"].astype(np.int64))
        assert sample["event_id"] == i and sample["feat"].shape == (len(expect["coord"]), 4)
        assert torch.allclose(sample["feat"][:, :3], torch.from_numpy(expect["coord"] / DETECTOR_SIZE * 2 - 1))
        assert torch.allclose(sample["feat"][:, 3], torch.from_numpy(np.log1p(expect["energy"])))
        assert sample["feat"][:, :3].abs().max() <= 1.0


def test_describe(event_file: Path) -> None:
    d = describe(event_file)
    assert d["num_events"] == 24 and d["seed"] == 5
    assert sum(d["class_counts"].values()) == d["num_points"]
    assert d["num_points"] == sum(len(generate_event(5, i)["segment"]) for i in range(24))


def test_content_hash_depends_only_on_seed(tmp_path: Path) -> None:
    a = validate_event_file(write_dataset(tmp_path / "a.h5", 6, seed=1))["content_hash"]
    b = validate_event_file(write_dataset(tmp_path / "sub" / "b.h5", 6, seed=1))["content_hash"]
    c = validate_event_file(write_dataset(tmp_path / "c.h5", 6, seed=2))["content_hash"]
    assert a == b != c
    assert len(a) == 64


@pytest.mark.parametrize("num_events", [0, -3])
def test_write_rejects_bad_event_count(tmp_path: Path, num_events: int) -> None:
    with pytest.raises(DataError, match="number of events"):
        write_dataset(tmp_path / "x.h5", num_events, seed=0)
    assert not list(tmp_path.iterdir())


def test_validate_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.h5"
    with pytest.raises(DataError) as err:
        validate_event_file(path)
    assert str(path) in str(err.value) and "pimm data synth" in str(err.value)


def test_validate_not_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "text.h5"
    path.write_text("not an hdf5 file\n" * 100)
    with pytest.raises(DataError) as err:
        validate_event_file(path)
    assert str(path) in str(err.value) and "HDF5" in str(err.value)


def test_validate_truncated_file(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "cut.h5", 10, seed=0)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(DataError) as err:
        validate_event_file(path)
    assert str(path) in str(err.value)
    with pytest.raises(DataError):
        LArTPCDataset(path)


def test_validate_hdf5_without_datasets(tmp_path: Path) -> None:
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("something_else", data=np.arange(5))
    with pytest.raises(DataError) as err:
        validate_event_file(path)
    assert str(path) in str(err.value) and "not a pimm event file" in str(err.value)
    # the right attributes are not enough: the arrays must be there too
    with h5py.File(path, "a") as f:
        f.attrs.update(format="pimm-events", format_version=1, num_events=1, content_hash="0" * 64)
    with pytest.raises(DataError, match="'coord' is missing"):
        validate_event_file(path)


def test_validate_inconsistent_offsets(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "bad.h5", 4, seed=0)
    with h5py.File(path, "r+") as f:
        f["offsets"][-1] = f["offsets"][-1] + 7
    with pytest.raises(DataError, match="offsets") as err:
        validate_event_file(path)
    assert str(path) in str(err.value)


def test_validate_closes_the_file(event_file: Path) -> None:
    validate_event_file(event_file)
    LArTPCDataset(event_file)
    with h5py.File(event_file, "r+"):  # would fail if a read handle were still open in this process
        pass


# ----------------------------------------------------------------------------- dataset


def test_dataset_keys_and_bounds(event_file: Path) -> None:
    ds = LArTPCDataset(event_file, max_len=10)
    assert len(ds) == 10
    assert np.array_equal(ds[-1]["coord"], ds[9]["coord"])
    assert np.array_equal(ds[(3, 4)]["coord"], ds[4]["coord"])  # no augmentation: epoch is irrelevant
    with pytest.raises(IndexError):
        ds[10]
    assert len(LArTPCDataset(event_file, max_len=1000)) == 24


def test_dataset_pickles_without_its_handle(event_file: Path) -> None:
    ds = LArTPCDataset(event_file, augment=True, seed=3)
    first = ds[(1, 2)]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._h5 is None
    assert torch.equal(clone[(1, 2)]["coord"], first["coord"])
    ds.close()


def test_augmentation_is_deterministic_per_sample(event_file: Path) -> None:
    ds = LArTPCDataset(event_file, augment=True, seed=9)
    other = LArTPCDataset(event_file, augment=True, seed=9)
    a = ds[(2, 5)]
    assert all(torch.equal(a[k], other[(2, 5)][k]) for k in ("coord", "feat", "segment"))
    assert torch.equal(ds[5]["coord"], ds[(0, 5)]["coord"])
    assert not torch.equal(a["coord"], ds[(3, 5)]["coord"])
    assert not torch.equal(a["coord"], LArTPCDataset(event_file, augment=True, seed=10)[(2, 5)]["coord"])
    raw = generate_event(5, 5)
    assert not np.array_equal(a["coord"].numpy(), raw["coord"])
    for epoch in range(8):
        s = ds[(epoch, 5)]
        assert s["coord"].min() >= 0 and s["coord"].max() < DETECTOR_SIZE
        assert len(s["coord"]) == len(s["feat"]) == len(s["segment"]) <= len(raw["coord"])
        # rotation keeps the label mix (a few corner points may leave the volume)
        assert set(s["segment"].tolist()) <= set(raw["segment"].tolist())


def test_dataloader_workers_match_single_process(event_file: Path) -> None:
    ds = LArTPCDataset(event_file, augment=True, seed=4)
    ds[0]  # open the file in the parent first: workers must not reuse the forked handle
    batches = [[(1, 3), (1, 17)], [(1, 0), (2, 0)], [(1, 23), (1, 8)], [(3, 11), (3, 12)]]

    def load(**kwargs: object) -> list[dict]:
        return list(DataLoader(ds, batch_sampler=batches, collate_fn=collate_events, **kwargs))

    single = load(num_workers=0)
    multi = load(num_workers=2, multiprocessing_context="fork")
    assert len(single) == len(multi) == len(batches)
    for a, b in zip(single, multi):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert single[1]["event_id"].tolist() == [0, 0]


def test_build_dataset(event_file: Path) -> None:
    ds = build_dataset({"type": "LArTPCDataset", "path": str(event_file), "augment": True, "max_len": 5}, seed=2)
    assert isinstance(ds, LArTPCDataset) and len(ds) == 5 and ds.augment and ds.seed == 2
    with pytest.raises(ConfigError, match="LArTPCDataset"):
        build_dataset({"type": "NoSuchDataset", "path": str(event_file)}, seed=0)
    with pytest.raises(ConfigError):
        build_dataset({"type": "LArTPCDataset", "path": str(event_file), "bogus": 1}, seed=0)
    with pytest.raises(ConfigError, match="max_len"):
        build_dataset({"type": "LArTPCDataset", "path": str(event_file), "max_len": 0}, seed=0)
    with pytest.raises(DataError, match="no such file"):
        build_dataset({"type": "LArTPCDataset", "path": str(event_file) + ".missing"}, seed=0)


# ----------------------------------------------------------------------------- collate


def _fake_event(n: int, event_id: int) -> dict:
    return {
        "coord": torch.full((n, 3), float(event_id)),
        "feat": torch.arange(n * 4, dtype=torch.float32).reshape(n, 4),
        "segment": torch.full((n,), event_id % 5, dtype=torch.int64),
        "event_id": event_id,
    }


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=6))
def test_collate_packs_events(sizes: list[int]) -> None:
    batch = [_fake_event(n, 100 + i) for i, n in enumerate(sizes)]
    out = collate_events(batch)
    assert out["offset"].dtype == torch.int64 and out["offset"].tolist() == np.cumsum(sizes).tolist()
    assert out["event_id"].tolist() == [100 + i for i in range(len(sizes))]
    assert out["coord"].shape == (sum(sizes), 3) and out["feat"].shape == (sum(sizes), 4)
    bidx = offset_to_batch_index(out["offset"])
    assert len(bidx) == sum(sizes)
    # every point sits in the rows of its own event
    assert torch.equal(out["coord"][:, 0], (bidx + 100).float())
    for i, event in enumerate(batch):
        lo = int(out["offset"][i - 1]) if i else 0
        assert torch.equal(out["feat"][lo : int(out["offset"][i])], event["feat"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=8))
def test_offset_batch_index_round_trip(sizes: list[int]) -> None:
    offset = torch.tensor(np.cumsum(sizes), dtype=torch.int64)
    bidx = offset_to_batch_index(offset)
    assert bidx.dtype == torch.int64 and bidx.tolist() == [i for i, n in enumerate(sizes) for _ in range(n)]
    assert torch.equal(batch_index_to_offset(bidx, num_events=len(sizes)), offset)


def test_collate_rejects_empty_batch() -> None:
    with pytest.raises(ValueError):
        collate_events([])


def test_collate_real_events(event_file: Path) -> None:
    ds = LArTPCDataset(event_file)
    out = collate_events([ds[i] for i in (4, 1, 9)])
    assert out["offset"][-1] == len(out["coord"]) == len(out["segment"])
    assert out["segment"].dtype == torch.int64 and out["event_id"].tolist() == [4, 1, 9]
    assert torch.equal(batch_index_to_offset(offset_to_batch_index(out["offset"])), out["offset"])
