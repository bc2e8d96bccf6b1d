"""The process pools of `torchopt migrate` (over repositories, or over one repository's files), set up
as `torchopt rewrite` sets up its own: workers get this process's LibCST speed-ups, leave Ctrl-C to
this process and die with it. On Ctrl-C or SIGTERM nothing new starts, the workers are stopped (a
commit under way finishes first, every scratch folder is removed on the way out), what finished in
the meantime is still handed over, and Interrupted is raised for the command to exit 130 or 143."""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Sequence

from torchopt.rewrite import interrupt, speedups

# After a stop signal: how long workers get to finish a commit under way before they are killed.
# A stop signal is only noted while results are awaited; this is how soon the wait looks at it.
POLL_SECONDS = 0.2

Done = Callable[[int, Any, "BaseException | None"], None]


def run_in_pool(work: Callable[[Any], Any], items: Sequence[Any], jobs: int, on_done: Done, memory: int = 0) -> None:
    """``work(item)`` for each item in ``jobs`` worker processes; ``on_done(index, result, error)``
    runs here as each finishes (``error`` is what the worker raised, or why it was lost). ``memory``:
    the bytes each worker may use beyond its start (0: no cap, for work that starts programs)."""
    pool = ProcessPoolExecutor(
        max_workers=jobs,
        initializer=interrupt.init_worker,
        initargs=(os.getpid(), memory, speedups.worker_initializer()),
    )
    inflight: dict[Future, int] = {}
    try:
        with interrupt.handle_stop_signals(abandon=False):
            inflight.update((pool.submit(_stoppable, work, item), i) for i, item in enumerate(items))
            try:
                _collect_until_done(inflight, on_done)
            except interrupt.Interrupted:
                interrupt.ignore_stop_signals()  # a second Ctrl-C must not cut the clean-up short
                _stop_workers(pool, inflight, on_done)
                raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        interrupt.reset_after_run()


def _stoppable(work: Callable[[Any], Any], item: Any) -> Any:
    """In a worker: a stop signal abandons ``work`` (None is returned then), except while it
    writes; an orphaned worker exits rather than wait for work that never comes."""
    try:
        with interrupt.abandoning():
            if interrupt.stop_requested() is None:
                return work(item)
    except interrupt.Interrupted:
        pass
    finally:
        interrupt.exit_if_orphaned()
    return None


def _collect_until_done(inflight: dict[Future, int], on_done: Done) -> None:
    """Hand over results as they come, looking for a stop signal between waits (raising it in the
    pool's own bookkeeping could leave its locks held)."""
    while True:
        signum = interrupt.stop_requested()
        if signum is not None:
            raise interrupt.Interrupted(signum)
        if not inflight:
            return
        done, _ = wait(inflight, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
        for fut in done:
            _hand_over(fut, inflight.pop(fut), on_done)


class WorkerStopped(Exception):
    """A worker was stopped by a signal from outside before it finished its item."""


def _hand_over(fut: Future, index: int, on_done: Done) -> None:
    error = fut.exception()
    result = fut.result() if error is None else None
    if error is None and result is None:
        error = WorkerStopped("its worker process was stopped before it finished")
    on_done(index, result, error)


def _stop_workers(pool: ProcessPoolExecutor, inflight: dict[Future, int], on_done: Done) -> None:
    """Nothing queued starts; running workers are asked to stop, and work that finished meanwhile is
    handed over, so that a commit that was made is also recorded."""

    def record(fut: Future) -> None:
        if fut.result() is not None:
            on_done(inflight[fut], fut.result(), None)

    interrupt.stop_pool(pool, inflight, record)
