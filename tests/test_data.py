"""Tests for pimm.data: the synthetic generator, event files, the dataset and collation."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import pimm_in_process
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from pimm.data.collate import batch_index_to_offset, collate_events, offset_to_batch_index
from pimm.data.dataset import LArTPCDataset, build_dataset
from pimm.data.event_format import (
    CLASS_NAMES,
    DETECTOR_SIZE,
    compute_content_hash,
    describe,
    validate_event_file,
)
from pimm.data.index_cache import index_path
from pimm.data.synth import generate_event, write_dataset
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
    assert not list(event_file.parent.glob(".*.tmp"))  # written in one rename, no leftovers
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


# ----------------------------------------------------------------------------- `pimm data synth --out`


def _synth(out: Path, *extra: object) -> subprocess.CompletedProcess:
    return pimm_in_process(["data", "synth", "--out", out, "--events", "3", *extra])


def _one_line_refusal(res: subprocess.CompletedProcess, *words: str) -> str:
    """The single stderr line of a refused `pimm data synth` (exit 2, no traceback), checked for `words`."""
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("pimm: error: ") and "Traceback" not in line, res.stderr
    for word in words:
        assert word in line, (word, line)
    return line


def test_synth_refuses_an_existing_file_and_replaces_only_its_own_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "train.h5"
    assert _synth(out, "--seed", "1").returncode == 0
    first = validate_event_file(out)["content_hash"]
    _one_line_refusal(_synth(out, "--seed", "2"), f"{out} exists", "--overwrite")
    assert validate_event_file(out)["content_hash"] == first  # untouched
    res = _synth(out, "--seed", "2", "--overwrite")  # a file pimm data synth wrote: replaced
    assert res.returncode == 0 and "wrote 3 events" in res.stdout, res.stderr
    assert validate_event_file(out)["content_hash"] != first
    # a file pimm data synth did not write is never replaced, with the flag or without
    for name, make in (("notes.h5", lambda p: p.write_text("my notes\n")),
                       ("other.h5", lambda p: h5py.File(p, "w").close()),  # HDF5, but no generator attribute
                       ("foreign.h5", lambda p: h5py.File(p, "w").attrs.update(generator="someone.else"))):
        path = tmp_path / name
        make(path)
        before = path.read_bytes()
        _one_line_refusal(_synth(path), f"{path} exists")
        _one_line_refusal(_synth(path, "--overwrite"), f"{path} exists and pimm data synth did not write it")
        assert path.read_bytes() == before
    _one_line_refusal(_synth(tmp_path, "--overwrite"), f"--out {tmp_path} is a directory")


def test_synth_pilarnet_refuses_existing_shards_and_strays_in_the_split_directory(tmp_path: Path) -> None:
    out = tmp_path / "pil"
    assert _synth(out, "--layout", "pilarnet", "--shards", "3").returncode == 0
    _one_line_refusal(_synth(out, "--layout", "pilarnet", "--shards", "3", "--seed", "4"), "train_000.h5 exists")
    # fewer shards over the same directory would leave train_002.h5 to be read with the new ones
    _one_line_refusal(_synth(out, "--layout", "pilarnet", "--shards", "2", "--overwrite"),
                      f"{out / 'train'} also holds train_002.h5", "would mix")
    res = _synth(out, "--layout", "pilarnet", "--shards", "3", "--seed", "4", "--overwrite")
    assert res.returncode == 0, res.stderr
    (out / "train" / "train_001.h5").write_bytes(b"a published shard, say")
    _one_line_refusal(_synth(out, "--layout", "pilarnet", "--shards", "3", "--overwrite"),
                      "train_001.h5 exists and pimm data synth did not write it")


def test_synth_to_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    # tests run as root, which chmod does not stop: a path through a regular file fails for root too
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker / "x.h5", blocker / "sub" / "x.h5"):  # ENOTDIR on the file, EEXIST on making the folder
        _one_line_refusal(_synth(out), f"cannot write {out}: {blocker} is a file, not a directory", "--out")
    res = pimm_in_process(["data", "synth", "--layout", "pilarnet", "--out", blocker / "pil", "--events", "2"])
    _one_line_refusal(res, f"{blocker} is a file, not a directory")
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_synth_on_a_read_only_file_system_is_one_line(tmp_path: Path) -> None:
    """EROFS itself: a read-only tmpfs mounted in a private mount namespace (root with unshare only)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {ro}"],
                           capture_output=True, text=True, check=False) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs `unshare -m` and mount (root in a mount namespace) for a read-only file system: "
                    f"{probe.stderr.strip() if probe else 'no unshare'}")
    out = ro / "data" / "x.h5"
    script = f'mount -t tmpfs -o ro tmpfs {ro} && exec "$0" -m pimm data synth --out {out} --events 2'
    res = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _one_line_refusal(res, f"cannot write {out}: read-only file system", "--out")


def test_files_written_follow_the_umask(tmp_path: Path) -> None:
    """Event files, PILArNet shards and their cached index get 0666 & ~umask, as `open()` would give."""
    for umask in (0o022, 0o027):
        previous = os.umask(umask)
        try:
            native = tmp_path / f"u{umask:o}.h5"
            assert _synth(native).returncode == 0
            assert _synth(tmp_path / f"p{umask:o}", "--layout", "pilarnet").returncode == 0
            shard = tmp_path / f"p{umask:o}" / "train" / "train_000.h5"
            validate_event_file(native)  # writes the points index beside the file
        finally:
            os.umask(previous)
        for path in (native, shard, index_path(native), index_path(shard)):
            assert path.stat().st_mode & 0o777 == 0o666 & ~umask, (path, oct(path.stat().st_mode), oct(umask))


def test_the_data_layer_imports_nothing_above_it_and_the_generator_no_reader() -> None:
    above = ("pimm.engine", "pimm.tasks", "pimm.models", "pimm.launch", "pimm.checkpoint", "pimm.distributed",
             "pimm.cli", "pimm.validate")
    for module in sorted((REPO / "pimm" / "data").glob("*.py")):
        imported = _imports(module)
        assert not [m for m in imported if m.startswith(above)], (module.name, imported)
        if module.name == "synth.py":
            assert not {"pimm.data.dataset", "pimm.data.event_file"} & imported, imported
        if module.name in ("event_format.py", "pilarnet_file.py", "event_file.py", "transforms.py", "dataset.py"):
            assert "pimm.data.synth" not in imported, module.name  # readers take the format from its module


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code ("from pimm.data import x" gives pimm.data.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found
