"""What each torchrun process of `pimm test` and `pimm predict` runs: `python -m pimm.engine.eval_worker
--eval-dir D`. It imports the evaluation (torch, the models, the tasks) with the garbage collector paused
(pimm.startup), as a training rank does, then runs pimm.engine.evaluation.main over D.
"""

from __future__ import annotations

import os

from pimm.engine.failure import exit_now
from pimm.startup import paused_gc


def preload(several_ranks: bool) -> None:
    """Import the evaluation (torch, the models, the tasks; with several ranks what DDP's and FSDP2's
    constructors import) with the collector paused (pimm.startup). pimm's torchrun calls it before it forks
    the ranks (pimm.launch.forked_rank), which then find it all imported."""
    with paused_gc():  # torch's import makes objects that live as long as the process
        # deferred: torch's import runs with the collector paused, which a module-level import cannot do
        import pimm.engine.evaluation  # noqa: F401
        from pimm.distributed.strategy import import_data_parallel_wrappers

        if several_ranks:
            import_data_parallel_wrappers()


def main(argv: list[str] | None = None) -> int:
    preload(int(os.environ.get("WORLD_SIZE", 1)) > 1)  # done already if torchrun forked this rank
    # deferred: imported by preload
    from pimm.engine.evaluation import main as evaluation_main

    return evaluation_main(argv)


if __name__ == "__main__":
    exit_now(main())
