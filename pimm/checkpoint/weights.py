"""Plain weight files (model_best.pth, iter_<step>.pth, exported model.safetensors) and warm starts from them."""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from pimm.checkpoint.layout import WEIGHTS, CheckpointError, fsync, read_manifest

_SHOWN = 3  # mismatched keys named per kind in a message
EXPORTED_WEIGHTS = "model.safetensors"  # a `pimm export` directory: these weights and config.json
EXPORTED_CONFIG = "config.json"


def save_weight_file(state_dict: dict, path: Path) -> Path:
    """torch.save to a temporary name, fsync, then rename: a reader (or a power loss) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save(state_dict, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)
    return path


def save(obj, path: Path) -> None:
    """torch.save, except that a full disk is an OSError(ENOSPC) naming `path`: torch's zip writer
    reports it as 'RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos'."""
    try:
        torch.save(obj, path)
    except RuntimeError as exc:
        try:
            full = shutil.disk_usage(path.parent).free < _NEARLY_FULL
        except OSError:
            full = False
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
        raise


_NEARLY_FULL = 1 << 20  # bytes free after a failed write that say the write failed for want of space


def resolve_weight_path(path: str | Path) -> Path:
    """A .pth or .safetensors file, an exported directory (`pimm export`), or a checkpoint directory
    (which must be complete) -> the weights file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"No weight found at {path}: give a weights file (weights.pth, model_best.pth, iter_<step>.pth), "
            "a complete checkpoint directory (model/last) or a directory written by `pimm export`"
        )
    if path.is_dir():
        if (path / EXPORTED_WEIGHTS).is_file():
            return path / EXPORTED_WEIGHTS
        if (path / EXPORTED_CONFIG).is_file():
            raise CheckpointError(
                f"export directory {path} has {EXPORTED_CONFIG} but no {EXPORTED_WEIGHTS} (the export did not "
                "finish); export the run again with `pimm export --run-dir RUN NEW_DIR`"
            )
        read_manifest(path)  # 'Incomplete checkpoint directory ...' when it is not complete
        return path / WEIGHTS
    return path


def _load_error_detail(exc: Exception) -> str:
    """The informative part of a torch.load error (its weights_only errors are mostly boilerplate)."""
    text = str(exc).strip()
    unpickler = re.search(r"WeightsUnpickler error:\s*(.+?)(\n\n|$)", text, re.S)
    first = unpickler.group(1).strip() if unpickler else (text.splitlines()[0] if text else "")
    return f"{type(exc).__name__}: {first:.160}" if first else type(exc).__name__


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file (a format that holds tensors only: nothing to unpickle)."""
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"cannot read weights {path}: not a safetensors file ({type(exc).__name__}: {str(exc):.160}); "
            "export the run again with `pimm export`"
        ) from exc


def _read_state_dict(path: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """torch.load a file that must hold a state_dict (str -> tensor), or read a .safetensors file;
    CheckpointError otherwise."""
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
            warnings.simplefilter("ignore")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                # only zip-format files can be memory-mapped: a legacy file loads without, anything else fails
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read weights {path}: not a torch file of tensors ({_load_error_detail(exc)}); give a file "
            "written by torch.save(model.state_dict(), ...), such as model/last/weights.pth or model/model_best.pth"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(
            f"weights {path} hold a {type(state).__name__}, not a state_dict; save model.state_dict() (a dict of "
            "tensors) instead"
        )
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            nested = [k for k, v in state.items() if isinstance(v, dict)][:1]
            hint = f" (the weights may be under its key {nested[0]!r})" if nested else ""
            raise CheckpointError(
                f"weights {path} are not a state_dict of tensors: key {key!r} holds {type(value).__name__}, not a "
                f"tensor{hint}; save model.state_dict() instead"
            )
    return state


def load_weight_file(path: str | Path) -> dict:
    """The state_dict in a weights file or complete checkpoint directory, on the CPU."""
    return _read_state_dict(resolve_weight_path(path))


def _model_name(model_cfg: dict) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in model_cfg.items() if k != "type")
    return f"{model_cfg.get('type')}({args})"


def _listed(count: int, singular: str, plural: str, items: list[str], sep: str = ", ") -> str:
    more = f"{sep}..." if count > len(items) else ""
    return f"{count} {singular if count == 1 else plural} ({sep.join(items)}{more})"


def check_weights_fit(path: str | Path, model_cfg: dict) -> Path:
    """Check, before any process starts, that the weights at `path` load into the model that
    `model_cfg` builds (same keys, same shapes); return the weights file. The model is built on
    the meta device (no memory, no init) and the file is memory-mapped, so this is cheap."""
    from pimm.models import build_model

    resolved = resolve_weight_path(path)
    state = _read_state_dict(resolved, mmap=True)
    with torch.device("meta"):
        expected = build_model(model_cfg).state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if not (missing or unexpected or mismatched):
        return resolved
    parts = []
    if missing:
        parts.append(_listed(len(missing), "missing key", "missing keys", missing[:_SHOWN]))
    if unexpected:
        parts.append(_listed(len(unexpected), "unexpected key", "unexpected keys", unexpected[:_SHOWN]))
    if mismatched:
        shown = [f"{k}: {list(state[k].shape)} in the file, {list(expected[k].shape)} in the model"
                 for k in mismatched[:_SHOWN]]
        parts.append(_listed(len(mismatched), "shape mismatch", "shape mismatches", shown, sep="; "))
    raise CheckpointError(
        f"weights {path} do not fit model {_model_name(model_cfg)}: {', '.join(parts)}; give weights saved from "
        "this model config, or set model.* to the config of the run that saved them (its config.py, or the "
        "model entry of an export's config.json)"
    )
