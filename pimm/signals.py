"""The signal policy of a pimm run, in one place: who catches what, who forwards, who ignores.

Processes of one single-node run and what each does with a stop signal (SIGTERM, SIGUSR1, and
SIGINT: Ctrl-C on a terminal, which reaches pimm launch and torchrun but not the ranks, which
torchrun starts in sessions of their own):

  pimm launch           forwards it to torchrun (`StopForwarder`), and a repeat within GRACE_S
                        too; a second signal later than that kills torchrun at once (SIGKILL:
                        the ranks die with it, the last complete checkpoint stays) and pimm
                        exits 76. Holds the run lock; torchrun dies with it (parent-death SIGKILL).
  torchrun (shim)       handles the FIRST stop signal only (`handle_once`): it asks every rank
                        to stop (the same signal to each rank's process group) and waits;
                        repeats (the same signal sent to the whole job, or forwarded by
                        pimm launch) are ignored, so its graceful shutdown is never cut short.
  rank (worker)         catches it (`StopRequest`): finishes its step, agrees with the other
                        ranks on the step, writes one complete checkpoint, waits until rank 0
                        has promoted it, then exits 75. A repeat within GRACE_S is the same
                        request; a second signal later than that exits at once (76). A rank
                        that learned of the stop from another rank takes its own later signal
                        as the same request too. Dies
                        with torchrun (parent-death SIGKILL) and then tells torchrun to stop
                        (so a signal that reached only the ranks is not taken for a failure
                        and restarted under --resources.max-restarts).
  loader worker         ignores stop signals (`ignore_stop_signals`, the DataLoader's
                        worker_init_fn): the rank owns the decision. Torchrun and Slurm signal
                        whole process groups, and a worker killed by its default action would
                        crash the rank before it could checkpoint. Dies with its rank.

So Ctrl-C checkpoints and exits 75 (`pimm launch --train.resume RUN_DIR` continues), and a
second Ctrl-C (after GRACE_S) stops at once with status 76.

This module imports torch only inside `StopRequest.agreed`, so the launcher can use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

from pimm.errors import EXIT_SECOND_SIGNAL

GRACE_S = 2.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it dies (Linux prctl); if the parent is
    already gone (we were re-parented to init), exit now. No-op where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent == 1 or os.getppid() != parent:
        os._exit(1)


def ignore_stop_signals(_worker_id: int | None = None) -> None:
    """For DataLoader workers (usable as worker_init_fn): stop signals are the rank's business;
    the worker also dies with its rank. The worker was forked with them blocked
    (`loader_workers_forked`): ignored first, then unblocked, so one sent meanwhile is dropped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent()


@contextlib.contextmanager
def loader_workers_forked():
    """Start DataLoader workers (create the loader's iterator) inside this: stop signals are
    blocked while they fork, so a worker starts with them blocked. Torch's worker loop installs a
    SIGTERM handler that re-raises the default action before worker_init_fn runs; a stop signal
    to the whole job in that window would kill the worker and with it the rank. In the rank a
    signal that arrived meanwhile is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def handle_once(handler):
    """Wrap a signal handler so that it runs for the first stop/termination signal only; every
    later SIGTERM, SIGUSR1, SIGINT, SIGHUP or SIGQUIT is then ignored."""

    def first_only(signum, frame):
        for sig in (*STOP_SIGNALS, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, _ignore)
        return handler(signum, frame)

    return first_only


class StopForwarder:
    """In pimm launch, around waiting for the child `proc` (torchrun): a stop signal is passed on
    as it came, and so is a repeat within GRACE_S; one later than that kills `proc` at once.
    `signal_name` is the first signal's name (None without one), `killed` says whether a second
    one ended the run."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.signal_name: str | None = None
        self.killed = False
        self._first_at = 0.0
        self._previous: dict = {}

    def __enter__(self) -> StopForwarder:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self.signal_name is None:
            self.signal_name, self._first_at = signal.Signals(signum).name, now
        elif now - self._first_at > GRACE_S:
            self.killed = True
            signum = signal.SIGKILL
        if self.proc.poll() is None:
            self.proc.send_signal(signum)


def tell_launcher_to_stop() -> None:
    """Called by local rank 0 after a stop: SIGTERM to torchrun (our parent), which then shuts the
    group down instead of treating exit 75 as a failure to restart. Harmless when it is already
    shutting down (it ignores repeats)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        parent = os.getppid()
        if parent > 1:
            os.kill(parent, signal.SIGTERM)


def ignore_further_stop_signals() -> None:
    """A rank that has checkpointed and is on its way out ignores any later stop signal."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore)


def _ignore(_signum, _frame) -> None:
    """A Python-level 'ignore': unlike SIG_IGN, a signal already pending when it is installed is
    absorbed quietly (CPython reports such a signal as 'ignored due to race condition')."""


class StopRequest:
    """Set by a stop signal on any rank; `agreed()` makes all ranks stop after the same step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._signalled_at: float | None = None  # when this process got its own first stop signal
        self._in_flight = None  # (flag tensor, async work) of the previous step
        self._group = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        # Only this process's own signals count towards a second one: a rank that learned of the stop from
        # another rank (`agreed`) still gets its own signal, later (Slurm and torchrun signal each node
        # and rank at their own moment), and that is the same request, not a second one.
        now = time.monotonic()
        if self._signalled_at is not None:
            if now - self._signalled_at > GRACE_S:
                os._exit(EXIT_SECOND_SIGNAL)
            return
        self._signalled_at = now
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def use_group(self, group) -> None:
        """The process group the flags travel on: a CPU (gloo) group of its own, so reading the
        flag never waits for the accelerator (no device synchronisation per step)."""
        self._group = group

    def agreed(self) -> bool:
        """Called once per step on every rank; True on all ranks at the same step when any rank has
        a request. The flags are all-reduced asynchronously and read one step later, so the check
        adds no synchronisation point to the step (a signal is honoured one step later)."""
        # deferred: the launcher uses this module without torch (see the module docstring)
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signal_name is not None
        stop = False
        if self._in_flight is not None:
            flag, work = self._in_flight
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([1.0 if self.signal_name else 0.0])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._in_flight = (flag, work)
        if stop:
            self.signal_name = self.signal_name or "a signal on another rank"
        return stop

    def agreed_now(self) -> bool:
        """A blocking agreement (at epoch boundaries, e.g. after a validation that a signal
        interrupted): True on every rank if any rank has a request by now."""
        # deferred: the launcher uses this module without torch (see the module docstring)
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signal_name is not None
        stop = False
        if self._in_flight is not None:  # the previous step's flags
            flag, work = self._in_flight
            work.wait()
            stop = bool(flag.item())
            self._in_flight = None
        flag = torch.tensor([1.0 if self.signal_name else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        stop = stop or bool(flag.item())
        if stop:
            self.signal_name = self.signal_name or "a signal on another rank"
        return stop

    def drain(self) -> None:
        """Wait for the all-reduce in flight (before other collectives end the run)."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None
