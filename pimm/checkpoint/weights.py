"""Plain weight files (model_best.pth, iter_<step>.pth, exported model.safetensors) and warm starts from them,
including the layouts the field publishes (Pointcept and published-trainer payloads, Sonata pretraining,
Hugging Face exports and hf:// addresses) and the key-map presets that name them."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import pickle
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from pimm.checkpoint.hub import fetch_hub_weights, is_hub_path
from pimm.checkpoint.layout import COMPLETE, LAST, TRAINER, WEIGHTS, CheckpointError, read_manifest
from pimm.files import atomic_path
from pimm.models import build_model

_SHOWN = 3  # mismatched keys named per kind in a message
EXPORTED_WEIGHTS = "model.safetensors"  # a `pimm export` directory: these weights and config.json
EXPORTED_CONFIG = "config.json"
SHARDED_INDEX = "model.safetensors.index.json"  # Hugging Face's sharded weights: {"weight_map": {name: shard file}}
PUBLISHED_WEIGHTS = "model.pth"  # `pimm export --layout published`: {"state_dict": {"module." + name: tensor}}


def save_weight_file(state_dict: dict, path: Path) -> Path:
    """torch.save to a temporary name, fsync, then rename (pimm.files.atomic_path): a reader (or a
    power loss) never sees half a file; the file gets the user's umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save(state_dict, tmp)
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


def resolve_weight_path(path: str | Path, download: bool = True) -> Path:
    """A .pth or .safetensors file, an exported directory (`pimm export`, or a Hugging Face snapshot:
    model.safetensors, else its one .pth), a checkpoint directory (which must be complete), or
    `hf://owner/name[@revision][/file]` (fetched into the Hugging Face cache when `download`, read from
    it otherwise: pimm.checkpoint.hub) -> the weights file."""
    if is_hub_path(path):
        path = fetch_hub_weights(str(path), download)
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"No weight found at {path}: give a weights file (weights.pth, model_best.pth, iter_<step>.pth), "
            "a complete checkpoint directory (model/last), a directory written by `pimm export` or a Hugging Face "
            "snapshot, or hf://owner/name"
        )
    if path.is_dir():
        if (path / EXPORTED_WEIGHTS).is_file():
            return path / EXPORTED_WEIGHTS
        if (path / SHARDED_INDEX).is_file():
            return path / SHARDED_INDEX
        # a checkpoint, or a run's model/ directory (its model_best.pth is not picked in silence)
        is_checkpoint = any((path / name).exists() for name in (WEIGHTS, TRAINER, COMPLETE, LAST))
        if not is_checkpoint and ((path / EXPORTED_CONFIG).is_file() or any(path.glob("*.pth"))):
            return _single_pth(path)
        read_manifest(path)  # 'Incomplete checkpoint directory ...' when it is not complete
        return path / WEIGHTS
    return path


def _single_pth(directory: Path) -> Path:
    """The one .pth file of an export or Hugging Face directory without model.safetensors."""
    found = sorted(p.name for p in directory.glob("*.pth") if p.is_file())
    if len(found) == 1:
        return directory / found[0]
    if found:
        raise CheckpointError(
            f"{directory} holds {len(found)} weight files ({', '.join(found[:6])}{', ...' if len(found) > 6 else ''})"
            f" and no {EXPORTED_WEIGHTS}; name the one to load: {directory / found[0]} (or hf://owner/name/"
            f"{found[0]} for a Hugging Face repository)"
        )
    raise CheckpointError(
        f"export directory {directory} has {EXPORTED_CONFIG} but no {EXPORTED_WEIGHTS} or .pth file (the export did "
        "not finish); export the run again with `pimm export --run-dir RUN NEW_DIR`"
    )


def _load_error_detail(exc: Exception) -> str:
    """The informative part of a torch.load error (its weights_only errors are mostly boilerplate)."""
    text = str(exc).strip()
    unpickler = re.search(r"WeightsUnpickler error:\s*(.+?)(\n\n|$)", text, re.S)
    first = unpickler.group(1).strip() if unpickler else (text.splitlines()[0] if text else "")
    return f"{type(exc).__name__}: {first:.160}" if first else type(exc).__name__


_DDP_PREFIX = "module."  # DistributedDataParallel's name for the wrapped model
# where checkpoints keep the weights: Pointcept and the published trainer under 'state_dict' (beside epoch,
# optimizer, scheduler, ...), mmengine-style ones under 'model', some under 'model' -> 'state_dict'
_NESTED_KEYS = ("state_dict", "model")


def _unwrap(state: dict) -> dict:
    """The weights of a checkpoint that holds them at the top level or under 'state_dict', 'model' or
    'model' -> 'state_dict', with a DDP 'module.' prefix removed when every key has it."""
    for _ in range(len(_NESTED_KEYS)):
        if state and all(isinstance(v, torch.Tensor) for v in state.values()):
            break
        inner = next((state[k] for k in _NESTED_KEYS if isinstance(state.get(k), dict) and state[k]), None)
        if inner is None:
            break
        state = inner
    if state and all(isinstance(k, str) and k.startswith(_DDP_PREFIX) for k in state):
        state = {k[len(_DDP_PREFIX):]: v for k, v in state.items()}
    return state


def _top_level(state: dict) -> str:
    """A checkpoint's top-level keys with what each holds, for a message: 'epoch (int), optimizer (dict), ...'."""
    shown = [f"{k!r} ({type(v).__name__})" for k, v in list(state.items())[:8]]
    return ", ".join(shown) + (", ..." if len(state) > 8 else "")


class _Inert:
    """Stands in, while a checkpoint is read, for a class or function that the file names beside its
    weights (a numpy scalar, an old scheduler's bound method): never called, so nothing in the file runs."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


def _torch_load(path: Path, mmap: bool) -> object:
    """torch.load(weights_only=True); a file that also names code beside its tensors (the published
    trainer's payload keeps numpy scalars and scheduler state) is read again with each such name
    replaced by _Inert, so what is not a tensor is dropped and nothing in the file is executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (ValueError, RuntimeError, OSError):  # not a zip-format file: nothing to read around
            names = []
        if not names:
            raise
        with torch.serialization.safe_globals([(_Inert, name) for name in names]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file (a format that holds tensors only: nothing to unpickle)."""
    try:
        return _unwrap(load_file(path, device="cpu"))
    except Exception as exc:
        raise CheckpointError(
            f"cannot read weights {path}: not a safetensors file ({type(exc).__name__}: {str(exc):.160}); "
            "export the run again with `pimm export`"
        ) from exc


def _read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """The tensors of Hugging Face's sharded safetensors: every shard `index`'s weight_map names, each
    a file beside it, merged; CheckpointError for an unreadable index, a shard that is missing or
    outside the directory, or a name the index promises that its shard lacks."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {index}: not a safetensors index with a weight_map ({exc})") from exc
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or not (index.parent / shard).is_file():
            raise CheckpointError(f"{index} names the shard {shard!r}, which is not a file beside it; download the "
                                  "whole snapshot (every model-*.safetensors) into one directory")
        state.update(_read_safetensors(index.parent / shard))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise CheckpointError(f"{index} promises {len(missing)} tensor(s) its shards do not hold (first: "
                              f"{missing[0]!r}); download the snapshot again")
    return state


def _read_state_dict(path: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """torch.load a file that must hold a state_dict (str -> tensor) at its top level or under
    'state_dict' / 'model' (_unwrap), or read a .safetensors file; CheckpointError otherwise."""
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.name.endswith(".safetensors.index.json"):
        return _read_sharded(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
            warnings.simplefilter("ignore")
            try:
                state = _torch_load(path, mmap)
            except RuntimeError:
                if not mmap:
                    raise
                # only zip-format files can be memory-mapped: a legacy file loads without, anything else fails
                state = _torch_load(path, False)
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
    weights = _unwrap(state)
    bad = [k for k, v in weights.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad or not weights:
        held = f"key {bad[0]!r} holds {type(weights[bad[0]]).__name__}, not a tensor" if bad else "it holds nothing"
        raise CheckpointError(
            f"weights {path} are not a state_dict of tensors ({held}; the file's top-level keys: {_top_level(state)});"
            " pimm reads the tensors at the top level or under 'state_dict', 'model' or 'model' -> 'state_dict': "
            "save model.state_dict() there"
        )
    return weights


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
    return check_pretrained_fits(path, model_cfg).path


@dataclass
class WeightMatch:
    """How a weights file meets a model: what loads, and what does not and why."""

    path: Path
    strict: bool
    loaded: dict[str, torch.Tensor] = field(repr=False)  # model name -> tensor (after key_map)
    skipped: list[str]  # file keys (after key_map) left out by pretrained.skip
    missing: list[str]  # model keys the file does not give (they keep their initial values)
    unexpected: list[str]  # file keys the model does not have
    mismatched: list[tuple[str, list[int], list[int]]]  # (key, shape in the file, shape in the model)
    expected: int  # the model's state_dict entries
    left_out: list[str] = field(default_factory=list)  # file keys (after key_map) that a preset does not load
    key_map: str | None = None  # the preset's name, when key_map is one
    source: str = ""  # the hf:// address that `path` was fetched from

    @property
    def complete(self) -> bool:
        """Every model entry loads and every file entry is used (skipped ones aside)."""
        return len(self.loaded) == self.expected and not self.unexpected

    def summary(self) -> str:
        """One line: loaded N, skipped K, missing M (...), unexpected U (...), shape-mismatched S (...)."""
        shapes = [f"{k} {a} in the file, {b} in the model" for k, a, b in self.mismatched[:_SHOWN]]
        parts = [f"loaded {len(self.loaded)} of {self.expected}", _counted("skipped", self.skipped),
                 _counted("missing", self.missing), _counted("unexpected", self.unexpected),
                 _counted("shape-mismatched", shapes, len(self.mismatched), sep="; ")]
        if self.left_out:
            groups = _groups(self.left_out)
            parts.append(f"left out by key_map={self.key_map!r} {len(self.left_out)} ({', '.join(groups)})")
        source = f"{self.source} -> " if self.source else ""
        return f"weights {source}{self.path}: " + ", ".join(parts)

    def facts(self) -> dict:
        """For provenance.json: the counts and the first names of each kind."""
        return {
            "path": str(self.path), "strict": self.strict, "loaded": len(self.loaded), "model_entries": self.expected,
            "skipped": len(self.skipped), "missing": len(self.missing), "unexpected": len(self.unexpected),
            "shape_mismatched": len(self.mismatched), "key_map": self.key_map, "left_out": len(self.left_out),
            "left_out_groups": _groups(self.left_out), "source": self.source or str(self.path),
            "first": {"skipped": self.skipped[:_SHOWN], "missing": self.missing[:_SHOWN],
                      "unexpected": self.unexpected[:_SHOWN],
                      "shape_mismatched": [list(m) for m in self.mismatched[:_SHOWN]]},
            "summary": self.summary(),
        }


def _counted(kind: str, names: list[str], count: int | None = None, sep: str = ", ") -> str:
    count = len(names) if count is None else count
    if not count:
        return f"{kind} 0"
    more = f"{sep}..." if count > len(names[:_SHOWN]) else ""
    return f"{kind} {count} ({sep.join(names[:_SHOWN])}{more})"


def _map_keys(state: dict, key_map: list | tuple) -> dict:
    """Rename keys by the first (old_prefix, new_prefix) of `key_map` that a key starts with."""
    if not key_map:
        return state
    mapped: dict = {}
    for key, value in state.items():
        new = key
        for old_prefix, new_prefix in key_map:
            if key.startswith(old_prefix):
                new = new_prefix + key[len(old_prefix):]
                break
        if new in mapped:
            raise CheckpointError(f"pretrained.key_map maps two keys of the weights to {new!r} (one of them {key!r}); "
                                  "make the renames distinct")
        mapped[new] = value
    return mapped


@dataclass(frozen=True)
class KeyMapPreset:
    """A named pretrained.key_map: prefix renames, then which renamed keys the load may use."""

    renames: tuple[tuple[str, str], ...]  # (old_prefix, new_prefix), the first that applies (after _unwrap)
    loads: str = ""  # only renamed keys under this prefix load; the others are left out and reported
    pretraining_only: tuple[str, ...] = ()  # renamed keys left out when the model has no such entry


# The names as the published code writes them (DeepLearnPhysics/pimm, Pointcept): pimm.engines.hooks.misc's
# CheckpointSaver keeps the DDP model's state_dict ("module." + name) under "state_dict"; its CheckpointLoader
# drops "module." and, for the Sonata fine-tune recipes (configs/panda/semseg/*-ft-5cls-{lin,dec,fft}.py),
# replaces "module.student.backbone" by "module.backbone". The Sonata model (pimm/models/sonata/
# sonata_v1m1_base.py) holds student and teacher, each a backbone and mask/unmask heads; its backbone's
# embedding.mask_token (mask_token=True) is used by pretraining only.
KEY_MAP_PRESETS = {
    "pointcept": KeyMapPreset(renames=(("module.", ""),)),  # module.backbone.* -> backbone.*, module.seg_head.* ...
    "sonata": KeyMapPreset(renames=(("module.student.backbone.", "backbone."), ("student.backbone.", "backbone.")),
                           loads="backbone.", pretraining_only=("backbone.embedding.mask_token",)),
}


def _groups(names: list[str]) -> list[str]:
    """Names for a message, grouped by their first two components: 'teacher.backbone.*', or a name alone."""
    counts: dict[str, list[str]] = {}
    for name in names:
        counts.setdefault(".".join(name.split(".")[:2]), []).append(name)
    return [f"{group}.*" if len(members) > 1 else members[0] for group, members in counts.items()]


def _apply_key_map(state: dict, key_map, expected: dict) -> tuple[dict, list[str]]:
    """(the renamed state, the renamed keys a preset leaves out) for a key_map that is a list of
    [old_prefix, new_prefix] pairs or the name of a preset (KEY_MAP_PRESETS)."""
    if not isinstance(key_map, str):
        return _map_keys(state, [tuple(pair) for pair in key_map or []]), []
    preset = KEY_MAP_PRESETS.get(key_map)
    if preset is None:
        raise CheckpointError(f"pretrained.key_map={key_map!r} is not a preset; the presets are "
                              f"{', '.join(KEY_MAP_PRESETS)}, or give a list of [old_prefix, new_prefix] pairs")
    state = _map_keys(state, preset.renames)
    left_out = [k for k in state if not k.startswith(preset.loads)
                or (k in preset.pretraining_only and k not in expected)]
    dropped = set(left_out)
    return {k: v for k, v in state.items() if k not in dropped}, left_out


def match_weights(path: Path, state: dict, expected: dict[str, torch.Size], pretrained: dict | None = None
                  ) -> WeightMatch:
    """Match a state_dict to the model's entries (name -> shape) after pretrained.key_map (pairs or a
    preset's name) and pretrained.skip; the matching names with matching shapes load."""
    pretrained = pretrained or {}
    key_map = pretrained.get("key_map")
    state, left_out = _apply_key_map(state, key_map, expected)
    skip = list(pretrained.get("skip") or [])
    skipped = [k for k in state if any(fnmatch.fnmatchcase(k, pattern) for pattern in skip)]
    used = {k: v for k, v in state.items() if k not in set(skipped)}
    mismatched = [(k, list(used[k].shape), list(expected[k])) for k in expected
                  if k in used and tuple(used[k].shape) != tuple(expected[k])]
    bad = {k for k, _, _ in mismatched}
    return WeightMatch(
        path=path, strict=bool(pretrained.get("strict", True)),
        loaded={k: v for k, v in used.items() if k in expected and k not in bad},
        skipped=skipped,
        missing=[k for k in expected if k not in state],
        unexpected=[k for k in used if k not in expected],
        mismatched=mismatched,
        expected=len(expected),
        left_out=left_out,
        key_map=key_map if isinstance(key_map, str) else None,
    )


def differences(match: WeightMatch) -> list[str]:
    """What keeps a strict load of `match` from working, as counted phrases with the first names:
    missing keys, unexpected keys, shape mismatches (each shape in the file and in the model)."""
    parts = []
    if match.missing:
        parts.append(_listed(len(match.missing), "missing key", "missing keys", match.missing[:_SHOWN]))
    if match.unexpected:
        parts.append(_listed(len(match.unexpected), "unexpected key", "unexpected keys", match.unexpected[:_SHOWN]))
    if match.mismatched:
        shown = [f"{k}: {a} in the file, {b} in the model" for k, a, b in match.mismatched[:_SHOWN]]
        parts.append(_listed(len(match.mismatched), "shape mismatch", "shape mismatches", shown, sep="; "))
    return parts


def _layout_hint(match: WeightMatch) -> str:
    """What the unmatched names suggest, as a sentence to append ('' when nothing does)."""
    missing = set(match.missing)
    if match.key_map != "sonata" and any(k.startswith("student.backbone.") for k in match.unexpected):
        return ("; the file is a Sonata pretraining checkpoint (student.backbone.*, teacher.*): set "
                "pretrained.key_map='sonata' to load its student backbone as backbone.*")
    for old, new in (("", "backbone."), ("backbone.", "")):
        fixed = [k for k in match.unexpected if k.startswith(old) and new + k[len(old):] in missing]
        if fixed:
            return (f"; {len(fixed)} of the file's names match the model with {new or 'no'} prefix "
                    f"({fixed[0]} -> {new + fixed[0][len(old):]}): set pretrained.key_map=[[{old!r}, {new!r}]]")
    return ""


def _refuse(match: WeightMatch, model_cfg: dict, given: str | Path) -> None:
    """CheckpointError for a strict load that is not complete, or a partial load of nothing."""
    if not match.strict and match.loaded:
        return
    if match.strict and match.complete:
        return
    parts = differences(match)
    left_out = [k for k in match.skipped if k not in match.unexpected]
    if match.strict and left_out and not parts:
        parts.append(_listed(len(left_out), "key left out by pretrained.skip", "keys left out by pretrained.skip",
                             left_out[:_SHOWN]))
    if match.left_out and not match.loaded:
        groups = ", ".join(_groups(match.left_out))
        parts.append(f"{len(match.left_out)} keys left out by key_map={match.key_map!r} ({groups})")
    hint = _layout_hint(match)
    if not match.strict:
        raise CheckpointError(
            f"weights {given} share no parameter (name and shape) with model {_model_name(model_cfg)}: "
            f"{', '.join(parts) or 'the file is empty'}{hint}; map the file's names with pretrained.key_map "
            f"(a preset: {', '.join(KEY_MAP_PRESETS)}; or pairs, e.g. [['backbone.', '']]) or give weights of this "
            "model"
        )
    raise CheckpointError(
        f"weights {given} do not fit model {_model_name(model_cfg)}: {', '.join(parts)}{hint}; give weights saved "
        "from this model config, or set model.* to the config of the run that saved them (its config.py, or the "
        "model entry of an export's config.json); to load only what matches, set pretrained.strict=false "
        "(with pretrained.skip=['head.*'] for a new head)"
    )


def model_entries(model_cfg: dict) -> dict[str, torch.Size]:
    """name -> shape of every state_dict entry of the model `model_cfg` builds, built on the meta
    device (no memory, no initialisation)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in build_model(model_cfg).state_dict().items()}


def check_pretrained_fits(path: str | Path, model_cfg: dict, pretrained: dict | None = None) -> WeightMatch:
    """Before any process starts: match the weights at `path` (hf:// weights are downloaded into the
    Hugging Face cache here) to the model `model_cfg` builds, with the `pretrained` options (key_map,
    skip, strict); CheckpointError when strict and anything does not fit, or when nothing loads. The
    model is built on the meta device (no memory, no init) and the file is memory-mapped, so this is cheap."""
    resolved = resolve_weight_path(path)
    state = _read_state_dict(resolved, mmap=True)
    match = match_weights(resolved, state, model_entries(model_cfg), pretrained)
    match.source = str(path) if is_hub_path(path) else ""
    _refuse(match, model_cfg, path)
    return match


def load_pretrained(path: str | Path, expected: dict[str, torch.Size], model_cfg: dict,
                    pretrained: dict | None = None) -> WeightMatch:
    """In a rank: the weights at `path` matched to the model's entries (name -> shape); the
    tensors that load are `.loaded`. hf:// weights are read from the Hugging Face cache, never
    downloaded: the launcher fetched them (check_pretrained_fits), so every rank reads the same
    files. Raises as check_pretrained_fits."""
    resolved = resolve_weight_path(path, download=False)
    match = match_weights(resolved, _read_state_dict(resolved), expected, pretrained)
    match.source = str(path) if is_hub_path(path) else ""
    _refuse(match, model_cfg, path)
    return match
