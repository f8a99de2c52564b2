"""What each torchrun process runs: `python -m pimm.engine.worker --run-dir DIR`.

The launcher has already resolved and written the config into the run directory; every rank
reads that one file. A rank that fails writes its error to `errors/rank{R}.txt` so the
launcher can show the failing rank's own message after torchrun exits (pimm.engine.failure).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pimm.config import read_run_config
from pimm.config.validate import check_config
from pimm.engine.failure import exit_now, report_failure, write_error
from pimm.engine.logs import setup_logging
from pimm.engine.preload import preload as preload_rank
from pimm.engine.preload import several_ranks_here
from pimm.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINTED
from pimm.signals import StopRequest, die_with_parent, tell_launcher_to_stop


def _import_training() -> None:
    # deferred: torch and the trainer take seconds to import; a rank installs its stop handler first
    import pimm.distributed.env  # noqa: F401
    import pimm.engine.trainer  # noqa: F401


def preload(several_ranks: bool) -> None:
    """What a training rank imports (torch, the trainer), made by pimm.engine.preload; pimm's torchrun calls it
    before it forks the ranks (pimm.launch.forked_rank)."""
    preload_rank(_import_training, several_ranks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pimm.engine.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint")
    parser.add_argument("--weight", help="warm start from these weights")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir
    if not (run_dir / "config.py").is_file():  # before logging creates run_dir/logs
        print(f"pimm.engine.worker: error: {run_dir / 'config.py'} does not exist: the run directory was not "
              "prepared. Start runs with `pimm launch` (without --dry-run), which writes it before it runs torchrun",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    rank = int(os.environ.get("RANK", 0))
    die_with_parent()  # no rank outlives torchrun
    stop = StopRequest()
    stop.install()  # from the first moment: a stop signal during start-up is honoured at step 1

    logging.raiseExceptions = False  # a log line that a full disk refuses must not print a traceback per call
    log = setup_logging(run_dir / "logs", rank)
    try:
        preload(several_ranks_here())  # done already if torchrun forked this rank
        # deferred: imported by preload, after the stop handler is installed
        from pimm.distributed.env import destroy_distributed, init_distributed
        from pimm.engine.trainer import Interrupted, Trainer

        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        log.info("rank %d pid %d (torchrun restart %d)", rank, os.getpid(), restart)
        cfg = read_run_config(run_dir / "config.py")
        check_config(cfg)
        env = init_distributed()
        trainer = Trainer(cfg, run_dir, env, stop=stop)
        # after a torchrun restart, continue from the last complete checkpoint of this run
        try:
            trainer.fit(resume=args.resume or restart > 0, weight=args.weight)
        except Interrupted:
            destroy_distributed()
            tell_launcher_to_stop()  # torchrun must shut down, not restart, after a stop
            return EXIT_CHECKPOINTED
        destroy_distributed()
        return 0
    except KeyboardInterrupt:
        log.error("interrupted")
        write_error(run_dir, rank, "interrupted (SIGINT)")
        return 130
    except BaseException as exc:  # PimmError: said for people; else a bug or the environment: traceback in the log
        return report_failure(exc, run_dir, rank, log)


if __name__ == "__main__":
    exit_now(main())
