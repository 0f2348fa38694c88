"""Interrupts (Ctrl-C = SIGINT, SIGTERM) end a command cleanly, wherever they land.

A Python signal handler runs in the main thread between bytecodes, so where the signal lands
decides what happens:
- in Python code (most of the work) or between numpy calls: the handler of `signals_raise()`
  raises `Interrupted` at once (after a numpy call, when it returns);
- in a long C++ call that releases the GIL, such as OR-Tools CP-SAT's solve: the handler would
  wait for the call to return (seconds). `run_stoppable(work, stop)` runs such a call on a helper
  thread while the main thread waits in Python, where the handler runs; it then stops the call
  with the library's own mechanism (`stop`, e.g. `CpSolver.stop_search`), waits for it to return
  and re-raises. CP-SAT must not install its own SIGINT handler (`catch_sigint_signal = False`):
  it would swallow the interrupt (the search ends as if its time ran out and the command goes
  on) and, after several solves, abort the process (`std::bad_function_call`);
- in a worker process (`--jobs`): workers ignore SIGINT (`worker_ignores_interrupts`, their pool
  initializer) and keep SIGTERM's default; the parent, interrupted, stops them (`stop_children`).

The exception is raised once: a second signal while the first unwinds (a temporary file being
removed, workers being stopped) is ignored, so the cleanup is not cut short.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

__all__ = ["Interrupted", "Received", "children", "raise_if_interrupted", "run_stoppable", "signals_held",
           "signals_raise", "stop_children", "worker_ignores_interrupts"]

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (`signum`); the exit code is the shell's 128 + signal number (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Received:
    """What `signals_raise` saw: `signum`, the first signal (None: none came)."""

    def __init__(self) -> None:
        self.signum: int | None = None


# The signals_raise blocks open now. Process-wide state, as signal handlers are: an interrupt that a
# library swallowed (raised inside an optional C extension's import, it can become an ImportError that
# a fallback catches) must still stop the command before it writes a file (`raise_if_interrupted`).
_OPEN: list[Received] = []


def raise_if_interrupted() -> None:
    """Raise `Interrupted` if a signal came within an open `signals_raise` block, even when whatever
    it interrupted caught the exception. Called before files are written and between units of long
    work (layers, replay steps)."""
    for received in _OPEN:
        if received.signum is not None:
            raise Interrupted(received.signum)


@contextmanager
def signals_raise() -> Iterator[Received]:
    """Within the block, SIGINT and SIGTERM raise `Interrupted` in this (the main) thread, once;
    the previous handlers come back after it. Outside the main thread it changes nothing.

    The `Received` it yields says whether a signal came, for the caller to report an interrupt
    whatever exception it became: raised inside a C extension's initialisation (an import of
    OR-Tools, say) it surfaces as `ImportError: initialization failed`.
    """
    received = Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, _frame):
        if received.signum is None:
            received.signum = signum
            raise Interrupted(signum)

    previous = {}
    try:  # a signal that came before the handler (at start-up) may be raised by it as it is installed
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, handler)
        _OPEN.append(received)
        yield received
    finally:
        if received in _OPEN:
            _OPEN.remove(received)
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (at the OS level, this thread) for a few statements that must not be
    cut apart, e.g. creating a temporary file and remembering its name; they arrive after."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # pragma: no cover - not on POSIX
        yield
        return
    old = mask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)


def run_stoppable(work: Callable[[], T], stop: Callable[[], None]) -> T:
    """`work()` on a helper thread; if this thread is interrupted meanwhile (or any exception reaches
    it), `stop()` is called, `work` is waited for, and the exception goes on.

    For long C++ calls that release the GIL and have their own stop (CP-SAT: `solve` and
    `stop_search`); see the module docstring.
    """
    result: list = []
    failure: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)
        finally:
            done.set()

    # Wait on an Event, not Thread.join: on Python 3.11 a join cut by a signal handler's exception
    # marks the thread finished while it still runs, and the next join returns at once.
    helper = threading.Thread(target=target, name="moe-place-stoppable", daemon=True)
    helper.start()
    try:
        done.wait()
    except BaseException:
        while not done.wait(0.05):  # again until it returns: the first stop may come before the call starts
            stop()
        raise
    helper.join()
    if failure:
        raise failure[0]
    return result[0]


def worker_ignores_interrupts() -> None:
    """Pool initializer: the worker ignores SIGINT (a terminal's Ctrl-C reaches every process of the
    group; the parent decides) and dies on SIGTERM, silently, as a process does by default."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def children() -> set:
    """The live child processes now (`multiprocessing.active_children`)."""
    return set(multiprocessing.active_children())


def stop_children(before: set) -> None:
    """Terminate (SIGTERM) the child processes started since `children()` returned `before`."""
    for process in children() - before:
        process.terminate()
    for process in children() - before:
        process.join(timeout=5)
