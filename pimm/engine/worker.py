"""What each torchrun process runs: `python -m pimm.engine.worker --run-dir DIR`.

The launcher has already resolved and written the config into the run directory; every rank
reads that one file. A rank that fails writes its error to `errors/rank{R}.txt` so the
launcher can show the failing rank's own message after torchrun exits.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path

from pimm.errors import PimmError
from pimm.launch.node import REPORT_DIR_ENV


def write_error(run_dir: Path, rank: int, text: str) -> None:
    """errors/rank{R}.txt in the run directory, and a copy in the launcher's local report folder
    (PIMM_REPORT_DIR), which still gets it when the run directory's disk is full."""
    folders = [run_dir / "errors"]
    if os.environ.get(REPORT_DIR_ENV):
        folders.append(Path(os.environ[REPORT_DIR_ENV]))
    for folder in folders:
        path = folder / f"rank{rank}.txt"
        tmp = path.with_suffix(".tmp")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            tmp.replace(path)
        except OSError:  # a full or read-only disk: the other copy, or the rank's stderr, has it
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def failure_text(exc: BaseException, run_dir: Path, rank: int) -> str:
    """One line for the launcher: the first error pimm raised on purpose (a later one, e.g. while
    recording the failure on a full disk, is a consequence), else a full or read-only disk and
    the file it stopped, else the exception and where its traceback is."""
    from pimm.files import os_error_reason, storage_error

    chain, error = [], exc
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    ours = [e for e in chain if isinstance(e, PimmError)]
    if ours:
        return str(ours[-1])
    full = storage_error(exc)
    if full is not None:
        return f"cannot write {full.filename or f'in {run_dir}'}: {os_error_reason(full)}"
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first} (full traceback in {run_dir / 'logs' / f'rank{rank}.log'})"


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

    logging.raiseExceptions = False  # a log line that a full disk refuses must not print a traceback per call
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
    except KeyboardInterrupt:
        log.error("interrupted")
        write_error(run_dir, rank, "interrupted (SIGINT)")
        return 130
    except BaseException as exc:  # PimmError: said for people; else a bug or the environment: traceback in the log
        if isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        text = failure_text(exc, run_dir, rank)
        log.error("%s", text)
        if not isinstance(exc, PimmError):
            with contextlib.suppress(OSError), open(run_dir / "logs" / f"rank{rank}.log", "a", encoding="utf-8") as fh:
                fh.write(traceback.format_exc())
        write_error(run_dir, rank, text)
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
