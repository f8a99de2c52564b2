"""Every config value, data file and weights file is checked by `pimm launch` before a process
starts: exit status 2, one clear line, no traceback, no run directory. The launches run pimm's CLI in
the test process (pimm_in_process): what is tested happens before any process starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO, pimm_in_process

from pimm import names

TINY = "tests/tiny_semseg"  # model PointSegNet(channels=16, grid_sizes=[4, 16], num_classes=5)


def launch(tmp_path: Path, tiny_data, *overrides: str, dry_run: bool = True, extra=(), cwd: Path = REPO):
    args = ["launch", "--train.config", str(REPO / "configs" / f"{TINY}.py"), "--paths.exp-root",
            str(tmp_path / "exp"), *(["--dry-run"] if dry_run else []), *extra, "--",
            f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", *overrides]
    return pimm_in_process(args, cwd=cwd)


def assert_refused(res: subprocess.CompletedProcess, tmp_path: Path, *expected: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pimm: error: "), res.stderr
    for text in expected:
        assert text in lines[0]
    assert not (tmp_path / "exp").exists()  # a refused launch leaves no run directory


@pytest.mark.parametrize(
    "override,expected",
    [
        ("epochs=0", ["epochs=0 is not allowed", "integer >= 1"]),
        ("epochs=-1", ["epochs=-1", "integer >= 1"]),
        ("epochs=2.5", ["epochs=2.5", "integer >= 1"]),
        ("seed=-1", ["seed=-1", "integer >= 0"]),
        ("max_steps=0", ["max_steps=0", "integer >= 1, or None"]),
        ("log_every=0", ["log_every=0", "integer >= 1"]),
        ("eval_every_epochs=0", ["eval_every_epochs=0", "integer >= 1"]),
        ("checkpoint_keep_last=0", ["checkpoint_keep_last=0", "integer >= 2"]),
        ("checkpoint_keep_last=1", ["checkpoint_keep_last=1", "integer >= 2", "fallback"]),
        ("checkpoint_every_n_steps=0", ["checkpoint_every_n_steps=0", "integer >= 1, or None"]),
        ("optimizer.lr=abc", ["optimizer.lr='abc'", "finite number"]),
        ("optimizer.lr='1e-3'", ["optimizer.lr='1e-3'", "without quotes"]),
        ("optimizer.lr=.nan", ["optimizer.lr=nan", "finite number"]),
        ("optimizer.lr=-0.1", ["optimizer.lr=-0.1", "finite number >= 0"]),
        ("optimizer.weight_decay=-1", ["optimizer.weight_decay=-1", ">= 0"]),
        ("clip_grad=0", ["clip_grad=0", "> 0, or None (no clipping)"]),
        ("data.num_classes=4", ["data.num_classes=4 but model.num_classes=5"]),
        ("data.num_classes=1", ["data.num_classes=1", "integer >= 2"]),
        ("data.names=[a,b]", ["data.names has 2 entries", "data.num_classes=5"]),
        ("amp.dtype=float16", ["amp.dtype='float16'", "GradScaler", "use bfloat16"]),
        ("amp.dtype=fp32", ["amp.dtype='fp32'", "bfloat16, float32"]),
        ("amp.enabled=maybe", ["amp.enabled='maybe'", "true or false"]),
        ("sync_bn=1", ["sync_bn=1", "true or false"]),
        ("checkpoint_async='true'", ["checkpoint_async='true'", "true or false"]),
        ("find_unused_parameters=0", ["find_unused_parameters=0", "true or false"]),
        ("optimizer.type=Adamm", ["optimizer.type='Adamm'", "did you mean 'Adam'"]),
        ("scheduler={type: Cosine}", ["scheduler.type='Cosine'", "CosineAnnealingLR"]),
        ("model.type=PointNet", ["model.type='PointNet'", "PointSegNet"]),
        ("data.train.type=H5Dataset", ["data.train.type='H5Dataset'", "LArTPCDataset"]),
        ("data.val.max_len=0", ["data.val.max_len=0", "integer >= 1"]),
        ("parallel.strategy=fsdp", ["parallel.strategy='fsdp'", "ddp"]),
    ],
)
def test_bad_config_value_is_refused_naming_key_and_value(tmp_path, tiny_data, override, expected):
    assert_refused(launch(tmp_path, tiny_data, override), tmp_path, *expected)


@pytest.mark.parametrize("override", ["epochs=0", "optimizer.lr=abc", "amp.dtype=float16"])
def test_bad_config_value_stops_a_real_launch_before_the_run_directory(tmp_path, tiny_data, override):
    assert_refused(launch(tmp_path, tiny_data, override, dry_run=False), tmp_path, override.split("=")[0])


def test_every_shipped_config_passes():
    from pimm.config import list_configs, load_config
    from pimm.config.validate import check_config

    configs = list_configs(REPO / "configs")
    assert "demo/semseg" in configs and TINY in configs
    for name in configs:
        check_config(load_config(REPO / "configs" / f"{name}.py"))


@pytest.fixture(scope="module")
def bad_files(tiny_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    text = root / "text.h5"
    text.write_text("not an h5 file\n\n")  # 16 bytes
    label = root / "label7.h5"
    shutil.copy(tiny_data["train"], label)
    with h5py.File(label, "r+") as f:
        f["segment"][int(f["offsets"][17]) + 3] = 7  # event 17, its 4th point
    dtype = root / "float_labels.h5"
    shutil.copy(tiny_data["train"], dtype)
    with h5py.File(dtype, "r+") as f:
        labels = f["segment"][:]
        del f["segment"]
        f.create_dataset("segment", data=labels.astype(np.float32))
    return {"text": text, "label": label, "dtype": dtype}


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_16_byte_text_file_is_not_an_event_file(tmp_path, tiny_data, bad_files, dry_run):
    res = launch(tmp_path, tiny_data, f"data.train.path={bad_files['text']}", dry_run=dry_run)
    assert_refused(res, tmp_path, str(bad_files["text"]), "not a readable HDF5 file (16 bytes")


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_label_outside_num_classes_names_file_event_and_value(tmp_path, tiny_data, bad_files, dry_run):
    res = launch(tmp_path, tiny_data, f"data.val.path={bad_files['label']}", dry_run=dry_run)
    assert_refused(res, tmp_path, str(bad_files["label"]), "event 17 has label 7, outside 0..4 (data.num_classes=5")


def test_a_wrong_dtype_is_named(tmp_path, tiny_data, bad_files):
    res = launch(tmp_path, tiny_data, f"data.train.path={bad_files['dtype']}")
    assert_refused(res, tmp_path, "dataset 'segment' has dtype float32, expected an unsigned integer type (uint8)")


def test_a_missing_relative_data_path_says_where_it_looked(tmp_path, tiny_data):
    res = launch(tmp_path, tiny_data, "data.train.path=missing/train.h5", cwd=tmp_path)
    assert_refused(res, tmp_path, f"{tmp_path / 'missing/train.h5'}: no such file", "relative to the current directory")


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory) -> dict[str, Path]:
    from pimm.models import PointSegNet

    root = tmp_path_factory.mktemp("weights")
    files = {name: root / f"{name}.pth" for name in ("fits", "other", "wrapped")}
    torch.save(PointSegNet(channels=16, grid_sizes=[4, 16]).state_dict(), files["fits"])
    torch.save(PointSegNet(channels=48, grid_sizes=[4, 16, 8]).state_dict(), files["other"])
    torch.save({"weights": PointSegNet(channels=16, grid_sizes=[4, 16]).state_dict(), "epoch": 3}, files["wrapped"])
    files["text"] = root / "notes.pth"
    files["text"].write_text("these are not weights")
    return files


@pytest.mark.parametrize(
    "name,expected",
    [
        ("other", ["do not fit model PointSegNet(", "channels=16", "8 unexpected keys (blocks.2.",
                   "23 shape mismatches (stem.0.weight: [48, 4] in the file, [16, 4] in the model;"]),
        ("wrapped", ["not a state_dict of tensors", "key 'weights'"]),
        ("text", ["cannot read weights", "not a torch file of tensors"]),
    ],
)
def test_weights_of_another_model_are_refused_before_any_process(tmp_path, tiny_data, weight_files, name, expected):
    res = launch(tmp_path, tiny_data, dry_run=False, extra=["--train.weight", str(weight_files[name])])
    assert_refused(res, tmp_path, str(weight_files[name]), *expected)


def test_weights_of_the_same_model_fit(weight_files):
    from pimm.checkpoint.weights import check_weights_fit

    model = dict(type="PointSegNet", in_channels=4, num_classes=5, channels=16, grid_sizes=[4, 16])
    assert check_weights_fit(weight_files["fits"], model) == weight_files["fits"]


def test_dry_run_says_what_the_torchrun_command_needs_and_gives_the_line_to_paste(tmp_path, tiny_data):
    res = launch(tmp_path, tiny_data)
    assert res.returncode == 0, res.stderr
    assert "data.train: " in res.stdout and "(ok, 48 events)" in res.stdout
    assert "config.py and launch.json" in res.stdout and "paste this line" in res.stdout
    assert not (tmp_path / "exp").exists()


def test_worker_without_a_prepared_run_directory_exits_2_at_once(tmp_path):
    run_dir = tmp_path / "exp" / "tests" / "never-launched"
    res = subprocess.run([sys.executable, "-m", "pimm.engine.worker", "--run-dir", str(run_dir)],
                         check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1
    assert "was not prepared" in res.stderr and "pimm launch" in res.stderr and "--dry-run" in res.stderr
    assert not run_dir.exists()


def test_registries_hold_exactly_the_names_the_launcher_accepts():
    from pimm.data.dataset import DATASETS
    from pimm.engine.optim import OPTIMIZERS, SCHEDULERS
    from pimm.models import MODELS
    from pimm.tasks import TASKS

    for registry, known in ((OPTIMIZERS, names.OPTIMIZERS), (SCHEDULERS, names.SCHEDULERS),
                            (MODELS, names.MODELS), (DATASETS, names.DATASETS), (TASKS, names.TASKS)):
        assert registry.names() == sorted(known), registry.kind
