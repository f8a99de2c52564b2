"""Files pimm writes: whole or not at all, with the permissions the user's umask gives, and
failures to write explained for people.

Every file pimm writes for a reader (a run's config, records, exports, event and prediction files,
checkpoint sidecars) goes through `atomic_path` or `write_atomic`: the content lands under a
temporary name in the same folder and is renamed over the final name, so a reader sees the old
file or the whole new one. `tempfile.mkstemp` would leave the file at mode 0600 whatever the
umask, so a colleague could not read a shared export; here the final file gets 0666 & ~umask,
as `open()` would have given it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read without changing it where Linux allows (/proc), else set and reset."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; on success it becomes `path` in one rename,
    with mode 0666 & ~umask; on failure it is removed and `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())
        if durable:
            fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
            fsync(path.parent)


def write_atomic(path: Path, data: str | bytes, durable: bool = True) -> Path:
    """`data` (text as UTF-8, or bytes) into `path` in one rename: see `atomic_path`."""
    with atomic_path(path, durable=durable) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (after creating or renaming in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_error_reason(exc: OSError) -> str:
    """Why a write failed, for people: 'read-only file system', 'no space left on device', or for a
    path through a regular file '<path> is a file, not a directory'."""
    if exc.errno == errno.ENOTDIR and exc.filename:
        path = Path(exc.filename)
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return f"{blocker} is a file, not a directory"
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return text[:1].lower() + text[1:]


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def storage_error(exc: BaseException) -> OSError | None:
    """An OSError that says a disk cannot take more (full, over quota, read-only) in `exc`, its
    causes, or the per-rank failures of a torch.distributed.checkpoint error (one that names its
    file first); None when there is none."""
    found: list[OSError] = []
    seen: set[int] = set()
    todo: list = [exc]
    while todo:
        error = todo.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS:
            found.append(error)
        todo += [error.__context__, error.__cause__]
        failures = getattr(error, "failures", None)  # DCP's CheckpointException: rank -> (error, traceback)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return next((e for e in found if e.filename), found[0] if found else None)
