"""What each torchrun process runs: `python -m pimm.engine.worker --run-dir DIR`.

The launcher has already resolved and written the config into the run directory; every rank
reads that one file. A rank that fails writes its error to `errors/rank{R}.txt` so the
launcher can show the failing rank's own message after torchrun exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from pimm.errors import PimmError


def _write_error(run_dir: Path, rank: int, text: str) -> None:
    err_dir = run_dir / "errors"
    err_dir.mkdir(parents=True, exist_ok=True)
    (err_dir / f"rank{rank}.txt").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pimm.engine.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint")
    parser.add_argument("--weight", help="warm start from these weights")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir
    if not (run_dir / "config.py").is_file():  # before logging creates run_dir/logs
        from pimm.errors import EXIT_BAD_INPUT

        print(f"pimm.engine.worker: error: {run_dir / 'config.py'} does not exist: the run directory was not "
              "prepared. Start runs with `pimm launch` (without --dry-run), which writes it before it runs torchrun",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    rank = int(os.environ.get("RANK", 0))
    from pimm.signals import StopRequest, die_with_parent, tell_launcher_to_stop

    die_with_parent()  # no rank outlives torchrun
    stop = StopRequest()
    stop.install()  # from the first moment: a stop signal during start-up is honoured at step 1

    from pimm.engine.logs import setup_logging

    log = setup_logging(run_dir / "logs", rank)
    try:
        from pimm.config import load_config
        from pimm.config.validate import check_config
        from pimm.distributed.env import destroy_distributed, init_distributed
        from pimm.engine.trainer import Interrupted, Trainer
        from pimm.errors import EXIT_CHECKPOINTED

        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        log.info("rank %d pid %d (torchrun restart %d)", rank, os.getpid(), restart)
        cfg = load_config(run_dir / "config.py")
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
    except PimmError as exc:
        log.error("%s", exc)
        _write_error(run_dir, rank, str(exc))
        return 1
    except KeyboardInterrupt:
        log.error("interrupted")
        _write_error(run_dir, rank, "interrupted (SIGINT)")
        return 130
    except Exception as exc:  # a bug or an environment failure: keep the traceback in the rank log
        log.error("unexpected error: %s: %s", type(exc).__name__, exc)
        logging.getLogger("pimm").debug("traceback", exc_info=True)
        with open(run_dir / "logs" / f"rank{rank}.log", "a", encoding="utf-8") as fh:
            fh.write(traceback.format_exc())
        _write_error(
            run_dir, rank,
            f"{type(exc).__name__}: {exc} (full traceback in {run_dir / 'logs' / f'rank{rank}.log'})",
        )
        return 1


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


if __name__ == "__main__":
    exit_now(main())
