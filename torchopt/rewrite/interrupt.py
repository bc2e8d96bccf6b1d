"""Stopping a run cleanly on Ctrl-C (SIGINT), SIGTERM or SIGHUP (the terminal or editor went away).

No new file is started after the signal; a write that has begun is let finish (each write is a temp
file and a rename, so every file is either its old or its new text); the analysis under way is
abandoned. Pool workers ignore Ctrl-C (their parent decides), stop on SIGTERM, and die with their
parent even when it is killed outright (Linux: the parent-death signal; elsewhere a check of the
parent before each file and each write).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from torchopt.rewrite import budget

if TYPE_CHECKING:  # the pool's modules are imported when a pool runs (a one-file check has none)
    from concurrent.futures import Future

# SIGHUP where the platform has it: a closed terminal or an editor dropping its filter stops a run
# the way SIGTERM does (the stdin filter still gives its input back).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
_PR_SET_PDEATHSIG = 1


class Interrupted(BaseException):
    """A stop signal arrived; ``signum`` is which. Not a KeyboardInterrupt, so that no library's
    handler for Ctrl-C turns it into something else on the way up."""

    def __init__(self, signum: int, written: int | None = None) -> None:
        super().__init__(signum)
        self.signum = signum
        self.written = written  # files written before the stop, where known

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Process:
    """How this process answers a stop signal (one per process: signal handlers are per process)."""

    def __init__(self) -> None:
        self.worker = False  # a pool worker, rather than the process the user started
        self.parent_pid = 0  # the torchopt process a worker works for, to notice its death
        self.direct_parent = 0  # a worker's parent when it started (torchopt, or the fork server)
        self.abandon = False  # a stop signal abandons the work under way (else it is only noted)
        self.writing = False  # a file write is under way: let it finish
        self.stop: int | None = None  # the stop signal received, if any


_this = _Process()


def stop_requested() -> int | None:
    """The stop signal this process received (or its parent's death, for a worker), else None."""
    if _this.stop is None and _this.worker and _parent_gone():
        _this.stop = signal.SIGTERM
    return _this.stop


def is_writing() -> bool:
    return _this.writing


@contextmanager
def writing() -> Iterator[None]:
    """Around one file write: none starts after a stop, and a stop signal that arrives while it
    runs waits until it is done."""
    signum = stop_requested()
    if signum is not None:
        raise Interrupted(signum)
    _this.writing = True
    try:
        yield
    finally:
        _this.writing = False


def _on_stop(signum: int, frame: object) -> None:
    _this.stop = _this.stop or signum
    if _this.writing:
        return  # the write finishes; the caller sees stop_requested() before the next file
    if _this.abandon:
        raise Interrupted(signum)
    if _parent_gone():
        os._exit(128 + signum)  # an idle worker, and nobody left to hand it work or take results
    # otherwise the signal is noted: the code that hands out work sees stop_requested()


def exit_if_orphaned() -> None:
    """A worker whose parent died stops here rather than wait for work that never comes."""
    if _parent_gone():
        os._exit(128 + signal.SIGTERM)


@contextmanager
def handle_stop_signals(abandon: bool) -> Iterator[None]:
    """Within this block SIGINT and SIGTERM raise Interrupted where they land when ``abandon``
    (except during a write, see :func:`writing`); otherwise they are only noted, for code that
    polls :func:`stop_requested` (a signal raised inside a process pool's bookkeeping could leave
    its locks held). Only the main thread can install handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_stop) for sig in STOP_SIGNALS}
    was = _this.abandon
    _this.abandon = abandon
    try:
        yield
    finally:
        _this.abandon = was
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals() -> None:
    """While the main process winds down after a stop: a second Ctrl-C must not cut that short."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def reset_after_run() -> None:
    _this.stop = None


def init_worker(parent_pid: int, memory: int, then: Callable[[], object] | None = None) -> None:
    """Initializer of a pool worker: die with the parent, leave Ctrl-C to it, stop on SIGTERM,
    and bound the memory one file may take."""
    _this.worker, _this.parent_pid, _this.stop = True, parent_pid, None
    # Under fork the worker's parent is torchopt itself; under forkserver it is the fork server,
    # which exits when torchopt does. Either way the worker is re-parented when its parent dies.
    _this.direct_parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):  # a hang-up reaches the whole process group: the parent decides
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_stop)
    _die_with_parent()
    if _parent_gone():  # it died before the line above took effect
        os._exit(128 + signal.SIGTERM)
    if memory > 0:
        budget.set_memory_budget(memory)
        budget.limit_worker_memory(memory)
    if then is not None:
        then()


@contextmanager
def abandoning() -> Iterator[None]:
    """Files are being analysed: a stop signal now abandons the analysis (not a write)."""
    was = _this.abandon
    _this.abandon = True
    try:
        yield
    finally:
        _this.abandon = was


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent check before each file and write still applies


def _parent_gone() -> bool:
    if not _this.worker:
        return False
    if os.getppid() != _this.direct_parent:
        return True
    try:
        os.kill(_this.parent_pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # it exists (another user's process would say EPERM; torchopt's own never does)
    return False


# Seconds a stopped pool's workers get to finish the write under way before they are killed.
STOP_GRACE_SECONDS = 3.0


def stop_pool(pool: Any, inflight: Iterable[Future], record: Callable[[Future], None]) -> None:
    """After a stop signal: nothing queued starts, running workers are asked to stop (SIGTERM: they
    abandon their work unless it is writing), ``record`` gets each future that finished meanwhile (so
    that what was written is also reported), and workers still running after the grace period are
    killed (stuck in native code, where signals wait: nothing is being written)."""
    import multiprocessing
    from concurrent.futures import wait

    futures = list(inflight)
    for fut in futures:
        fut.cancel()
    workers = list((getattr(pool, "_processes", None) or {}).values()) or multiprocessing.active_children()
    for proc in workers:
        if proc.is_alive():
            proc.terminate()
    for fut in wait(futures, timeout=STOP_GRACE_SECONDS).done:
        if not fut.cancelled() and fut.exception() is None:
            record(fut)
    for proc in workers:
        proc.join(timeout=0.5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)
