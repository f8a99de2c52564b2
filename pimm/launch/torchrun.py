"""torchrun with the same arguments and behaviour, minus the launcher's own Python traceback.

When a worker fails, plain torchrun raises ChildFailedError out of its main and prints a long
traceback from inside torch.distributed.elastic. Instead, under `pimm launch` this writes how
each failed rank ended (exit status or signal, and whether torchrun itself signalled it while
shutting the group down) to `$PIMM_REPORT_DIR/torchrun.json`, from which the launcher names the
rank that failed first; run on its own it prints one line per failed rank, that one first.

pimm's own ranks (`-m pimm.engine.worker`, `-m pimm.engine.eval_worker`) are forked from this
process after it has imported what they import, once (pimm.launch.forked_rank); any other
command, or every rank with PIMM_RANK_START=exec, starts as torchrun starts it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from pimm.engine import eval_worker, worker
from pimm.engine.failure import REPORT_DIR_ENV
from pimm.launch import forked_rank
from pimm.launch.node import first_causes
from pimm.signals import handle_once
from pimm.startup import paused_gc

RANK_ENTRIES = {module.__name__: module for module in (worker, eval_worker)}  # pimm's ranks: forked from here
_signalled: set[int] = set()  # pids of the workers torchrun signalled (to stop the group)


def _remember_signalled(close):
    def close_and_remember(self, death_sig=None):
        _signalled.add(self.proc.pid)
        return close(self, death_sig)

    return close_and_remember


def _fork_pimm_ranks(popen, entry):
    """SubprocessHandler._popen that forks pimm's ranks from this process (pimm.launch.forked_rank)."""
    def popen_or_fork(self, args, env):
        if forked_rank.forked_module(args, RANK_ENTRIES) != entry.__name__ or not forked_rank.cuda_untouched():
            return popen(self, args, env)
        return forked_rank.start(entry, args, env, self._stdout, self._stderr)

    return popen_or_fork


def failures_of(exc) -> list[dict]:
    """Each failed rank as torchrun saw it (exc: its ChildFailedError), in the order it noticed them."""
    host = socket.gethostname()
    return [
        {"rank": rank, "local_rank": f.local_rank, "pid": f.pid, "host": host, "exitcode": f.exitcode,
         "signal": f.signal_name() if f.exitcode < 0 else None,
         "stopped_by_torchrun": f.exitcode < 0 and f.pid in _signalled}
        for rank, f in exc.failures.items()
    ]


def main(argv: list[str] | None = None) -> int:
    with paused_gc():  # torch's import makes objects that live as long as torchrun (pimm.startup)
        # deferred: torch's import runs with the collector paused, which a module-level import cannot do
        import torch.distributed.elastic.multiprocessing.api as elastic_api
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
        from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "SIGUSR1" not in args.signals_to_handle:
        args.signals_to_handle += ",SIGUSR1"
    # the first signal starts the graceful shutdown; a repeat (the same signal sent to the whole
    # job, or forwarded by pimm launch) would otherwise abort it and orphan the workers
    elastic_api._terminate_process_handler = handle_once(elastic_api._terminate_process_handler)
    SubprocessHandler.close = _remember_signalled(SubprocessHandler.close)
    entry = RANK_ENTRIES.get(args.training_script) if args.module and forked_rank.forking_wanted() else None
    if entry is not None:
        try:
            several_ranks = args.nnodes not in ("1", "1:1") or str(args.nproc_per_node) != "1"
            entry.preload(several_ranks)  # the ranks' imports, made once here for every rank forked from here
        except Exception:  # noqa: BLE001 - each rank then starts anew and reports the failing import itself
            entry = None
        if entry is not None:
            SubprocessHandler._popen = _fork_pimm_ranks(SubprocessHandler._popen, entry)
    report_dir = os.environ.get(REPORT_DIR_ENV)
    try:
        run(args)
    except SignalException as exc:
        if not report_dir:
            print(f"torchrun: stopped by {exc.sigval.name}; the workers were asked to checkpoint and exit",
                  file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        failures = failures_of(exc)
        if report_dir:
            try:
                (Path(report_dir) / "torchrun.json").write_text(json.dumps(failures))
                return 1
            except OSError:
                pass  # then say it here
        for f in first_causes(failures, {}):
            how = (f"was killed by signal {-f['exitcode']} ({f['signal']})" if f["exitcode"] < 0
                   else f"exited with status {f['exitcode']}")
            print(f"torchrun: rank {f['rank']} (local rank {f['local_rank']}, pid {f['pid']}) {how}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
