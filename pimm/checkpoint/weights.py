"""Plain weight files (model_best.pth, iter_<step>.pth) and warm starts from them."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pimm.checkpoint.layout import WEIGHTS, CheckpointError, read_manifest


def save_weight_file(state_dict: dict, path: Path) -> Path:
    """torch.save to a temporary name, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state_dict, tmp)
    os.replace(tmp, path)
    return path


def resolve_weight_path(path: str | Path) -> Path:
    """A .pth file, or a checkpoint directory (which must be complete) -> the weights file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"No weight found at {path}: give a weights file (weights.pth, model_best.pth, iter_<step>.pth) "
            "or a complete checkpoint directory (model/last)"
        )
    if path.is_dir():
        read_manifest(path)  # 'Incomplete checkpoint directory ...' when it is not complete
        return path / WEIGHTS
    return path


def load_weight_file(path: str | Path) -> dict:
    resolved = resolve_weight_path(path)
    try:
        return torch.load(resolved, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read weights {resolved}: {exc}") from exc
