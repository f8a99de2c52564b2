"""Reading trainer.dcp so that a tampered checkpoint cannot run code (checkpoint format 2).

torch.distributed.checkpoint, left to itself, unpickles `.metadata` with a bare `pickle.load`
and every non-tensor entry with `torch.load(weights_only=False)`: either runs whatever a crafted
file asks for. Here:
  - `.metadata` goes through an unpickler that knows only the DCP metadata classes and the few
    torch names such a file holds; any other global is refused, naming the file;
  - non-tensor entries (the optimizer's param_groups values, which DCP stores as objects) are
    loaded with `torch.load(weights_only=True)`;
  - pimm's own state (scheduler, trainer state, RNG states) is stored as uint8 tensors holding
    `torch.save` bytes (`pack`), read back with `torch.load(weights_only=True)` (`unpack`).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from pimm.checkpoint.layout import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# every global a pimm trainer.dcp/.metadata holds (torch dtypes are allowed by type, below)
_ALLOWED_GLOBALS = {
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 pickles it
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(CheckpointError):
    """The checkpoint asks for something pimm never stores (a tampered or foreign file): refused."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"refusing to load {self.path}: it asks for the Python object {module}.{name}, which a pimm "
            "checkpoint never holds (the file may have been tampered with); resume from another checkpoint "
            "or start a new run"
        )


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` is read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"  # pimm always writes the global one
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh, path).load()
        except UnsafeCheckpoint:
            raise
        except Exception as exc:  # truncated or garbled: unpickling errors come in many types
            raise CheckpointError(f"corrupt checkpoint file {path}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"refusing to load {path}: it holds a {type(metadata).__name__}, not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner whose object entries are loaded with torch.load(weights_only=True)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_weights_only(value, f"the object entry {fqn} of {self.path}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_metadata(path: Path) -> Metadata:
    """The metadata of the trainer.dcp directory `path`, read safely."""
    return SafeReader(path).read_metadata()


def load(state: dict, path: Path, group) -> None:
    """dcp.load `state` in place from `path` safely (every rank; `group` None without a process
    group). Raises UnsafeCheckpoint for refused content, CheckpointError for any other failure."""
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path),
                 process_group=group, no_dist=group is None)
    except CheckpointException as exc:  # a BaseException: the errors of every rank, gathered
        errors = {rank: error for rank, (error, _) in exc.failures.items()}
        for error in errors.values():  # so every rank raises the same refusal
            if isinstance(error, UnsafeCheckpoint):
                raise UnsafeCheckpoint(str(error)) from None
        detail = "; ".join(f"rank {rank}: {type(e).__name__}: {str(e)[:300]}" for rank, e in errors.items())
        raise CheckpointError(f"cannot read {path}: {detail}") from None
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {str(exc)[:300]}") from exc


def pack(obj, what: str) -> torch.Tensor:
    """`obj` as a uint8 tensor of its torch.save bytes. Raises CheckpointError now, at save time,
    when torch.load(weights_only=True) would refuse it at resume; `what` names it in the message."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot checkpoint {what}: a safe load would refuse its state ({_reason(exc)}); the state must "
            "hold only tensors, numbers, strings, None, and lists, tuples or dicts of them"
        ) from None
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(tensor: torch.Tensor, what: str):
    """The object `pack` stored in `tensor`."""
    return _load_weights_only(io.BytesIO(tensor.numpy().tobytes()), what)


def packed_template(metadata: Metadata, key: str, path: Path) -> torch.Tensor:
    """An empty tensor of the saved size for the packed entry `key` (so dcp.load can fill it)."""
    entry = metadata.state_dict_metadata.get(key)
    if not isinstance(entry, TensorStorageMetadata) or entry.properties.dtype != torch.uint8 or len(entry.size) != 1:
        seen = type(entry).__name__ if entry is not None else "missing"
        raise UnsafeCheckpoint(
            f"refusing to load {path}: its entry {key} is {seen}, not the uint8 tensor of pimm checkpoint format 2"
        )
    return torch.empty(entry.size[0], dtype=torch.uint8)


def _load_weights_only(stream: io.BytesIO, what: str):
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UnsafeCheckpoint(f"refusing to load {what}: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """The one line of torch's weights_only error that says what was refused."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?: Please use|\n\n|$)", text, re.S)
    return " ".join((found.group(1) if found else text).split())[:300]
