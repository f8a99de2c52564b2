"""How pimm opens the HDF5 files it reads, and what h5py raises on a bad one: shared by every
format module (pimm's event files, PILArNet-M shards, prediction files)."""

from __future__ import annotations

from pathlib import Path

import h5py

# files are written once and moved into place, so readers need no HDF5 file locks (which fail on
# some parallel file systems)
READ_KW = {"mode": "r", "locking": False}
H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError)  # what h5py raises on bad files


def open_read(path: str | Path) -> h5py.File:
    """`path` opened for reading without file locks; h5py's error (one of H5_ERRORS) when it cannot be."""
    return h5py.File(path, **READ_KW)


def text_attribute(path: str | Path, name: str) -> str | None:
    """The attribute `name` of the HDF5 file `path` as text; None when the file is not readable HDF5
    or has no such attribute."""
    try:
        with open_read(path) as f:
            value = f.attrs.get(name)
    except H5_ERRORS:
        return None
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
