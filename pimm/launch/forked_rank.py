"""Ranks that torchrun starts by fork instead of a new interpreter.

A rank's start-up is mostly imports: torch, DCP and pimm's trainer, about 3.6 CPU seconds a process
(docs/performance.md). pimm's torchrun (pimm.launch.torchrun) imports them once, before its
rendezvous, and starts each of pimm's ranks (`python -u -m pimm.engine.worker ...` or
`... -m pimm.engine.eval_worker ...`) as a fork of itself that calls that module's `main` with the
same arguments. The rank is then what torchrun's own start would have made, minus the imports:
a child of torchrun in a session of its own (torchrun signals the whole group), its standard
output and error where torchrun sends them, unbuffered, torchrun's environment for that rank
(RANK, LOCAL_RANK, MASTER_ADDR, ...), the signal dispositions of a new interpreter, and
OMP_NUM_THREADS applied (the OpenMP runtime read it when torchrun loaded torch). Nothing has
touched CUDA in torchrun's process, so a forked rank initialises it as a new one does. The rank
keeps torchrun's command line (`ps` shows it) and is named pimm-rank-R (`top`, `ps -o comm`).
torch's own elastic_launch starts a function's ranks the same way (start_method="fork"), from an
agent with the same rendezvous store and threads.

Any other command (a user's script, a command wrapped for NUMA binding) starts as torchrun starts
it. PIMM_RANK_START=exec makes pimm's ranks start that way too (a new interpreter each).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Collection
from types import ModuleType

from pimm.engine.failure import exit_now
from pimm.errors import PimmError
from pimm.startup import FORKED_RANK_ENV, name_this_process

RANK_START_ENV = "PIMM_RANK_START"


def forked_module(args: tuple[str, ...], modules: Collection[str]) -> str | None:
    """The module of the command torchrun would run when it is `python [-u] -m MODULE ...` with MODULE
    one of `modules` (pimm's ranks), else None."""
    if len(args) < 3 or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    options = list(args[1:])
    while options and options[0] == "-u":
        options.pop(0)
    if len(options) >= 2 and options[0] == "-m" and options[1] in modules:
        return options[1]
    return None


RANK_STARTS = ("fork", "exec")


def check_rank_start() -> None:
    """Refuse a PIMM_RANK_START that is neither of RANK_STARTS, before any process starts."""
    value = os.environ.get(RANK_START_ENV)
    if value is not None and value not in RANK_STARTS:
        raise PimmError(f"{RANK_START_ENV}={value!r} is not a way to start ranks: use fork (the default: each rank "
                        "a fork of torchrun, which imported torch once) or exec (each rank a new interpreter), "
                        "or unset it")


def forking_wanted() -> bool:
    return os.environ.get(RANK_START_ENV, "fork") == "fork"


def cuda_untouched() -> bool:
    """A child forked after CUDA was initialised cannot use it; pimm's torchrun never initialises it, and
    if something did, the ranks start as new interpreters."""
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


class ForkedRank:
    """What torchrun asks of a started rank (subprocess.Popen's pid, poll and wait)."""

    def __init__(self, pid: int, args: tuple[str, ...]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is gone
                self.returncode = 1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode


def start(module: ModuleType, args: tuple[str, ...], env: dict[str, str], stdout, stderr) -> ForkedRank:
    """Fork a rank that runs module.main(ARGS after `-m MODULE`) in env; stdout and stderr: open files
    or None (torchrun's own)."""
    argv = list(args[args.index("-m") + 2:])
    sys.stdout.flush()  # what torchrun wrote but did not flush would be written again by the child
    sys.stderr.flush()
    # a signal that comes while the child still has torchrun's handlers waits until it has its own
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    ready_read, ready_write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of any fork beside threads (here torchrun's store's)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        _run_rank(module.main, argv, env, stdout, stderr, mask, ready_write)  # never returns
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(ready_write)
    os.read(ready_read, 1)  # end of file once the child leads its own process group (torchrun signals it)
    os.close(ready_read)
    return ForkedRank(pid, args)


def _run_rank(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], stdout, stderr,
              mask: set[signal.Signals], ready: int) -> None:
    code = 1
    try:
        os.setsid()  # as torchrun's start_new_session: torchrun stops a rank by signalling its group
        os.close(ready)
        for stream, fd in ((stdout, 1), (stderr, 2)):
            if stream is not None:
                os.dup2(stream.fileno(), fd)
        for sig in signal.valid_signals():  # torchrun's handlers are not the rank's
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.environ.clear()
        os.environ.update(env, **{FORKED_RANK_ENV: "1"})
        name_this_process(f"pimm-rank-{env.get('RANK', '?')}")
        sys.stdout.reconfigure(write_through=True)  # python -u, as torchrun starts a rank
        sys.stderr.reconfigure(write_through=True)
        _apply_thread_count(env)
        sys.argv = [main.__module__, *argv]
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a rank's main reports its own failures; this is what escaped it
        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)  # never the interpreter's teardown of torchrun's objects (pimm.engine.failure)


def _apply_thread_count(env: dict[str, str]) -> None:
    """The OpenMP runtime read OMP_NUM_THREADS once, when torchrun's process loaded torch; torchrun
    sets it for the ranks only (1 when it starts several)."""
    value = env.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch  # deferred: already imported by torchrun's process; named here to set its threads

        torch.set_num_threads(int(value))
