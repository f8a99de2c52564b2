"""The start-up of a process that imports torch: the cyclic garbage collector paused meanwhile.

Importing torch with DCP and dynamo (which DDP and FSDP2 import) creates about 300,000 objects that
live as long as the process. Python's cyclic collector runs after every 700 net allocations and
its older generations re-traverse everything made so far, so during those imports it scans the
same module objects dozens of times for garbage it does not find: about an eighth of a rank's
start-up CPU. `paused_gc` switches it off while a start-up makes these objects, then moves them
to the collector's permanent generation (gc.freeze), so that the collections of the training loop
skip them as well. The few thousand cyclic objects the imports leave unreachable stay allocated
instead of being collected: a fraction of a megabyte, against the 0.2 s one full collection of
everything would cost each process.

A rank that pimm's torchrun forked (pimm.launch.forked_rank) skips these imports altogether; it
says so in its environment (`rank_start`, which provenance records) and under its own process name.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

FORKED_RANK_ENV = "PIMM_FORKED_RANK"  # set in a rank that pimm's torchrun forked (pimm.launch.forked_rank)


def rank_start() -> str:
    """How this rank's process began: "fork" of pimm's torchrun, or "exec" (a new interpreter)."""
    return "fork" if os.environ.get(FORKED_RANK_ENV) == "1" else "exec"


def name_this_process(name: str) -> None:
    """The name `top` and `ps -o comm` show (Linux keeps 15 characters); no-op elsewhere. A forked rank
    would otherwise carry the name torch gave torchrun's process."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_PR_SET_NAME = 15


@contextmanager
def paused_gc() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off; then freeze what exists and switch it back on
    (if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
