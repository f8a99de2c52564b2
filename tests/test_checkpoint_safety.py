"""Checkpoints that cannot run code when loaded (format 2), and that survive crashes and power
loss: fsync, finishing interrupted writes, deleting through .trash-*."""

import builtins
import datetime
import math
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import attempts, launch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pimm.checkpoint import safe_dcp
from pimm.checkpoint.layout import (
    COMPLETE,
    LAST,
    TRAINER,
    CheckpointError,
    candidates,
    newest_resumable,
    verify,
    write_manifest,
)
from pimm.checkpoint.manager import CheckpointManager
from pimm.checkpoint.state import rng_states, set_rng_states

CPU = torch.device("cpu")


class Evil:
    """Unpickling this creates `marker` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


# -- format 2: pack / unpack -------------------------------------------------------------------


def test_rng_states_round_trip_exactly():
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    np.random.standard_normal()  # numpy now holds a cached gaussian too
    saved = safe_dcp.unpack(safe_dcp.pack(rng_states(CPU), "rng"), "rng")
    expected = (torch.rand(5), np.random.standard_normal(5), [random.random() for _ in range(5)])
    set_rng_states(saved, CPU)
    assert torch.equal(torch.rand(5), expected[0])
    assert np.array_equal(np.random.standard_normal(5), expected[1])
    assert [random.random() for _ in range(5)] == expected[2]


@pytest.mark.parametrize("kind", ["OneCycleLR", "MultiStepLR"])
def test_scheduler_state_round_trips_mid_schedule(kind):
    def make():
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([param], lr=1e-3)
        if kind == "OneCycleLR":
            return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=20)
        return optimizer, torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[9, 12])  # a Counter

    optimizer, scheduler = make()
    for _ in range(7):
        optimizer.step(), scheduler.step()
    state = safe_dcp.unpack(safe_dcp.pack(scheduler.state_dict(), kind), kind)
    assert state == scheduler.state_dict()
    optimizer2, scheduler2 = make()
    scheduler2.load_state_dict(state)
    optimizer2.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]
    for _ in range(10):
        optimizer.step(), scheduler.step(), optimizer2.step(), scheduler2.step()
        assert scheduler2.get_last_lr() == scheduler.get_last_lr()  # exactly


def test_trainer_state_keeps_minus_infinity_and_exact_floats():
    blob = {"state": {"step": 5, "epoch": 0, "samples_in_epoch": 20, "best_metric": -math.inf},
            "cursor": {"data_hash": "ab12", "global_batch_size": 4, "x": 0.1 + 0.2}}
    back = safe_dcp.unpack(safe_dcp.pack(blob, "trainer"), "trainer")
    assert back == blob and back["state"]["best_metric"] == -math.inf


def test_a_scheduler_state_a_safe_load_would_refuse_fails_at_save_naming_it():
    with pytest.raises(CheckpointError, match="the state of the LR scheduler Mine.*refuse"):
        safe_dcp.pack({"since": datetime.date(2025, 1, 1)}, "the state of the LR scheduler Mine")


# -- tampered checkpoints are refused through `pimm launch --train.resume` ---------------------


# `interrupted` (conftest): a shared 1-rank run stopped at step 2; each test below works on a copy.


def _rewrite_trainer_dcp(ckpt: Path, change) -> None:
    """Load trainer.dcp in full (we made it: trusted here), `change` the state, write it back."""
    flat = ckpt.parent / "full.pt"
    dcp_to_torch_save(ckpt / TRAINER, flat)
    state = torch.load(flat, weights_only=False)
    flat.unlink()
    change(state)
    shutil.rmtree(ckpt / TRAINER)
    dcp.save(state, checkpoint_id=ckpt / TRAINER, no_dist=True)


def _poison_metadata(ckpt: Path, marker: Path) -> None:
    path = ckpt / TRAINER / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    metadata.storage_meta.modules = [Evil(marker)]
    path.write_bytes(pickle.dumps(metadata))


TAMPER = {
    "optimizer_entry": lambda ckpt, marker: _rewrite_trainer_dcp(
        ckpt, lambda s: s["optimizer"]["param_groups"][0].update(lr=Evil(marker))),
    "trainer_entry": lambda ckpt, marker: _rewrite_trainer_dcp(  # pimm's own entry: a uint8 tensor
        ckpt, lambda s: s.update(trainer=torch.tensor(list(pickle.dumps(Evil(marker), 2)), dtype=torch.uint8))),
    "metadata": _poison_metadata,
}


@pytest.mark.parametrize("where", sorted(TAMPER))
def test_resume_refuses_a_tampered_checkpoint_without_running_it(tmp_path, tiny_data, interrupted, where):
    exp = tmp_path / "exp"
    shutil.copytree(interrupted.parents[1], exp)
    ckpt = exp / "tests" / interrupted.name / "model" / LAST
    marker = tmp_path / "pwned"
    TAMPER[where](ckpt, marker)
    write_manifest(ckpt, 2)  # an attacker rewrites the hashes too
    verify(ckpt)
    res, _ = launch(exp, tiny_data, 1, resume=True)
    assert res.returncode != 0
    named = ckpt / TRAINER / ".metadata" if where == "metadata" else ckpt / TRAINER
    assert f"refusing to load {named}" in res.stderr or f"of {named}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not marker.exists()


def test_resume_refuses_the_old_pickled_format_with_what_to_do(tmp_path, tiny_data, interrupted):
    exp = tmp_path / "exp"
    shutil.copytree(interrupted.parents[1], exp)
    ckpt = exp / "tests" / interrupted.name / "model" / LAST
    manifest = ckpt / COMPLETE
    manifest.write_text(manifest.read_text().replace('"format": 3,', ""))
    res, _ = launch(exp, tiny_data, 1, resume=True)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert f"checkpoint {ckpt} is in format 1" in res.stderr and "--train.weight" in res.stderr


# -- durability: fsync, interrupted writes, pruning -------------------------------------------


def _save(manager: CheckpointManager, step: int) -> None:
    state = {"optimizer": {"w": torch.full((3,), float(step))}, "trainer": safe_dcp.pack({"step": step}, "t")}
    manager.save(step, {"w": torch.full((3,), float(step))}, state)


def test_every_file_and_directory_of_a_checkpoint_is_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model_dir = tmp_path / "model"
    _save(CheckpointManager(model_dir, 0, 1, async_save=False), 1)
    staging = model_dir / ".tmp-step_00000001"
    files = [p.relative_to(model_dir / LAST) for p in (model_dir / LAST).rglob("*") if p.is_file()]
    assert len(files) == 4  # weights.pth, .complete, trainer.dcp/.metadata, one .distcp
    for name in files:
        assert staging / (f".{name}.{os.getpid()}.tmp" if str(name) == COMPLETE else name) in synced, name
    for directory in (staging, staging / TRAINER, model_dir):  # after the renames in them
        assert directory in synced, directory


def _interrupted_before_rename(manager: CheckpointManager, step: int, monkeypatch) -> None:
    """A save that stops after writing `.complete` (as a crash before the rename would)."""
    with monkeypatch.context() as patch:
        patch.setattr(manager, "_promote", lambda staging, step: None)
        _save(manager, step)


def test_a_finished_write_newer_than_last_is_promoted_at_resume(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    manager = CheckpointManager(model_dir, 0, 1, keep_last=2, async_save=False)
    _save(manager, 1)
    _save(manager, 2)
    _interrupted_before_rename(manager, 3, monkeypatch)
    assert [c.step for c in candidates(model_dir)[0]] == [2, 1]  # a staging dir is no candidate
    # but it is what a resume goes on from: the pre-flight and a Slurm chain's bookkeeping read this
    assert (newest_resumable(model_dir).path.name, newest_resumable(model_dir).step) == (".tmp-step_00000003", 3)
    found = CheckpointManager(model_dir, 0, 1, keep_last=2).resume_candidates()
    assert [(c.path.name, c.step) for c in found] == [(LAST, 3), ("step_00000002", 2)]
    assert (newest_resumable(model_dir).path.name, newest_resumable(model_dir).step) == (LAST, 3)
    assert sorted(p.name for p in model_dir.iterdir()) == [LAST, "step_00000002"]


def test_a_finished_write_not_newer_than_last_is_removed_at_resume(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    manager = CheckpointManager(model_dir, 0, 1, keep_last=2, async_save=False)
    _interrupted_before_rename(manager, 1, monkeypatch)
    _save(manager, 2)
    assert (newest_resumable(model_dir).path.name, newest_resumable(model_dir).step) == (LAST, 2)
    found = CheckpointManager(model_dir, 0, 1, keep_last=2).resume_candidates()
    assert [(c.path.name, c.step) for c in found] == [(LAST, 2)]
    assert sorted(p.name for p in model_dir.iterdir()) == [LAST]


def test_only_a_finished_write_counts_and_a_link_is_never_followed(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    assert newest_resumable(model_dir) is None  # no model folder yet
    manager = CheckpointManager(model_dir, 0, 1, keep_last=2, async_save=False)
    _interrupted_before_rename(manager, 1, monkeypatch)
    assert newest_resumable(model_dir).step == 1  # a first checkpoint killed before its rename still counts
    (model_dir / ".tmp-step_00000001" / COMPLETE).unlink()  # killed before its manifest: not a checkpoint
    assert newest_resumable(model_dir) is None
    elsewhere = tmp_path / "elsewhere"
    _interrupted_before_rename(CheckpointManager(elsewhere, 0, 1, async_save=False), 5, monkeypatch)
    (model_dir / ".tmp-step_00000005").symlink_to(elsewhere / ".tmp-step_00000005")
    assert newest_resumable(model_dir) is None


def test_pruning_cut_short_leaves_no_complete_checkpoint_with_missing_files(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    manager = CheckpointManager(model_dir, 0, 1, keep_last=1, async_save=False)
    _save(manager, 1)

    def rmtree_cut_short(path, *args, **kwargs):  # deletes one file, then the power goes
        files = [p for p in Path(path).rglob("*") if p.is_file()]
        if files:
            files[0].unlink()
            raise OSError("injected: power loss during the delete")

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", rmtree_cut_short)
        with pytest.raises(OSError, match="injected"):
            _save(manager, 2)
    for path in model_dir.iterdir():
        if (path / COMPLETE).exists():
            verify(path)  # every file its manifest names is there, intact
    assert (model_dir / ".trash-step_00000001").is_dir()
    found = CheckpointManager(model_dir, 0, 1, keep_last=1).resume_candidates()
    assert [(c.path.name, c.step) for c in found] == [(LAST, 2)]
    assert sorted(p.name for p in model_dir.iterdir()) == [LAST]


def test_resume_finishes_a_checkpoint_whose_rename_a_crash_prevented(tmp_path, tiny_data, interrupted):
    exp = tmp_path / "exp"
    shutil.copytree(interrupted.parents[1], exp)
    model_dir = exp / "tests" / interrupted.name / "model"
    (model_dir / LAST).rename(model_dir / ".tmp-step_00000002")  # `.complete` written, not yet renamed
    res, run_dir = launch(exp, tiny_data, 1, "max_steps=3", resume=True)
    assert res.returncode == 0, res.stderr
    assert attempts(run_dir)[-1]["resumed_from"] == str(model_dir / LAST)
    assert attempts(run_dir)[-1]["start_step"] == 2
    assert not list(model_dir.glob(".tmp-*"))
