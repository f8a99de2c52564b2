"""What each torchrun process of `pimm test` and `pimm predict` runs: `python -m pimm.engine.eval_worker
--eval-dir D`. It imports the evaluation (torch, the models, the tasks) with the garbage collector paused
(pimm.startup), as a training rank does, then runs pimm.engine.evaluation.main over D.
"""

from __future__ import annotations

from pimm.engine.failure import exit_now
from pimm.engine.preload import preload as preload_rank
from pimm.engine.preload import several_ranks_here


def _import_evaluation() -> None:
    # deferred: torch's import runs with the collector paused, which a module-level import cannot do
    import pimm.engine.evaluation  # noqa: F401


def preload(several_ranks: bool) -> None:
    """What an evaluation rank imports (torch, the models, the tasks), made by pimm.engine.preload; pimm's
    torchrun calls it before it forks the ranks (pimm.launch.forked_rank)."""
    preload_rank(_import_evaluation, several_ranks)


def main(argv: list[str] | None = None) -> int:
    preload(several_ranks_here())  # done already if torchrun forked this rank
    # deferred: imported by preload
    from pimm.engine.evaluation import main as evaluation_main

    return evaluation_main(argv)


if __name__ == "__main__":
    exit_now(main())
