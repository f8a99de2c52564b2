"""How a rank of a training or an evaluation ends when it fails: one line for the launcher, in
`<folder>/errors/rank<R>.txt` (and a copy in the launcher's local report folder), and the full
traceback in `<folder>/logs/rank<R>.log`. The trainer's worker (pimm.engine.worker) and the
evaluation ranks (pimm.engine.evaluation) both end through here; pimm's exit statuses are in
pimm.errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path

from pimm.errors import EXIT_FAILED, PimmError
from pimm.files import os_error_reason, storage_error, write_atomic

# a folder on this node's local disk where torchrun (torchrun.json: how each failed rank ended) and
# the ranks (rank<R>.txt: their errors, also when the run directory's disk is full) report to the
# launcher (pimm.launch.node sets it for torchrun's environment)
REPORT_DIR_ENV = "PIMM_REPORT_DIR"


def write_error(folder: Path, rank: int, text: str) -> None:
    """`text` into folder/errors/rank{R}.txt, and a copy into the launcher's local report folder
    ($PIMM_REPORT_DIR), which still gets it when the folder's disk is full."""
    targets = [folder / "errors"]
    if os.environ.get(REPORT_DIR_ENV):
        targets.append(Path(os.environ[REPORT_DIR_ENV]))
    for target in targets:
        with contextlib.suppress(OSError):  # a full or read-only disk: the other copy, or the rank's stderr, has it
            target.mkdir(parents=True, exist_ok=True)
            write_atomic(target / f"rank{rank}.txt", text, durable=False)


def failure_text(exc: BaseException, folder: Path, rank: int) -> str:
    """One line for the launcher: the first error pimm raised on purpose (a later one, e.g. while
    recording the failure on a full disk, is a consequence), else a full or read-only disk and
    the file it stopped, else the exception and where its traceback is."""
    chain, error = [], exc
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    ours = [e for e in chain if isinstance(e, PimmError)]
    if ours:
        return str(ours[-1])
    full = storage_error(exc)
    if full is not None:
        return f"cannot write {full.filename or f'in {folder}'}: {os_error_reason(full)}"
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first} (full traceback in {folder / 'logs' / f'rank{rank}.log'})"


def report_failure(exc: BaseException, folder: Path, rank: int, log: logging.Logger) -> int:
    """A rank's failure, recorded: the one line in its log and errors/rank{R}.txt, the traceback
    in logs/rank{R}.log unless pimm raised it on purpose (then the line says it all). Returns
    EXIT_FAILED. SystemExit and GeneratorExit are not failures: they are raised again."""
    if isinstance(exc, (SystemExit, GeneratorExit)):
        raise exc
    text = failure_text(exc, folder, rank)
    log.error("%s", text)
    if not isinstance(exc, PimmError):
        with contextlib.suppress(OSError), open(folder / "logs" / f"rank{rank}.log", "a", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(exc)))
    write_error(folder, rank, text)
    return EXIT_FAILED


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: with gloo in torch 2.13, freeing the last
    reference to a process group (held by DDP's reducer or FSDP2's mesh) at exit joins its worker
    threads while holding the GIL, and a worker thread that still releases a finished collective's
    tensor needs the GIL: the rank hangs forever (pytorch/pytorch#56297). Everything the run
    writes is already closed or flushed here; loader workers die with the rank (parent-death signal)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
