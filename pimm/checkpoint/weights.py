"""Weight files: model/last/weights.pth (atomic, `.complete` last) and model/model_best.pth."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_last_weights(model_dir: Path, state_dict: dict, train_state: dict) -> Path:
    """Write a complete `last/` beside the old one, then swap: a crash never leaves no checkpoint."""
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = model_dir / ".last.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    torch.save(state_dict, staging / "weights.pth")
    (staging / "state.json").write_text(json.dumps(train_state))
    (staging / ".complete").write_text("")
    last = model_dir / "last"
    previous = model_dir / ".last.old"
    shutil.rmtree(previous, ignore_errors=True)
    if last.exists():
        os.replace(last, previous)
    os.replace(staging, last)
    shutil.rmtree(previous, ignore_errors=True)
    return last


def save_best_weights(model_dir: Path, state_dict: dict) -> Path:
    path = model_dir / "model_best.pth"
    _atomic_torch_save(state_dict, path)
    return path
