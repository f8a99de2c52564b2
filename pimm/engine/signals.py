"""Stop requests: SIGTERM / SIGUSR1 (what Slurm sends before a time limit) ask every rank to
finish its step, write a complete checkpoint and exit with EXIT_CHECKPOINTED. A second signal
more than GRACE_S later exits at once (a signal that torchrun forwards right after the
original one reaches a worker counts as the same request)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from pimm.errors import EXIT_SECOND_SIGNAL

GRACE_S = 2.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Set by a signal on any rank; `agreed()` makes all ranks stop after the same step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._in_flight: tuple[torch.Tensor, dist.Work] | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self.signal_name is not None and now - self._first_at > GRACE_S:
            os._exit(EXIT_SECOND_SIGNAL)
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self._first_at = now

    def agreed(self, device: torch.device) -> bool:
        """Called once per step on every rank; True on all ranks at the same step when any rank has
        a request. The flags are all-reduced asynchronously and read one step later, so the check
        adds no synchronisation point to the step (a signal is honoured one step later)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.signal_name is not None
        stop = False
        if self._in_flight is not None:
            flag, work = self._in_flight
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        self._in_flight = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        if stop:
            self.signal_name = self.signal_name or "a signal on another rank"
        return stop

    def drain(self) -> None:
        """Wait for the all-reduce in flight (before other collectives end the run)."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None
