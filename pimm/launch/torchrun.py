"""torchrun with the same arguments and behaviour, minus the launcher's own Python traceback.

When a worker fails, plain torchrun raises ChildFailedError out of its main and prints a long
traceback from inside torch.distributed.elastic; the failing rank has already printed its own
error, so pimm prints one line per failed rank instead.
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Slurm's warning signal: torchrun would die of it; treat it as the SIGTERM torchrun forwards
    signal.signal(signal.SIGUSR1, lambda _s, _f: os.kill(os.getpid(), signal.SIGTERM))
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
