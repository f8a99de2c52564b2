"""torchrun with the same arguments and behaviour, minus the launcher's own Python traceback.

When a worker fails, plain torchrun raises ChildFailedError out of its main and prints a long
traceback from inside torch.distributed.elastic; the failing rank has already printed its own
error, so pimm prints one line per failed rank instead.
"""

from __future__ import annotations

import sys

import torch.distributed.elastic.multiprocessing.api as elastic_api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from pimm.signals import handle_once


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "SIGUSR1" not in args.signals_to_handle:
        args.signals_to_handle += ",SIGUSR1"
    # the first signal starts the graceful shutdown; a repeat (the same signal sent to the whole
    # job, or forwarded by pimm launch) would otherwise abort it and orphan the workers
    elastic_api._terminate_process_handler = handle_once(elastic_api._terminate_process_handler)
    try:
        run(args)
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}; the workers were asked to checkpoint and exit", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            how = f"was killed by signal {-failure.exitcode}" if failure.exitcode < 0 else (
                f"exited with status {failure.exitcode}"
            )
            print(f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
