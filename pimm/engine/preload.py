"""A rank's imports, made before it works: by the rank itself, or once by pimm's torchrun before it forks
the ranks (pimm.launch.forked_rank), which then find them made. Both entry points
(pimm.engine.worker, pimm.engine.eval_worker) name what they import and call `preload`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pimm.startup import paused_gc


def preload(import_entry: Callable[[], None], several_ranks: bool) -> None:
    """import_entry() with the collector paused (pimm.startup), and with several ranks what DDP's and
    FSDP2's constructors import (pimm.distributed.strategy.import_data_parallel_wrappers)."""
    with paused_gc():  # torch's import makes objects that live as long as the process
        import_entry()
        if several_ranks:
            # deferred: imports torch, which must come inside the pause
            from pimm.distributed.strategy import import_data_parallel_wrappers

            import_data_parallel_wrappers()


def several_ranks_here() -> bool:
    """In a rank torchrun started: whether the run has more than one rank."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1
